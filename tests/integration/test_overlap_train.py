"""`flowrl train placement.staleness=1` on one process: the rollout of step s+1 runs beside the
update of step s (runtime/control/overlap.py), on a tiny random model."""
import json
from pathlib import Path

import pytest

from flowrl.config import compose
from flowrl.runtime.io.metrics import read_metrics
from flowrl.train import train

BASE = ["model=tiny", "trainer=smoke", "data.limit=64", "logger.progress=false",
        "trainer.eval.before=false", "trainer.eval.after=false"]
COMPARED = ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/grad_norm",
            "actor/entropy", "rollout/logprob_mismatch")


@pytest.fixture(autouse=True)
def varied_reward(monkeypatch):
    """Rewards that vary with the response text (the tiny random model never answers GSM8K), so
    the advantages are non-zero and the updates move the weights."""
    from flowrl import rewards

    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "gsm8k",
                        lambda text, gt, **kw: float(sum(map(ord, text)) % 7) / 6.0)


def run(tmp: Path, *overrides: str) -> dict:
    return train(compose(BASE + [f"trainer.output_dir={tmp}", *overrides]))


def prompt_state(d: Path, step: int) -> dict:
    return json.loads((d / f"checkpoints/step_{step:06d}/trainer_state.json").read_text())["prompts"]


def test_overlap_trains_each_batch_one_version_behind(tmp_path):
    """Step 1 is on-policy (nothing ran ahead): it equals the colocated run's step 1. Batch 2 was
    generated with the initial weights while the trainer updated, so the trainer's recomputed
    old logprobs differ from the sampler's by the whole first update, where the colocated run's
    agree to float error."""
    colo, over = tmp_path / "colocated", tmp_path / "overlap"
    run(colo, "trainer.total_steps=3", "trainer.engine.lr=0.05")
    summary = run(over, "trainer.total_steps=3", "trainer.engine.lr=0.05", "placement.staleness=1")
    a, b = read_metrics(colo), read_metrics(over)
    assert summary["version_lags"] == [0, 1, 1] and summary["staleness"] == 1
    assert [b[s]["placement/version_lag"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for key in COMPARED:
        assert b[1][key] == pytest.approx(a[1][key], rel=1e-5, abs=1e-7), key
    assert a[1]["actor/grad_norm"] > 0  # the first update moved the weights
    for s in (2, 3):
        assert a[s]["rollout/logprob_mismatch"] < 1e-4
        assert b[s]["rollout/logprob_mismatch"] > 10 * a[s]["rollout/logprob_mismatch"]
        # the halves' own figures, and what ran beside what
        for key in ("perf/step_s/rollout", "perf/step_s/train", "time/rollout", "time/update",
                    "time/old_logprobs", "perf/overlap/rollout_ahead_s", "perf/sync_s"):
            assert key in b[s], key
    assert b[3]["perf/overlap/rollout_ahead_s"] == 0.0  # nothing to draw after the last step
    assert b[2]["perf/overlap/rollout_ahead_s"] > 0.0
    # the data order is the colocated run's: same prompts, same sampler position
    assert prompt_state(over, 3) == prompt_state(colo, 3)
    # the run's plan.txt says the timeline runs as two halves, one version behind
    assert "Overlap (placement.staleness=1, one-step off-policy)" in (over / "plan.txt").read_text()
    assert "Overlap" not in (colo / "plan.txt").read_text()


def test_overlap_with_frozen_weights_is_the_colocated_run(tmp_path):
    """With lr=0 the weights never change, so drawing a batch one update early changes nothing:
    every step's metrics equal the colocated run's (same prompts, same sampling seeds)."""
    colo, over = tmp_path / "colocated", tmp_path / "overlap"
    run(colo, "trainer.total_steps=3", "trainer.engine.lr=0.0")
    run(over, "trainer.total_steps=3", "trainer.engine.lr=0.0", "placement.staleness=1")
    a, b = read_metrics(colo), read_metrics(over)
    for s in (1, 2, 3):
        for key in COMPARED[:-1]:
            assert b[s][key] == pytest.approx(a[s][key], rel=1e-5, abs=1e-7), (s, key)


def test_overlap_resume_saves_the_trained_batch_position(tmp_path):
    """A checkpoint of step 2 is written while batch 3 has already been drawn: it must hold the
    sampler as it was after batch 2, so the resumed run draws batch 3 again (lr=0: the same
    batch and the same metrics as the run that was never stopped)."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    frozen = ["trainer.engine.lr=0.0", "placement.staleness=1", "trainer.save_every=1"]
    run(straight, "trainer.total_steps=3", *frozen)
    run(stopped, "trainer.total_steps=2", *frozen)
    assert prompt_state(stopped, 2) == prompt_state(straight, 2) != prompt_state(straight, 3)
    summary = run(stopped, "trainer.total_steps=3", "trainer.resume=true", *frozen)
    a, b = read_metrics(straight), read_metrics(stopped)
    for key in COMPARED[:-1]:
        assert b[3][key] == pytest.approx(a[3][key], rel=1e-5, abs=1e-7), key
    assert b[3]["placement/version_lag"] == 0.0  # nothing ran ahead of the resume
    assert summary["version_lags"] == [0, 1, 0]
    assert prompt_state(stopped, 3) == prompt_state(straight, 3)


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_overlap_on_two_ranks(tmp_path):
    """`launcher.nproc=2`: each rank runs both halves; the update's FSDP collectives (world group,
    in the update thread) and the rollout half's (a group of its own, in the main thread) never
    share a communicator, so the two threads cannot deadlock each other."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "flowrl.train", "launcher.nproc=2", *BASE, "trainer.total_steps=3",
           "placement.staleness=1", f"trainer.output_dir={out}"]
    r = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["version_lags"] == [0, 1, 1]
    m = read_metrics(out)
    assert [m[s]["placement/version_lag"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert (out / "checkpoints" / "step_000003" / ".metadata").is_file()
    text = r.stdout + r.stderr
    assert text.count("step 1 done") == 1  # rank 0 says it, not every rank
    # every start-up line once per job (rank 1's INFO records are filtered), but each rank's
    # process group line, which differs per rank
    assert text.count("start-up: model loaded on cpu") == 1
    assert text.count("start-up: engines of ") == 1
    assert "process group: rank 0/2" in text and "process group: rank 1/2" in text


def test_summary_keeps_one_lag_per_step_across_parts_of_either_kind(tmp_path):
    """A run resumed with the overlap switched on (or off) keeps `version_lags` one per step: the
    on-policy parts' steps count 0, and `staleness` names the latest part's."""
    out = tmp_path / "run"
    run(out, "trainer.total_steps=2", "trainer.engine.lr=0.0")
    summary = run(out, "trainer.total_steps=4", "trainer.resume=true", "trainer.engine.lr=0.0",
                  "placement.staleness=1")
    assert summary["version_lags"] == [0, 0, 0, 1] and summary["staleness"] == 1
    summary = run(out, "trainer.total_steps=5", "trainer.resume=true", "trainer.engine.lr=0.0")
    assert summary["version_lags"] == [0, 0, 0, 1, 0] and summary["staleness"] == 0
    assert len(summary["history"]) == 5
