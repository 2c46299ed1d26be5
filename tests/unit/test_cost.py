"""Cost model: hand-computed stage times, memory and bytes; refinement from measured metrics;
the split search (ternary == exhaustive) and the auto choice with its explanation."""
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl.compiler.cost import (
    DeviceProfile,
    StageCosts,
    Workload,
    choose_placement,
    decode_seconds,
    forward_seconds,
    ternary_search,
    train_seconds,
)
from flowrl.compiler.footprint import role_memory, tensor_bytes
from flowrl.compiler.modes import estimate, place
from flowrl.compiler.placement import PlacementConfig, split_candidates
from flowrl.compiler.plan import compile_plan
from flowrl.graph.graph import Graph
from flowrl.models.loading import ModelConfig, tiny_model_config
from flowrl.models.size import ModelSize, model_size

GRPO = Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml"
INF = float("inf")
M = ModelSize(n_params=1000, n_layers=1, n_kv_heads=1, head_dim=1, dtype_bytes=4)  # 4000 bytes
DEV = DeviceProfile("test", flops=1000.0, mem_bw=100.0, link_bw=4000.0, host_bw=INF)
W4 = Workload(batch=4, prompt_tokens=2, response_tokens=2)


def grpo_plan():  # sample, rollout, reward, old_logprobs, advantage, update
    return compile_plan(Graph.load(GRPO), {"algorithm": {"kl_coef": 0.0,
                                                         "recompute_old_logprobs": True}})


def costs(workload=W4, device=DEV):
    return StageCosts.from_plan(grpo_plan(), {"actor": M, "rollout": M}, workload, device)


def test_stage_formulas():
    w = Workload(batch=4, prompt_tokens=3, response_tokens=5, ppo_epochs=2)
    d = DeviceProfile("d", flops=1000.0, mem_bw=100.0, link_bw=1.0, host_bw=INF)
    assert forward_seconds(M, w, 2, 1, d) == 32.0  # 2·1000·4·8 / (2·1000)
    assert train_seconds(M, w, 2, 1, d) == 192.0  # 2 epochs · 6·1000·4·8 / (2·1000)
    # 4 devices, tp 2 → 2 instances, b = 2 rows: prefill 2·1000·2·3/(2·1000) = 6, then
    # 5 tokens × max(4000 B / (2·100 B/s) = 20, 2·1000·2/(2·1000) = 2) = 100
    assert decode_seconds(M, w, 4, 2, d) == 106.0


def test_memory_and_bytes():
    s = ModelSize(n_params=134515008, n_layers=30, n_kv_heads=3, head_dim=64, dtype_bytes=2)
    assert s.kv_bytes(100) == 2 * 30 * 3 * 64 * 100 * 2 == 2_304_000
    assert role_memory("actor", M, 1) == 16000  # weights + grads + 2 AdamW moments
    assert role_memory("actor", M, 2) == 8000 + 4000  # sharded state + one gathered copy
    assert role_memory("ref", M, 4) == 4000
    assert role_memory("rollout", M, 1, kv_tokens=10) == 4000 + 2 * 1 * 1 * 1 * 10 * 4
    assert tensor_bytes("rollout.response_ids", 16, 100, 200) == 16 * 200 * 8
    assert tensor_bytes("sample.prompt_mask", 16, 100, 200) == 16 * 100
    assert tensor_bytes("reward.rewards", 16, 100, 200) == 64


def test_model_size_without_loading():
    s = model_size(ModelConfig())  # SmolLM2-135M: GGUF metadata only
    assert (s.n_params, s.n_layers, s.n_kv_heads, s.head_dim, s.dtype_bytes, s.vocab_size) == \
        (134515008, 30, 3, 64, 4, 49152)
    from flowrl.models.loading import load_model

    cfg = ModelConfig(tiny=tiny_model_config())
    assert model_size(cfg).n_params == sum(p.numel() for p in load_model(cfg).parameters()) \
        == 6365504


def test_estimate_colocated_and_partitioned():
    c = costs()
    plan = grpo_plan()
    # W=4 colocated: decode b=1: 4 + 2·max(40, 2) = 84; forward 32/4 = 8; train 96/4 = 24
    colo = estimate(place(plan, PlacementConfig(), 4), c)
    assert colo.step_s == pytest.approx(116.0)
    assert colo.memory == {"all": (4 * 4000 // 4 + 4000, "actor")}
    pc = PlacementConfig(mode="partitioned", pools={"train": [0, 1], "rollout": [2, 3]}, staleness=1)
    pp = place(plan, pc, 4)
    est = estimate(pp, c)
    # rollout side: decode b=2: 8 + 2·40 = 88; train side 16 + 48 = 64; max (k=1) = 88;
    # sync 4000 B / 4000 B/s = 1; transfers 212 B / (4000 B/s · 2 links)
    assert est.transfers == {"sample.prompt_ids": 64, "sample.prompt_mask": 8,
                             "rollout.response_ids": 64, "rollout.response_mask": 8,
                             "rollout.rollout_logprobs": 32, "rollout.truncated": 4,
                             "advantage.advantages": 32}
    assert est.sides == {"rollout": 88.0, "train": 64.0}
    assert est.sync_bytes == 4000
    assert est.step_s == pytest.approx(88 + 1 + 212 / 8000)
    pp.staleness = 0
    assert estimate(pp, c).step_s == pytest.approx(88 + 64 + 1 + 212 / 8000)


def test_refine_from_measured_metrics():
    c = costs()
    before = c.stage_seconds("rollout", 2)  # b=2: 88
    c.refine([{"time/rollout": 2 * 88.0, "time/reward": 0.4, "perf/swap_s": 0.5},
              {"time/rollout": 2 * 88.0, "time/reward": 0.6, "perf/swap_s": 0.5}], ranks=2)
    assert c.scale["rollout"] == 2.0
    assert c.stage_seconds("rollout", 2) == 2 * before
    assert c.stage_seconds("rollout", 1) == 2 * 96.0  # b=4: 16 + 80, scaled
    assert c.stage_seconds("reward", 1) == pytest.approx(1.0)  # 0.5 s on 2 ranks = 1 device-s
    assert c.swap_measured == 0.5
    assert estimate(place(grpo_plan(), PlacementConfig(), 2), c).step_s == \
        pytest.approx(2 * 88 + 0.5 + 16 + 48 + 0.5)
    c.refine({"response/length_max": 7.0}, ranks=2)
    assert c.workload.response_tokens == 7
    p_bound = c.workload.prompt_tokens
    c.refine([{"data/prompt_length_max": 40.0}, {"data/prompt_length_max": 45.0}], ranks=2)
    assert (p_bound, c.workload.prompt_tokens) == (2, 42)  # the measured width replaces P


def test_ternary_search_matches_exhaustive():
    plan = grpo_plan()
    for device in (DEV, DeviceProfile("fast", 1e6, 1e3, 1e9, INF)):
        for world in range(2, 25):
            c = costs(Workload(batch=960, prompt_tokens=64, response_tokens=128), device)
            xs = split_candidates(world)

            def f(r, world=world, c=c):
                pc = PlacementConfig(mode="partitioned", staleness=1, pools={
                    "train": list(range(world - r)), "rollout": list(range(world - r, world))})
                return estimate(place(plan, pc, world), c).step_s

            assert f(ternary_search(f, xs)) == pytest.approx(min(f(r) for r in xs)), (device, world)


def test_choose_placement_explains():
    cfg = SimpleNamespace(placement=PlacementConfig(mode="auto", staleness=1))
    pp = choose_placement(grpo_plan(), cfg, 4, costs())
    assert pp.mode == "partitioned"
    assert (pp.pools["rollout"].ranks, pp.pools["train"].ranks) == ([2, 3], [0, 1])
    assert pp.notes == [
        "auto: device profile test; workload B=4 rows, P=2, R=2 tokens",
        "  predicted step 116 s  colocated W=4",
        "  predicted step 97.1 s  partitioned rollout=1 train=3 k=1",  # max(96, 128/3) + 1 + 0.053
        "  predicted step 89 s  partitioned rollout=2 train=2 k=1",
        "  predicted step 129 s  partitioned rollout=3 train=1 k=1",  # max(88, 128) + 1.053
        "chose partitioned rollout=2 train=2: predicted 1.30x faster than colocated "
        "(>= placement.auto.min_gain 1.05)"]
    assert pp.estimate.step_s == pytest.approx(89.0265)
    cfg.placement.auto.min_gain = 1.5
    pp = choose_placement(grpo_plan(), cfg, 4, costs())
    assert pp.mode == "colocated"
    assert pp.notes[-1] == ("chose colocated: best split rollout=2 train=2 is predicted 1.30x as "
                            "fast, below placement.auto.min_gain 1.5")
    assert choose_placement(grpo_plan(), cfg, 1, costs()).notes[-1] == \
        "chose colocated: no valid partitioned split of 1 rank(s)"


def test_runtime_seam_refine_then_choose():
    from flowrl.compiler.cost import predicted_vs_measured, refine_and_choose

    cfg = SimpleNamespace(placement=PlacementConfig(mode="auto", staleness=1))
    # measured: the update is 4x slower than modelled on 4 colocated ranks (24 -> 96 s), so the
    # train side needs more ranks: 3 train / 1 rollout wins: max(96, (32 + 4·96)/3) + 1.053
    pp = refine_and_choose(grpo_plan(), cfg, 4, costs(), [{"time/update": 96.0}])
    assert pp.notes[0] == "auto: refined from 1 measured colocated step(s)"
    assert (pp.mode, pp.pools["train"].ranks) == ("partitioned", [0, 1, 2])
    assert pp.estimate.step_s == pytest.approx((32 + 4 * 96) / 3 + 1 + 212 / 4000)
    assert predicted_vs_measured(pp, [{"perf/step_s": 150.0}, {"perf/step_s": 130.0}]) == \
        "placement partitioned rollout=[3] train=[0, 1, 2]: predicted step 140 s, measured 140 s (+0.2%)"
