"""The cluster planner (``flowrl plan cluster=<name>``, flowrl/compiler/cost.py "Cluster planning"):
each cost term on a hand-worked example, the colocated <-> partitioned choice flipping where the
hand calculation says it must, the calibration re-derived from the benchmark results it cites, and
a model folder holding only a config.json.

The hand examples use a toy cluster and model with round numbers and round calibration constants
(fixture ``round_cal``), so every expected value below is worked out in its comment."""
import json
import math
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.compiler import cost
from flowrl.compiler.cluster import ClusterConfig
from flowrl.compiler.cost import (
    CALIBRATION,
    ClusterCosts,
    Fit,
    Workload,
    kv_token_bytes,
    matmul_efficiency,
    matmul_params,
    plan_cluster,
    stage_kind,
)
from flowrl.models.size import ModelSize

REPO = Path(__file__).resolve().parents[2]

# toy cluster: 2 nodes x 4 GPUs, peak 1e15 FLOP/s, 100 GB HBM at 1e12 B/s, NVLink 100 GB/s,
# 200 GB/s network per node (50 GB/s per GPU), PCIe 10 GB/s
TOY = dict(name="toy", gpu="toy", gpus_per_node=4, nodes=2, peak_bf16_flops=1e15, hbm_bytes=100e9,
           hbm_bw=1e12, nvlink_bw=100e9, internode_bw=200e9, host_bw=10e9)
# toy model: 1e9 params, tied (so every parameter multiplies each token: N_mm = 1e9), 10 layers,
# hidden 1000, 10 heads x 100 (d = 1000), 2 KV heads, vocab 10,000
MODEL = ModelSize(n_params=10**9, n_layers=10, n_kv_heads=2, head_dim=100, dtype_bytes=4,
                  hidden_size=1000, n_heads=10, vocab_size=10_000, intermediate_size=4000,
                  tied_embeddings=True)
GRPO_STAGES = {"sample": (None, "free"), "rollout": ("rollout", "decode"),
               "reward": (None, "free"), "old_logprobs": ("actor", "forward"),
               "advantage": (None, "free"), "update": ("actor", "train")}


@pytest.fixture
def round_cal(monkeypatch):
    """Round calibration constants: eff(h=1000) = 0.8 · 1000 / (1000 + 1000) = 0.4 for both
    training and forward; decode at 0.5 of HBM; 1e-5 host seconds per token."""
    for k, v in {"matmul_ceiling": 0.8, "h0_train": 1000.0, "h0_forward": 1000.0,
                 "decode_bw_eff": 0.5, "host_s_per_token_1": 1e-5, "host_s_per_token_4": 1e-5,
                 "reload_fixed_s": 0.2, "gather_bw_local": 1e10, "offload_bw": 1e9,
                 "onload_bw": 2e9, "sleep_wake_fixed_s_1": 0.8, "sleep_wake_fixed_s_4": 1.0,
                 "logit_bytes": 10.0, "nccl_eff": 0.5}.items():
        monkeypatch.setitem(CALIBRATION, k, Fit(v, "test", "test"))


def toy_costs(batch=64, prompt=100, response=200, n=4, gpus_per_node=4, nodes=2, **kw):
    cl = ClusterConfig(**{**TOY, "gpus_per_node": gpus_per_node, "nodes": nodes})
    return ClusterCosts(cl, MODEL, Workload(batch, prompt, response), n, dict(GRPO_STAGES), **kw)


def test_cluster_links():
    c = ClusterConfig(**TOY)
    assert c.world == 8
    assert c.link_bw(4) == 100e9  # one node: NVLink
    assert c.link_bw(8) == 50e9  # across nodes: 200 GB/s per node / 4 GPUs
    assert c.between_pools_bw(2, 2) == 100e9  # both pools in one node
    assert c.between_pools_bw(4, 4) == 100e9  # min(NVLink 100, node network 200)
    with pytest.raises(ValueError, match="cluster.nodes must be >= 1"):
        ClusterConfig(**{**TOY, "nodes": 0})


def test_shape_helpers(round_cal):
    assert matmul_efficiency(1000) == pytest.approx(0.4)  # 0.8 · 1000 / 2000
    assert matmul_efficiency(3000, forward_only=True) == pytest.approx(0.6)  # 0.8 · 3000 / 4000
    assert matmul_params(MODEL) == 10**9  # tied: the embedding is the LM head's matmul
    untied = ModelSize(**{**MODEL.__dict__, "tied_embeddings": False})
    assert matmul_params(untied) == 10**9 - 10_000 * 1000  # the input lookup multiplies nothing
    assert kv_token_bytes(MODEL) == 8000  # 2 (K,V) · 10 layers · 2 heads · 100 · 2 bytes


def test_forward_term(round_cal):
    # B·S·(2·N_mm + 2·L·d·S), S = 300: 64·300·(2e9 + 2·10·1000·300) = 19,200 · 2.006e9
    # = 3.85152e13 FLOPs over 4 GPUs · 1e15 · 0.4 = 1.6e15 FLOP/s -> 0.024072 s
    t = toy_costs().forward_term("old_logprobs", 4)
    assert t.seconds == pytest.approx(0.024072, rel=1e-12)


def test_train_terms_inside_and_across_nodes(round_cal):
    c = toy_costs()
    # compute: 19,200 tokens · (6e9 + 6·10·1000·300 = 6.018e9) = 1.155456e14 FLOPs / 1.6e15 = 0.072216
    # FSDP: 4800 tokens per GPU -> 1 micro-batch of 16384; bytes (p-1)/p·(1·2·2N + 4N) = 0.75 · 8e9
    # = 6e9 over NVLink 100e9 · 0.5 = 5e10 B/s -> 0.12 s
    compute, comm = c.train_terms("update", 4)
    assert compute.seconds == pytest.approx(0.072216, rel=1e-12)
    assert comm.seconds == pytest.approx(0.12, rel=1e-12)
    # 8 GPUs span both nodes: link 50e9 · 0.5 = 2.5e10; 7/8 · 8e9 = 7e9 -> 0.28 s; compute halves
    compute, comm = c.train_terms("update", 8)
    assert compute.seconds == pytest.approx(0.036108, rel=1e-12)
    assert comm.seconds == pytest.approx(0.28, rel=1e-12)
    assert cost._side_seconds([compute, comm]) == pytest.approx(0.28)  # overlapped: the max


def test_rollout_terms_kv_limited_and_not(round_cal):
    c = toy_costs()
    assert c.rollout_tp == 1  # 2e9 bf16 bytes <= half of 0.9 · 100e9
    # 4 GPUs = 4 engines of 16 rows. prefill: 16/4 prompts (n=4 share one) · 100 = 400 tokens ·
    # (2e9 + 2·10·1000·100 = 2.002e9) = 8.008e11 FLOPs / (1e15 · 0.4) = 0.002002 s
    # KV per sequence: 8000 B · (100/4 + 200) = 1.8e6 B; a 10 MB budget holds 5 -> 4 waves.
    # a decode step: bytes 2e9 + 5 · 200 (mean context) · 8000 = 2.008e9 / (1e12 · 0.5) = 4.016e-3 s
    # (> FLOPs 5·(2e9 + 4·10·1000·200)/4e14 = 2.51e-5, > host 5 · 1e-5): 4 · 200 · 4.016e-3 = 3.2128 s
    (prefill, decode), note = c.rollout_terms(4, 10e6, colocated=False)
    assert prefill.seconds == pytest.approx(0.002002, rel=1e-12)
    assert decode.seconds == pytest.approx(3.2128, rel=1e-12)
    assert note == "decode bound by HBM bandwidth, concurrency limited by KV cache"
    # 1 GB of KV holds all 16 rows: one wave, 2e9 + 16·200·8000 = 2.0256e9 B -> 200 · 4.0512e-3
    (_, decode), note = c.rollout_terms(4, 1e9, colocated=False)
    assert decode.seconds == pytest.approx(0.81024, rel=1e-12)
    assert note.endswith("limited by batch")
    (_, decode), note = c.rollout_terms(4, 1e6, colocated=False)  # < one sequence's 1.8 MB
    assert decode.seconds == math.inf and note == "no KV room"


def test_sync_and_swap_terms(round_cal):
    c = toy_costs()
    # colocated on 8: gather max(2e9 · 7/8 / (50e9 · 0.5), 2e9 / 1e10) = max(0.07, 0.2) = 0.2;
    # reload: 0.2 fixed + 2e9 / 1e12 = 0.202
    gather, load = c.sync_terms(True, 8, 8)
    assert (gather.seconds, load.seconds) == (pytest.approx(0.2), pytest.approx(0.202))
    # partitioned 4 + 4 on two nodes: broadcast 2e9 / (min(100e9, 200e9) · 0.5) = 0.04
    bcast, load = c.sync_terms(False, 4, 4)
    assert (bcast.seconds, load.seconds) == (pytest.approx(0.04), pytest.approx(0.202))
    # 4 engines per GPU (4 · 2e9 <= a quarter of 90e9): sleep+wake 1.0 + 2 · 8e9 / 10e9 = 2.6 s;
    # trainer offload 12·1e9/8 = 1.5e9 B: 1.5e9/1e9 + 1.5e9/2e9 = 2.25 s
    assert c.engine_procs(True) == 4 and c.engine_procs(False) == 1
    sleep, off = c.swap_terms(8, offload_train=True)
    assert (sleep.seconds, off.seconds) == (pytest.approx(2.6), pytest.approx(2.25))


def test_memory_sizes(round_cal):
    c = toy_costs()
    assert c.train_state_bytes(8) == 2e9  # 16 · 1e9 / 8
    # 34 · 16384 · 1000 · 10 layers = 5,570,560,000 + logits of 16384 · 200/300 response tokens
    # · 10,000 vocab · 10 bytes = 1,092,266,666.67
    assert c.activation_bytes() == pytest.approx(5_570_560_000 + 16384 * 200 / 300 * 1e5)
    c.activation_checkpointing = True  # 2·T·h per layer + one layer's 34·T·h
    assert c.activation_bytes() == pytest.approx(2 * 16384 * 1000 * 10 + 557_056_000
                                                 + 16384 * 200 / 300 * 1e5)


def test_memory_of_a_lora_model_counts_the_adapters_state(round_cal):
    """LoRA: the frozen fp32 weights and the adapters' master, grad and 2 moments, (4·N + 16·A)
    / p (the plan counted 16·N: a 70B LoRA job "fit nothing"; fresh-user report)."""
    import dataclasses

    cl = ClusterConfig(**TOY)
    c = ClusterCosts(cl, dataclasses.replace(MODEL, trainable_params=10**7), Workload(64, 100, 200),
                     4, dict(GRPO_STAGES))
    assert c.train_state_bytes(8) == (4e9 + 16e7) / 8
    assert c.resident_train_bytes(8) == (4e9 + 12e7) / 8
    assert c.train_state_label() == "fp32 params + LoRA adapters' grads+AdamW /p"
    assert toy_costs().train_state_label() == "fp32 params+grads+AdamW /p"


def _grpo_plan():
    from flowrl.compiler.plan import compile_plan
    from flowrl.graph.validate import load_graph

    tree = {"algorithm": {"kl_coef": 0.0, "recompute_old_logprobs": True},
            "rollout": {"sampling": {"max_new_tokens": 256}}}
    return compile_plan(load_graph(REPO / "graphs/grpo.yaml"), tree)


def test_choice_flips_where_the_hand_calculation_says(round_cal):
    plan = _grpo_plan()
    stages = {c.stage.name: (c.stage.role, stage_kind(c.stage.op, c.stage.role)) for c in plan.stages}
    assert stages == GRPO_STAGES
    # 1 node of 2 GPUs (one split: rollout 1 / train 1); KV room is never short here.
    # (a) decode-bound: 8 rows, P=10, R=2000.
    #   partitioned, rollout GPU (1 engine, 8 rows): prefill 8/4·10 = 20 tok · (2e9 + 2·1e4·10)
    #   / 4e14 = 1.0001e-4; decode 2000 steps of (2e9 + 8 · 1010 ctx · 8000 B) / 5e11 = 4.12928e-3
    #   -> 8.25856; side 8.25866. train GPU: forward 8·2010·(2e9 + 2·1e4·2010) / 4e14 = 0.082016,
    #   update 8·2010·(6e9 + 6·1e4·2010) / 4e14 = 0.246048; side 0.328064. k=1: max(8.25866,
    #   0.328064) + broadcast 2e9/5e10 = 0.04 + reload 0.202 (+ 5.5e-6 transfers) = 8.50067
    #   colocated (4 engines/GPU, 4 rows each): prefill 5.0005e-5 + decode 2000 · (2e9 + 4·1010·8000)
    #   / 5e11 = 8.12928 + forward 0.041008 + update 0.123024 (its collectives 8e9/2 / 5e10 = 0.08
    #   hide) + gather max(0.02, 0.2) + reload 0.202 + sleep/wake 1.0 + 2·8e9/1e10 = 2.6 = 11.29536
    #   -> partitioned k=1, 1.33x faster.
    cp = plan_cluster(plan, toy_costs(batch=8, prompt=10, response=2000, n=4, nodes=1, gpus_per_node=2))
    assert cp.chosen.label == "partitioned rollout=1 train=1 k=1"
    assert cp.chosen.step_s == pytest.approx(8.50067, abs=1e-5)
    assert cp.colocated.step_s == pytest.approx(11.29536, abs=1e-5)
    # (b) train-bound: 4096 rows, P=100, R=1 (413,696 tokens).
    #   colocated: prefill 2048/4·100 = 51,200 tok · 2.002e9 / 4e14 = 0.25626; decode 1 step, host
    #   bound 2048 · 1e-5 = 0.02048; forward 413,696 · (2e9 + 2·1e4·101) / 8e14 = 1.035285; update
    #   413,696 · (6e9 + 6·1e4·101) / 8e14 = 3.105854 (collectives 0.5·(13·4e9 + 4e9) / 5e10 =
    #   0.56 hide); sync 0.402; sleep/wake 2.6 -> 7.41988
    #   partitioned: the train GPU alone does forward 2.07057 + update 6.211708 = 8.28228 > the
    #   rollout GPU's 0.5535 -> k=1: 8.28228 + 0.242 + 7.5e-5 transfers = 8.52435 -> colocated
    cp = plan_cluster(plan, toy_costs(batch=4096, prompt=100, response=1, n=4, nodes=1, gpus_per_node=2))
    assert cp.chosen.label == "colocated"
    assert cp.colocated.step_s == pytest.approx(7.41988, abs=1e-4)
    assert cp.best_partitioned.step_s == pytest.approx(8.52435, abs=1e-4)
    # the same step with min_gain above the partitioned gain keeps colocated in the first case
    cp = plan_cluster(plan, toy_costs(batch=8, prompt=10, response=2000, n=4, nodes=1, gpus_per_node=2),
                      min_gain=2.0)
    assert cp.chosen.label == "colocated" and "below min_gain 2.0" in cp.reason


def test_partitioned_step_is_the_sum_or_max_of_its_sides(round_cal):
    cp = plan_cluster(_grpo_plan(), toy_costs())
    for e in cp.candidates[1:]:
        side = e.sides["rollout"] + e.sides["train"] if e.pp.staleness == 0 else \
            max(e.sides["rollout"], e.sides["train"])
        assert e.step_s == pytest.approx(side + e.sync_s + e.transfer_s, rel=1e-12)


def test_memory_check_names_what_does_not_fit(round_cal):
    # 2e10 params: 16 · 2e10 / 2 GPUs = 160 GB of training state > 90 GB: colocated does not fit,
    # and no split can hold it either (train pool of 1 GPU: 320 GB)
    big = ModelSize(**{**MODEL.__dict__, "n_params": 2 * 10**10})
    cl = ClusterConfig(**{**TOY, "nodes": 1, "gpus_per_node": 2})
    c = ClusterCosts(cl, big, Workload(8, 10, 10), 4, dict(GRPO_STAGES))
    cp = plan_cluster(_grpo_plan(), c)
    assert not cp.colocated.fits and cp.best_partitioned is None
    assert cp.colocated.memory["all"].does_not_fit[0].startswith("training: ")
    assert c.rollout_tp == 1  # 4e10 bf16 bytes <= 45e9: one GPU holds the rollout weights


def test_calibration_rederives_from_the_results_it_cites():
    j = json.loads((REPO / "benchmarks/results/scaling_1gpu.json").read_text())
    n, ceiling = j["params"], 790 / 989.5
    assert n == 494_032_768
    mfu = j["train_tokens_per_s"] * (6 * n + 6 * 24 * 896 * 768) / 989.5e12
    assert CALIBRATION["h0_train"].value == pytest.approx(896 * (ceiling / mfu - 1), rel=1e-6)
    mfu = j["logprobs_tokens_per_s"] * (2 * n + 2 * 24 * 896 * 768) / 989.5e12
    assert CALIBRATION["h0_forward"].value == pytest.approx(896 * (ceiling / mfu - 1), rel=1e-6)
    gib = j["mem_before_offload_gib"] - j["mem_after_offload_gib"]
    assert CALIBRATION["offload_bw"].value == pytest.approx(gib * 2**30 / j["offload_s"], rel=1e-5)
    assert CALIBRATION["onload_bw"].value == pytest.approx(gib * 2**30 / j["onload_s"], rel=1e-5)
    rollout = (REPO / "benchmarks/results/rollout_h200.md").read_text()
    assert "| 28,771 |" in rollout and "| 85,997 |" in rollout
    assert "| sleep1_s | 0.195 | 0.713 | 0.802 |" in rollout and "| wake1_s | 0.594 | 0.088 | 0.163 |" in rollout
    assert "| full | 5 | 0.218 | 0.214 |" in (REPO / "benchmarks/results/weight_sync_h200.md").read_text()


def test_presets_load_and_state_their_sources():
    from omegaconf import OmegaConf

    files = sorted((REPO / "conf/cluster").glob("*.yaml"))
    assert {f.stem for f in files} >= {"h200x8", "h200x64", "h100x8", "a100x8"}
    for f in files:
        c = ClusterConfig(**OmegaConf.to_container(OmegaConf.load(f)))
        assert c.name == f.stem and "Sources:" in f.read_text()
    h = ClusterConfig(**OmegaConf.to_container(OmegaConf.load(REPO / "conf/cluster/h200x64.yaml")))
    assert (h.world, h.peak_bf16_flops, h.hbm_bw) == (64, 989.5e12, 4.8e12)


def test_plan_a_cluster_from_a_folder_holding_only_config_json(tmp_path, capsys):
    # Qwen2, hidden 64, 2 layers, 4 heads x 16, 2 KV heads, intermediate 128, vocab 100, untied:
    # embed 6400 + lm_head 6400 + 2 layers x (q 64·64+64 + k 64·32+32 + v 64·32+32 + o 64·64
    # + 3 · 64·128 + 2 norms 64) = 2 x 37,120 + final norm 64 = 87,104 parameters
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}))
    from flowrl.models.loading import ModelConfig
    from flowrl.models.size import model_size

    m = model_size(ModelConfig(path=str(tmp_path)))
    assert (m.n_params, matmul_params(m), m.hidden_size, m.vocab_size) == (87_104, 80_704, 64, 100)
    assert main(["plan", "cluster=h200x64", f"model.path={tmp_path}", "graph=grpo", "--format",
                 "text"]) == 0
    out = capsys.readouterr().out
    assert "Cluster h200x64: 8 node(s) x 8 H200 SXM 141GB = 64 GPUs" in out
    assert "| candidate | step s | response tok/s |" in out and "\nChose " not in out
    assert "  Chose " in out and "Terms of " in out and "Memory per GPU" in out
    assert "  Colocated: step " in out and "; best partitioned: partitioned rollout=" in out
    assert main(["plan", "cluster=h200x64", f"model.path={tmp_path}", "--format", "mermaid"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("flowchart TB\n") and '  predicted["predicted (h200x64): step ' in out
    assert main(["plan", "cluster=h300x9", f"model.path={tmp_path}"]) == 2
    assert "cluster" in capsys.readouterr().err


def test_a_cluster_plan_keeps_the_placement_asked_for(capsys):
    """placement=colocated, placement.staleness=0 and the pools given were ignored: the plan
    chose its own split at k=1 (off-policy, another algorithm than asked; fresh-user report)."""
    def plan(*extra: str) -> str:
        assert main(["plan", "cluster=h200x8", "model=tiny", *extra]) == 0
        out = capsys.readouterr().out
        return next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("Chose ")) \
            + "\n" + out.splitlines()[0]

    free = plan()  # nothing asked: the search (a split at k=1 wins on this workload)
    assert free.startswith("Chose partitioned rollout=6 train=2 k=1: ") and "as asked" not in free
    assert plan("placement=colocated") == (
        "Chose colocated: placement=colocated, as asked\n"
        "ExecutionPlan  graph=grpo  placement=colocated  ranks=[0, 1, 2, 3, 4, 5, 6, 7]")
    on_policy = plan("placement=partitioned", "placement.staleness=0")
    assert on_policy.startswith("Chose partitioned rollout=") and " k=0: placement=partitioned, " \
        "as asked: the fastest split\n" in on_policy
    assert on_policy.endswith("mode=partitioned  world=8  staleness=0")
    pools = plan("placement=partitioned", "placement.pools.train=[0,1,2,3,4,5]",
                 "placement.pools.rollout=[6,7]", "placement.staleness=0")
    assert pools.startswith("Chose partitioned rollout=2 train=6 k=0: placement=partitioned, as "
                            "asked: the split asked for\n"), pools
    # placement=partitioned alone: the run's staleness (0), not k=1 (a second fresh-user report)
    asked = plan("placement=partitioned")
    assert " k=0: placement=partitioned, as asked: the fastest split\n" in asked, asked


def test_a_cluster_plan_of_given_pools_draws_the_rollout_gpus_prompts(capsys):
    """prompts_per_step counts per rollout rank of a partitioned run: 2 rollout GPUs of 8 draw
    2 x 8 prompts (the plan showed the world's 64)."""
    assert main(["plan", "cluster=h200x8", "model=tiny", "placement=partitioned",
                 "placement.pools.train=[0,1,2,3,4,5]", "placement.pools.rollout=[6,7]",
                 "trainer.prompts_per_step=8"]) == 0
    batch = next(ln.strip() for ln in capsys.readouterr().out.splitlines()
                 if ln.strip().startswith("Batch: "))
    assert batch.startswith("Batch: 128 rows = 16 prompts x n=8, "), batch


def test_a_run_refuses_a_cluster_it_would_not_use():
    from flowrl.config import compose
    from flowrl.train import ConfigError, prepare

    raw = compose(["cluster=h200x8", "model=tiny", "trainer=smoke"])
    raw.trainer.output_dir = "(test)"
    with pytest.raises(ConfigError, match=r"cluster=h200x8: a cluster is planned, not run here"):
        prepare(raw, [])


def test_plan_text_names_the_role_setting_each_pool_peak_and_aligns_columns(round_cal):
    from flowrl.compiler.cost import cluster_placement
    from flowrl.compiler.modes import format_placement

    # toy 8 GPUs, chosen rollout=7 train=1 k=1. train GPU: 16 · 1e9 fp32 state + activations
    # 5,570,560,000 + logits 1,092,266,666.67 = 22,662,826,666.67 B = 21.1 GiB (training phase:
    # the actor's); rollout GPU: the whole budget 0.9 · 100e9 = 90e9 B = 83.8 GiB (weights + the KV
    # cache vLLM takes: the rollout role's). The old text printed "(-)" for both.
    out = format_placement(cluster_placement(plan_cluster(_grpo_plan(), toy_costs())))
    assert ("Predicted peak memory per device: pool train 21.1 GiB (set by the actor role); "
            "pool rollout 83.8 GiB (set by the rollout role)\n") in out
    assert "(-)" not in out
    # the note under the peaks says they count the activations they hold (it said they left
    # them out: the train pool's 21.1 GiB is mostly activations; fresh-user report)
    from flowrl.compiler.render import MEMORY_LEAVES_OUT, MEMORY_WITH_ACTIVATIONS

    assert f"\n  {MEMORY_WITH_ACTIVATIONS}\n" in out and MEMORY_LEAVES_OUT not in out
    # the terms' seconds end in one column though "update: FSDP collectives (overlapped: max with
    # compute)" is longer than the old fixed 52-character name column
    terms = out[out.index("Terms of "):out.index("  step = max(")].splitlines()[1:-1]
    assert len(terms) == 8 and len({line.index("  = ") for line in terms}) == 1
    mem = [line for line in out.splitlines() if " phase: " in line]
    assert [" ".join(line.split()[-2:]) for line in mem] == ["14.9 GiB", "6.2 GiB", "1.9 GiB",
                                                              "82.0 GiB"]
    # each size starts in one column though the labels differ in length by pool name
    assert len({len(line) - len(" ".join(line.split()[-2:])) for line in mem}) == 1


def _write_shape_only_gguf(path, *, vocab_key=None, tokens=None, embd_vocab=96, hidden=32):
    """A llama GGUF holding the metadata ``model_size`` reads and two fp32 tensors (token_embd
    [vocab, hidden], output_norm [hidden]): ``vocab_key`` writes ``llama.vocab_size``, ``tokens``
    a ``tokenizer.ggml.tokens`` list of that length (None: the key is left out)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_embedding_length(hidden)
    w.add_block_count(2)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    if vocab_key is not None:
        w.add_vocab_size(vocab_key)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(tokens)])
    w.add_tensor("token_embd.weight", np.zeros((embd_vocab, hidden), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# the three sources disagree on purpose (real files agree), so each case shows which one is read
@pytest.mark.parametrize("vocab_key, tokens, expected", [
    (80, 88, 80),  # llama.vocab_size first
    (None, 88, 88),  # else the tokenizer's token list (SmolLM2's GGUF has both)
    (None, None, 96),  # else the token_embd.weight tensor's vocabulary dimension
])
def test_a_gguf_models_vocabulary_sizes_its_logits(tmp_path, round_cal, vocab_key, tokens,
                                                   expected):
    """_gguf_size left vocab_size 0 (fresh-user report: the SmolLM2 plan printed "vocab 0" and
    its logits estimate was ~1.8 GiB too low)."""
    from flowrl.models.loading import ModelConfig
    from flowrl.models.size import model_size

    _write_shape_only_gguf(tmp_path / "m.gguf", vocab_key=vocab_key, tokens=tokens)
    m = model_size(ModelConfig(path=str(tmp_path), gguf_file="m.gguf"))
    # 96 · 32 embedding + 32 norm = 3,104 parameters; tied (no output.weight)
    assert (m.vocab_size, m.n_params, m.hidden_size, m.tied_embeddings) == \
        (expected, 3104, 32, True)
    c = ClusterCosts(ClusterConfig(**TOY), m, Workload(64, 100, 200), 4, dict(GRPO_STAGES))
    # 34 · 16384 tokens · 32 hidden · 2 layers = 35,651,584 + logits of 16384 · 200/300 response
    # tokens · vocab · 10 bytes (round_cal's logit_bytes)
    assert c.activation_bytes() == pytest.approx(35_651_584 + 16384 * 200 / 300 * expected * 10)
