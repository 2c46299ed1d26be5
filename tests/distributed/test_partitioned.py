"""Partitioned placement (train pool [0], rollout pool [1]; 2 gloo processes under torchrun) against
the colocated runtime: same weights at k = 0, exact version lags at k = 1, a dead producer is an
error on the consumer, not a hang."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowrl.config import compose
from flowrl.runtime.io.metrics import read_metrics
from flowrl.train import train

REPO = Path(__file__).resolve().parents[2]
# random tiny model: GSM8K rewards are all 0, so the entropy bonus and the KL term (ref stage on
# the train pool) make sure the updates move the weights
ARGS = ["model=tiny", "trainer=smoke", "data.limit=64", "logger.progress=false",
        "logger.tensorboard=false", "trainer.eval.before=false", "trainer.eval.after=false",
        "trainer.total_steps=3", "algorithm.entropy_coef=0.01", "algorithm.kl_coef=0.01",
        "trainer.engine.lr=1e-3"]
PARTITIONED = ["placement=partitioned"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def torchrun(out: Path, *overrides: str, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "flowrl.train",
           *ARGS, *PARTITIONED, f"trainer.output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env={**ENV, **(env or {})}, capture_output=True,
                          text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def actor_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(ckpt / "flat.pt"))
    return torch.load(ckpt / "flat.pt", weights_only=False)["actor"]["model"]


def metrics(out: Path) -> dict[int, dict]:
    return read_metrics(out)


def test_k0_matches_colocated_weights(tmp_path):
    colo, part = tmp_path / "colocated", tmp_path / "partitioned"
    train(compose(ARGS + [f"trainer.output_dir={colo}"]))
    torchrun(part, "placement.staleness=0")
    a = actor_weights(colo / "checkpoints" / "step_000003")
    b = actor_weights(part / "checkpoints" / "step_000003")
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)
    m = metrics(part)
    assert [m[s]["placement/version_lag"] for s in (1, 2, 3)] == [0.0, 0.0, 0.0]
    for s in (1, 2, 3):
        row = m[s]
        assert row["actor/grad_norm"] > 0  # the updates did move the weights
        # both pools' store reports and busy times reach the train-pool logger
        assert row["store/peak_bytes/rollout"] > 0 and row["store/peak_bytes/train"] > 0
        assert row["perf/busy_s/rollout"] > 0 and row["perf/busy_s/train"] > 0
        # the rollout pool freed exactly what it sent: nothing stays behind on the sender
        assert row["store/freed_bytes/_send/rollout"] > 0
        assert row["rollout/logprob_mismatch"] < 1e-4  # same weights on both pools (k = 0)
        assert row["rollout/is_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert row["rollout/is_ratio_max"] == pytest.approx(1.0, abs=1e-3)
    colo_m = metrics(colo)
    for s in (1, 2, 3):
        assert m[s]["reward/mean"] == colo_m[s]["reward/mean"]
        assert m[s]["response/length_mean"] == colo_m[s]["response/length_mean"]
        assert m[s]["actor/entropy"] == pytest.approx(colo_m[s]["actor/entropy"], rel=1e-5)


def test_k1_version_lags_are_exactly_one_after_warmup(tmp_path):
    out = tmp_path / "k1"
    torchrun(out, "placement.staleness=1", "trainer.total_steps=4", "algorithm.rollout_is=tis")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["version_lags"] == [0, 1, 1, 1]
    m = metrics(out)
    assert [m[s]["placement/version_lag"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert [m[s]["placement/rollout_version"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 2.0]
    # off-policy batches: the trainer's recomputed old logprobs differ from the sampler's
    assert m[3]["rollout/logprob_mismatch"] > 1e-4
    assert m[3]["rollout/is_ratio_max"] > 1.0 + 1e-4  # what truncated IS caps at 2


def test_dead_producer_raises_on_the_consumer(tmp_path):
    out = tmp_path / "dead"
    t0 = time.monotonic()
    proc = torchrun(out, "placement.staleness=0", check=False,
                    env={"FLOWRL_FAULT_ROLLOUT_EXIT_AFTER": "1"})
    assert time.monotonic() - t0 < 60
    assert proc.returncode != 0
    # one line, no traceback: "flowrl train: stopped: rollout pool rank 1 stopped sending (...)"
    line = [l for l in proc.stderr.splitlines() if l.startswith("flowrl train: stopped: ")
            and "rollout pool" in l]
    assert line, proc.stderr[-3000:]
    # the train pool names the pool and rank that went away (while receiving its batch, or
    # while broadcasting the weights it would have needed)
    assert "rollout pool" in line[-1] and "rank" in line[-1] and "[1]" in line[-1] or \
        "rollout pool rank 1 stopped sending (" in line[-1], line


@pytest.mark.slow
def test_resume_continues_like_an_uninterrupted_run(tmp_path):
    """Checkpoint at step 2, resume to 3 (the rollout pool gets the resumed weights by broadcast
    and the prompt sampler's state from the checkpoint) = 3 colocated steps."""
    colo, part = tmp_path / "colocated", tmp_path / "partitioned"
    train(compose(ARGS + [f"trainer.output_dir={colo}"]))
    torchrun(part, "trainer.total_steps=2")
    torchrun(part, "trainer.resume=true")
    assert sorted(metrics(part)) == [1, 2, 3]
    a = actor_weights(colo / "checkpoints" / "step_000003")
    b = actor_weights(part / "checkpoints" / "step_000003")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)


@pytest.mark.slow
def test_two_rollout_ranks_feed_one_trainer_like_two_colocated_ranks(tmp_path):
    """rollout pool [1, 2] → train pool [0]: each rollout rank draws what colocated rank i draws
    (pool rank seeds, prompt shards); the trainer concatenates both shards and its loss
    denominators cover them, so one trainer = 2 FSDP ranks on the same global batch."""
    colo, part = tmp_path / "colocated", tmp_path / "partitioned"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "flowrl.train",
           *ARGS, f"trainer.output_dir={colo}"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "-m", "flowrl.train",
           *ARGS, *PARTITIONED, "placement.pools.train=[0]", "placement.pools.rollout=[1,2]",
           f"trainer.output_dir={part}"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    mc, mp_ = metrics(colo), metrics(part)
    for s in (1, 2, 3):
        assert mp_[s]["data/prompts"] == mc[s]["data/prompts"] == 4
        assert mp_[s]["response/length_mean"] == pytest.approx(mc[s]["response/length_mean"])
    a = actor_weights(colo / "checkpoints" / "step_000003")
    b = actor_weights(part / "checkpoints" / "step_000003")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)
