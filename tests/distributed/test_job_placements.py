"""One job loop for every placement (runtime/control/job.py): what colocated runs always did,
partitioned and placement=auto runs do too. Each test failed before the loop was written once:

- the adaptive in-reward KL coefficient β is checkpointed and restored under partitioned (and
  placement=auto switching to partitioned), instead of restarting at algorithm.kl_coef;
- ``trainer.async_save`` and ``perf/checkpoint_s`` hold under partitioned;
- β is updated from the global batch's mean KL (all-reduced over the pool), so data-parallel
  ranks cannot drift apart.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowrl.runtime.io.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
# REINFORCE++: the token_rewards stage (in-reward KL, adaptive β) runs on the train pool
TARGET, HORIZON = 0.1, 100
ARGS = ["model=tiny", "trainer=smoke", "data.limit=64", "logger.progress=false",
        "logger.tensorboard=false", "trainer.eval.before=false", "trainer.eval.after=false",
        "graph=reinforce_pp", "algorithm.kl_coef=0.01", "algorithm.kl_in_reward=true",
        f"algorithm.kl_target={TARGET}", f"algorithm.kl_horizon={HORIZON}",
        "trainer.engine.lr=1e-3"]


def torchrun(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "distributed" / "job_worker.py"), *ARGS,
           f"trainer.output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def next_beta(row: dict, samples: int) -> float:
    """β after the update with ``row``'s batch (AdaptiveKLController, Ziegler et al. eq. 3)."""
    err = min(max(row["kl/in_reward"] / TARGET - 1.0, -0.2), 0.2)
    return row["kl/coef"] * (1.0 + err * samples / HORIZON)


def saves(out: Path, rank: int) -> list[dict]:
    return [json.loads(x) for x in (out / f"saves_rank{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def partitioned_run(tmp_path_factory):
    """2 partitioned steps (train [0], rollout [1]) checkpointed at each, asynchronously but the
    last; then resumed for a third step."""
    out = tmp_path_factory.mktemp("partitioned")
    common = ["placement=partitioned", "trainer.save_every=1", "trainer.async_save=true"]
    console = torchrun(out, *common, "trainer.total_steps=2").stdout
    first = read_metrics(out)
    torchrun(out, *common, "trainer.total_steps=3", "trainer.resume=true")
    return out, first, read_metrics(out), console


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_partitioned_resume_keeps_the_adapted_kl_coefficient(partitioned_run):
    out, first, m, _ = partitioned_run
    samples = 2 * 4  # one rollout rank: trainer.prompts_per_step × algorithm.n
    assert m[1]["kl/coef"] == pytest.approx(0.01)
    assert m[2]["kl/coef"] == pytest.approx(next_beta(m[1], samples), rel=1e-6)
    # the resumed step 3 continues from the checkpointed β, not from algorithm.kl_coef
    assert m[3]["kl/coef"] == pytest.approx(next_beta(first[2], samples), rel=1e-6)
    assert m[3]["kl/coef"] != pytest.approx(0.01, rel=1e-3)
    meta = json.loads((out / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert meta["op_state"]["kl_controller"]["kl_coef"] == pytest.approx(next_beta(m[3], samples),
                                                                        rel=1e-6)


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_partitioned_saves_are_async_and_timed(partitioned_run):
    out, first, m, _ = partitioned_run
    for rank in (0, 1):  # every rank joins each save; only the final one is synchronous
        assert saves(out, rank) == [{"step": 1, "async": True}, {"step": 2, "async": False},
                                    {"step": 3, "async": False}]
    for rows in (first, m):
        assert rows[1]["perf/checkpoint_s"] > 0 and rows[2]["perf/checkpoint_s"] > 0
    assert m[3]["perf/checkpoint_s"] > 0


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_partitioned_rollout_pool_says_its_setup_tagged(partitioned_run):
    """The rollout pool builds engines the train pool never has: its first rank says its setup
    lines, each tagged with its pool (they went nowhere, and its log lines read as the train
    pool's: "engines built in ..." twice)."""
    console = partitioned_run[3].splitlines()
    rollout = [x for x in console if x.startswith("rollout pool: setup: ")]
    assert [x.split(" in ")[0] for x in rollout] == [
        "rollout pool: setup: data 64 prompts", "rollout pool: setup: model and engines (rollout)"]
    train = [x for x in console if x.startswith("setup: model and engines (")]
    assert len(train) == 1 and "rollout" not in train[0].split(" in ")[0]  # the train pool's own


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_partitioned_run_writes_its_pools_plan(partitioned_run):
    """plan.txt is what `flowrl plan` prints for the run: its two pools (it held the colocated
    timeline of the whole graph, one pool on rank 0)."""
    plan = (partitioned_run[0] / "plan.txt").read_text()
    assert plan.startswith("PlacementPlan  graph=reinforce_pp  mode=partitioned  world=2")
    assert "Pool rollout  ranks [1]  roles: rollout" in plan
    train = next(x for x in plan.splitlines() if x.startswith("Pool train  ranks [0]  roles: "))
    assert "actor" in train.split("roles: ")[1].split(", ")
    assert "ExecutionPlan" not in plan and "colocated" not in plan
    # the transfers carry the sizes `flowrl plan` computes for the same job (it printed "?" for
    # each): both read P from the same 64 prompts
    shown = subprocess.run([sys.executable, "-m", "flowrl.cli", "plan", *ARGS, "launcher.nproc=2",
                            "placement=partitioned"], cwd=REPO, env=ENV, capture_output=True,
                           text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-3000:]

    def transfers(text: str) -> list[str]:
        lines = text.splitlines()
        i = next(i for i, x in enumerate(lines) if x.startswith("Transfers rollout -> train"))
        return lines[i:lines.index("", i)]

    assert len(transfers(plan)) > 2 and not any(x.endswith("?") for x in transfers(plan))
    assert transfers(plan) == transfers(shown.stdout)
    workload = [x for x in shown.stdout.splitlines() if x.startswith("  workload: P = ")]
    assert len(workload) == 1 and workload[0] in plan.splitlines()  # the same P, measured alike
    sync = next(x for x in plan.splitlines() if x.startswith("Weight sync: "))
    assert sync.endswith(" per update") and "Predicted (cost model, device profile cpu): step " in plan


@pytest.mark.slow
def test_auto_switch_to_partitioned_keeps_the_adapted_kl_coefficient(tmp_path):
    """placement=auto: 2 colocated profile steps on 2 ranks, then the (forced) partitioned
    split resumes their checkpoint: β continues from the profile's last update."""
    torchrun(tmp_path, "placement=auto", "placement.auto.profile_steps=2", "trainer.total_steps=3")
    m = read_metrics(tmp_path)
    assert m[3].get("placement/version_lag") == 0.0  # step 3 ran partitioned
    # the profile: 2 colocated ranks × 2 prompts × 4 samples per step
    assert m[2]["kl/coef"] == pytest.approx(next_beta(m[1], 16), rel=1e-6)
    assert m[3]["kl/coef"] == pytest.approx(next_beta(m[2], 16), rel=1e-6)


# ---- the in-reward KL controller sees the global batch ------------------------------------------
REW = torch.tensor([1.0, float("nan"), 0.5])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
REF = torch.tensor([[-1.5, -2.0, -0.5, 0.0], [-1.0, -2.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -1.0, 9.0], [-1.0, -1.0, 9.0, 9.0], [-0.5, 9.0, 9.0, 9.0]])
# k1 = old − ref per sequence: rank 0 [0, 1, .5] (mean .5), rank 1 half of it (mean .25)
OLD_BY_RANK = (OLD, REF + (OLD - REF) / 2)


def _token_rewards_rank(rank: int, store: str, out: str) -> None:
    from flowrl.algorithms.config import AlgorithmConfig
    from flowrl.ops.context import DistInfo, StageContext
    from flowrl.ops.registry import NoConfig, get_op

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    algo = AlgorithmConfig(kl_in_reward=True, kl_coef=0.1, kl_type="k1", kl_target=0.4,
                           kl_horizon=10)
    ctx = StageContext(stage="token_rewards", step=1, resources={"algorithm": algo},
                       dist=DistInfo(rank=rank, world_size=2, group=dist.group.WORLD))
    get_op("reward.token_rewards").fn(ctx, NoConfig(), rewards=REW, response_mask=MASK,
                                      old_logprobs=OLD_BY_RANK[rank], ref_logprobs=REF)
    Path(out, f"beta{rank}.json").write_text(json.dumps(ctx.resources["kl_controller"].value))
    dist.destroy_process_group()


def test_in_reward_kl_coefficient_is_the_same_on_every_rank(tmp_path):
    mp.spawn(_token_rewards_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    betas = [json.loads((tmp_path / f"beta{r}.json").read_text()) for r in (0, 1)]
    # the global batch: 6 sequences, mean KL (1.5 + .75) / 6 = .375 → e = .375 / .4 − 1, K = 6 / 10
    expected = 0.1 * (1 + (0.375 / 0.4 - 1) * 6 / 10)
    assert betas == [pytest.approx(expected, rel=1e-6)] * 2


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_partitioned_resume_when_rank_0_rolls_out(tmp_path):
    """Train pool [1], rollout pool [0]: global rank 0 writes the checkpoint metadata, but the
    prompt sampler state and the history are the train pool's (its logging rank's); before they
    were gathered from it, rank 0 wrote its own (none, empty) and the resume failed."""
    common = ["placement=partitioned", "placement.pools.train=[1]", "placement.pools.rollout=[0]",
              "trainer.save_every=1"]
    torchrun(tmp_path, *common, "trainer.total_steps=2")
    meta = json.loads((tmp_path / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert meta["prompts"] is not None and [h["step"] for h in meta["history"]] == [1, 2]
    torchrun(tmp_path, *common, "trainer.total_steps=3", "trainer.resume=true")
    assert sorted(read_metrics(tmp_path)) == [1, 2, 3]
    meta = json.loads((tmp_path / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert [h["step"] for h in meta["history"]] == [1, 2, 3]
