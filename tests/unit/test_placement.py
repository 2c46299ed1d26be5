"""Placement compiler: every impossible placement is rejected with a message naming the
``placement.*`` field, before any model loads; valid splits cut the plan as documented; ``flowrl
plan`` renders per-pool timelines as text, Mermaid and DOT."""
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.compiler.modes import place
from flowrl.compiler.placement import PlacementConfig, PlacementError, split_candidates
from flowrl.compiler.plan import compile_plan
from flowrl.config import compose
from flowrl.graph.graph import Graph
from flowrl.runtime.control.preflight import prepare_placement
from flowrl.train import ConfigError, prepare

GRPO = Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml"


def grpo(kl_coef=0.01):
    return compile_plan(Graph.load(GRPO), {"algorithm": {"kl_coef": kl_coef,
                                                         "recompute_old_logprobs": True}})


def part(pools=None, roles=None, **kw):
    return PlacementConfig(mode="partitioned", pools=pools or {}, roles=roles or {}, **kw)


@pytest.mark.parametrize("cfg, world, msg", [
    (part(roles={"ref": "judge"}), 2,
     "placement.roles.ref: pool 'judge' does not exist (pools: ['rollout', 'train'])"),
    (part({"train": [0, 1], "rollout": [1]}), 2,
     "placement.pools: rank 1 is in both 'train' and 'rollout' (partitioned pools must not overlap)"),
    (part({"train": [0], "rollout": [2]}), 2, "placement.pools.rollout: rank 2 >= world size 2"),
    (part({"train": [0], "rollout": [1]}), 3, "placement.pools: ranks [2] are in no pool; give "
     "each of the 3 ranks a pool, e.g. placement.pools.train=[0,1] placement.pools.rollout=[2]"),
    (part(roles={"rollout": "train"}), 2,
     "placement.roles: actor and rollout share a pool; use placement=colocated for that"),
    (part(), 1, "placement.mode=partitioned needs >= 2 ranks (launcher.nproc), got 1: run it with "
                "launcher.nproc=2 (one rank per pool) or more, or use placement=colocated on one"),
    (part({"train": [0, 1], "rollout": [2, 3, 4]}), 5,
     "placement.pools: rollout has 3 rank(s) and train 2; the larger pool's size must be a "
     "multiple of the smaller's (samples route rollout rank i -> train rank i mod 2)"),
    (part({"train": [0], "rollout": [1, 2, 3]}), 4, None),  # 3 and 1: fine
    (part({"cpu": [0], "rollout": [1]}), 2,
     "placement.pools must name exactly the pools 'train' and 'rollout', got ['cpu', 'rollout']"),
])
def test_impossible_placements_are_rejected(cfg, world, msg):
    if msg is None:
        pp = place(grpo(), cfg, world)
        assert [len(p.ranks) for p in pp.pools.values()] == [3, 1]
        return
    with pytest.raises(PlacementError) as e:
        place(grpo(), cfg, world)
    assert str(e.value) == msg


def test_pool_too_small_for_tensor_parallel_rollout():
    cfg = part({"train": [0], "rollout": [1]})
    with pytest.raises(PlacementError) as e:
        place(grpo(), cfg, 2, role_parallelism={"rollout": 2})
    assert str(e.value) == ("placement.pools.rollout: pool 'rollout' has 1 rank(s), too few for "
                            "role 'rollout' (tensor_parallel_size 2): the size must be a multiple of 2")
    pp = place(grpo(), part({"train": [0, 1], "rollout": [2, 3]}), 4, role_parallelism={"rollout": 2})
    assert pp.pools["rollout"].ranks == [2, 3]
    with pytest.raises(PlacementError, match=r"^launcher.nproc: pool 'all' has 3 rank\(s\)"):
        place(grpo(), PlacementConfig(), 3, role_parallelism={"rollout": 2})


def test_rollout_pool_stage_reading_train_output():
    ppo = prepare(compose(["graph=ppo", "trainer.output_dir=/tmp/x", "algorithm.kl_coef=0.01"])).plan
    with pytest.raises(PlacementError) as e:
        place(ppo, part(roles={"critic": "rollout"}), 2)
    assert str(e.value) == ("placement.roles: stage 'update_critic' (pool rollout) reads "
                            "'advantage.returns' from pool train; only weights may flow back — "
                            "move role 'critic' to the train pool")


def test_split_candidates():
    assert split_candidates(2) == [1]
    assert split_candidates(8) == [1, 2, 4, 6, 7]
    assert split_candidates(8, rollout_tp=2) == [2, 4, 6]
    assert split_candidates(1) == []


def test_six_two_split_cuts_grpo():
    pp = place(grpo(), part({"train": [6, 7], "rollout": [0, 1, 2, 3, 4, 5]}), 8)
    assert pp.pools["rollout"].plan.order == ["sample", "rollout", "reward", "advantage"]
    assert pp.pools["train"].plan.order == ["ref_logprobs", "old_logprobs", "update"]
    assert pp.transfers == ["sample.prompt_ids", "sample.prompt_mask", "rollout.response_ids",
                            "rollout.response_mask", "rollout.rollout_logprobs",
                            "rollout.truncated", "advantage.advantages"]
    assert pp.pool_of(7).name == "train" and pp.pool_of(0).name == "rollout"
    assert pp.staleness == 0 and pp.weight_sync == [("actor", "rollout")]


def test_train_rejects_bad_placement_before_loading(tmp_path, capsys):
    cfg = compose(["placement=partitioned", f"trainer.output_dir={tmp_path}"])  # 1 rank
    with pytest.raises(ConfigError, match="placement.mode=partitioned needs >= 2 ranks"):
        prepare(cfg)
    assert main(["plan", "placement=partitioned", "launcher.nproc=3", "placement.pools.train=[0]",
                 f"trainer.output_dir={tmp_path}"]) == 2  # rollout: [2] of the default split
    assert "placement.pools: ranks [1] are in no pool" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written: no run started


@pytest.mark.parametrize("nproc,train,rollout", [(2, [0], [1]), (3, [0, 1], [2]), (4, [0, 1], [2, 3])])
def test_partitioned_without_pools_takes_the_default_split(nproc, train, rollout, tmp_path):
    """conf/placement/partitioned.yaml leaves both pools empty: any launcher.nproc splits."""
    spec = prepare(compose(["placement=partitioned", f"launcher.nproc={nproc}", "model=tiny",
                                 "trainer=smoke", f"trainer.output_dir={tmp_path}"]))
    cfg, plan = spec.config, spec.plan
    assert cfg.placement.pools == {"train": [], "rollout": []}
    pp = prepare_placement(cfg, plan, nproc)
    assert (pp.pools["train"].ranks, pp.pools["rollout"].ranks) == (train, rollout)
    assert pp.notes == [f"placement.pools not set: default split {{'train': {train}, 'rollout': {rollout}}}"]
    # one pool given: the other keeps its ranks of the default split
    spec = prepare(compose(["placement=partitioned", "launcher.nproc=4", "model=tiny",
                                 "trainer=smoke", "placement.pools.rollout=[3]",
                                 "placement.pools.train=[0,1,2]", f"trainer.output_dir={tmp_path}"]))
    cfg, plan = spec.config, spec.plan
    pp = prepare_placement(cfg, plan, 4)
    assert (pp.pools["train"].ranks, pp.pools["rollout"].ranks, pp.notes) == ([0, 1, 2], [3], [])
    with pytest.raises(PlacementError, match="rank 2 is in both 'train' and 'rollout'"):
        place(plan, part({"train": [0, 1, 2], "rollout": []}), 4)  # [] = rollout's [2, 3]


def plan_output(capsys, *args):
    assert main(["plan", "trainer.output_dir=/tmp/x", "model=tiny", "trainer=smoke", *args]) == 0
    return capsys.readouterr().out


def test_plan_partitioned_text(capsys):
    out = plan_output(capsys, "placement=partitioned", "launcher.nproc=2")
    assert out.startswith("PlacementPlan  graph=grpo  mode=partitioned  world=2  staleness=0\n")
    assert "Pool rollout  ranks [1]  roles: rollout\n" in out
    assert "Pool train  ranks [0]  roles: actor\n" in out
    # tiny smoke config: B = 2 prompts x 4 samples x 1 rollout rank = 8 rows (prompts_per_step
    # counts per rollout rank; the plan said 16), R = 16 new tokens: 8 x 16 int64 = 1.0 KiB
    assert "   8. send      rollout.response_ids to pool train (1.0 KiB), then free\n" in out
    assert "   3. recv      rollout.response_ids from pool rollout (1.0 KiB)\n" in out
    assert "broadcast weights actor -> rollout to pool rollout" in out
    assert "wait      weights actor -> rollout from pool train: at most 0 version(s) behind" in out
    assert "Transfers rollout -> train per step (rollout rank 0 -> train rank 0):" in out
    assert "Weight sync: actor -> rollout broadcast train -> rollout after each update, 24.3 MiB" in out
    assert "Predicted peak memory per device: pool rollout " in out


def test_plan_colocated_keeps_text_and_adds_memory(capsys):
    out = plan_output(capsys)
    assert out.startswith("ExecutionPlan  graph=grpo  placement=colocated  ranks=[0]\n")
    # tiny llama: 6,365,504 fp32 params; actor alone: weights + grads + 2 AdamW moments = 97.1 MiB
    assert "Predicted peak memory per device: pool all 97.1 MiB (set by the actor role)\n" in out
    # the measured peak is larger (642 MiB host RSS on CPU): the plan says what it leaves out
    lines = out.splitlines()
    at = lines.index("Predicted peak memory per device: pool all 97.1 MiB (set by the actor role)")
    assert lines[at + 2] == (
        "  (counts weights, gradients, AdamW moments and the KV cache; leaves out the activations "
        "and logits of a micro-batch (they grow with trainer.engine.max_tokens_per_micro_batch x "
        "the vocabulary), the runtime (CUDA context; on CPU ~0.35 GiB of Python/torch host RSS) "
        "and allocator fragmentation)")


def test_plan_predicts_with_the_prompt_length_a_step_pays_for(capsys):
    out = plan_output(capsys)
    # arith prompts rendered by the tiny model's (SmolLM2) chat template are 56 tokens; the old
    # P was data.max_prompt_tokens = 256, a skip limit (batches pad to their longest prompt)
    assert ("  workload: P = 56 prompt tokens, the longest of the first 256 training prompts as "
            "the tokenizer renders them (data.max_prompt_tokens = 256 only skips longer ones); "
            "R = 16 response tokens (rollout.sampling.max_new_tokens: an upper bound, responses "
            "may stop earlier)\n") in out
    # cpu profile (1.5e11 FLOP/s, 3.4e9 B/s), N = 6,365,504, B = 2 x 4 = 8 rows, S = 56 + 16:
    # update 6·N·8·72 / 1.5e11 = 0.14667; old_logprobs 2·N·8·72 / 1.5e11 = 0.04889; rollout
    # prefill 2·N·8·56 / 1.5e11 = 0.03802 + 16 steps x max(4·N B / 3.4e9, 2·N·8 / 1.5e11) =
    # 16 x 0.0074888 = 0.11982; swaps free on CPU -> 0.3534 s (P = 256 gave 1.03 s)
    assert "Predicted (cost model, device profile cpu): step 0.353 s\n" in out


def test_plan_mermaid_and_dot(capsys):
    out = plan_output(capsys, "placement=partitioned", "launcher.nproc=2", "--format", "mermaid")
    assert out.startswith("flowchart TB\n")
    assert '  subgraph rollout["pool rollout ranks [1]"]\n' in out
    assert '  subgraph train["pool train ranks [0]"]\n' in out
    assert '  rollout_7 -->|"rollout.response_ids 1.0 KiB"| train_2\n' in out
    assert '  train_9 -.->|"weights (staleness 0)"| rollout_1\n' in out
    out = plan_output(capsys, "placement=partitioned", "launcher.nproc=2", "--format=dot")
    assert out.startswith('digraph "grpo" {\n')
    assert "  subgraph cluster_train {\n" in out
    assert '  train_9 -> rollout_1 [label="weights (staleness 0)", style=dashed];\n' in out
    assert main(["plan", "--format", "svg"]) == 2


def test_plan_auto_explains_choice(capsys):
    out = plan_output(capsys, "placement=auto", "launcher.nproc=2")
    # the header says the mode auto chose (it said placement=auto only, in plan.txt too)
    assert out.startswith("ExecutionPlan  graph=grpo  placement=auto (colocated chosen)  "
                          "ranks=[0, 1]\n")
    assert "auto: device profile cpu; workload B=16 rows, P=56, R=16 tokens" in out
    assert "colocated W=2" in out and "partitioned rollout=1 train=1 k=0" in out
    assert "\n  chose " in out


def test_vllm_tensor_parallel_size_above_one_is_refused_at_compose(tmp_path):
    # engines are data parallel (one whole engine per rank or engine process); the pool-sizing
    # rule for tensor-parallel roles is tested on place() directly above
    cfg = compose(["model=tiny", "trainer=smoke", "rollout=vllm", "launcher.nproc=2",
                   "rollout.vllm.tensor_parallel_size=2", f"trainer.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"rollout.vllm.tensor_parallel_size must be 1"):
        prepare(cfg)


def test_transfer_route_names_pool_ranks_in_words():
    from flowrl.compiler.render import transfer_route

    assert transfer_route(1, 1) == "rollout rank 0 -> train rank 0"
    assert transfer_route(2, 2) == "rollout rank i -> train rank i"
    assert transfer_route(3, 1) == "every rollout rank -> train rank 0, the 3 batches joined"
    assert transfer_route(4, 2) == "rollout rank i -> train rank i mod 2, its peers' batches joined"
    assert transfer_route(1, 2) == "rollout rank 0 -> train ranks 0-1, its rows split between them"
    assert transfer_route(2, 4) == ("rollout rank i -> train ranks j with j mod 2 = i, its rows "
                                    "split between them")


def test_partitioned_plan_batch_counts_the_rollout_ranks(capsys):
    """trainer.prompts_per_step counts per rollout rank: 3 ranks (default split: 2 train, 1
    rollout) send 2 x 4 rows a step, as 2 ranks do (the plan multiplied by the world: 3x)."""
    two = plan_output(capsys, "placement=partitioned", "launcher.nproc=2")
    three = plan_output(capsys, "placement=partitioned", "launcher.nproc=3")
    line = "rollout.truncated to pool train (8 B)"  # 8 rows x 1 byte
    assert line in two and line in three
