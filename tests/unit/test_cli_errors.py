"""Config mistakes on the command line are one line and exit status 2, also with launcher.nproc > 1
(validated here before torchrun starts)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("args,expected", [
    (["train", "launcher.nproc=2", "trainer.total_step=3"],
     "flowrl train: error: unknown key trainer.total_step (did you mean trainer.total_steps?): "
     "nothing reads it; `flowrl train --cfg job` prints every key"),
    (["train", "launcher.nproc=2", "placement=partitoned"],
     "flowrl train: error: placement=partitoned: no such option (did you mean "
     "placement=partitioned?); choose one of auto, colocated, "
     "partitioned"),
    (["train", "launcher.nproc=2", "placement=partitioned", "placement.pools.train=[0,1]"],
     "flowrl train: error: placement.pools: rank 1 is in both 'train' and 'rollout' (partitioned "
     "pools must not overlap)"),
    (["plan", "placement.staleness=abc"],
     "flowrl plan: error: placement.staleness=abc: placement.staleness takes an integer, got 'abc'"),
    (["train", "placement.staleness=abc"],  # single process: before Hydra's own 6-line report
     "flowrl train: error: placement.staleness=abc: placement.staleness takes an integer, got 'abc'"),
])
def test_one_line_errors(args, expected, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", *args], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [expected]
    assert not (tmp_path / "outputs").exists()  # nothing started, no run directory


def test_valid_multi_rank_job_reaches_torchrun(monkeypatch, tmp_path):
    """The pre-launch validation passes a good job through to the torchrun exec (regression: a
    local import once shadowed ``sys`` and broke every launcher.nproc > 1 run)."""
    from flowrl import launch
    from flowrl.train import main

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    seen = {}

    def fake_execv(path, argv):
        seen["argv"] = argv
        raise SystemExit(0)

    monkeypatch.setattr(launch.os, "execv", fake_execv)
    with pytest.raises(SystemExit) as e:
        main(["launcher.nproc=2", "model=tiny", "trainer=smoke", f"trainer.output_dir={tmp_path}"])
    assert e.value.code == 0
    assert "--nproc_per_node=2" in seen["argv"] and "launcher.nproc=2" in seen["argv"]
