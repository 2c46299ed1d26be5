"""benchmarks/distill_report.py: the teacher's held-out level, the first eval that reaches 90% of
it, the training and elapsed seconds up to there, read from synthetic runs; and (slow) the device
script's CPU dry run end to end: the three arms and the report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import distill_report as report  # noqa: E402


def write_run(folder: Path, accs: dict[int, float], train_acc: float = 0.5) -> Path:
    """Steps 1..4 (perf/step_s = 2 + step), held-out evals at the given steps (1.5 s each)."""
    folder.mkdir(parents=True)
    rows = []
    for step in range(5):
        if step:
            rows.append({"step": step, "perf/step_s": 2.0 + step, "reward/accuracy": train_acc})
        if step in accs:
            rows.append({"step": step, "eval/accuracy": accs[step], "eval/seconds": 1.5})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_held_out_curve_and_first_reach(tmp_path):
    run = write_run(tmp_path / "a", {0: 0.05, 2: 0.85, 4: 0.9})
    curve = report.held_out(run)
    # (step, accuracy, training s = sum of step_s so far, + 1.5 s per eval so far)
    assert curve == [(0, 0.05, 0.0, 1.5), (2, 0.85, 7.0, 10.0), (4, 0.9, 18.0, 22.5)]
    assert report.first_reach(curve, 0.81) == (2, 0.85, 7.0, 10.0)
    assert report.first_reach(curve, 0.95) is None


def test_report_of_three_arms(tmp_path):
    rl = write_run(tmp_path / "b", {0: 0.05, 2: 0.5, 4: 0.9}, train_acc=0.8)
    a = write_run(tmp_path / "a", {0: 0.05, 2: 0.85, 4: 0.9}, train_acc=0.75)
    c = write_run(tmp_path / "c", {0: 0.05, 2: 0.4, 4: 0.6}, train_acc=0.3)
    (c / "wall_s.txt").write_text("300 (exit 0)\n")
    stem = tmp_path / "out" / "distill"
    stem.parent.mkdir()
    text = report.report(
        rl, {"a_distill": a, "c_sft": c, "b_rl": rl}, stem, window=2, command="cmd", commit="abc"
    )
    assert "held-out greedy accuracy 0.900; target = 90% of it = 0.810" in text
    assert "| (a) on-policy distillation | 0.050 | 0.900 (step 4) | 2 | 7 | 10 | - |" in text
    assert (
        "| (c) SFT on teacher samples | 0.050 | 0.600 (step 4) | not reached | - | - | 300 (exit 0) |"
        in text
    )
    assert "| (b) RL from the same start | 0.050 | 0.900 (step 4) | 4 | 18 | 22 | - |" in text
    assert "| 2 | 0.850 | 0.400 | 0.500 |" in text
    # second view: 90% of the teacher's 0.8 per-step training accuracy = 0.72
    assert "| (a) on-policy distillation | 4 | 0.750 | 1 |" in text
    assert "| (c) SFT on teacher samples | 4 | 0.300 | not reached |" in text
    assert stem.with_suffix(".md").read_text() == text
    assert (stem.parent / "distill_a_distill" / "metrics.jsonl").is_file()
    assert json.loads((stem.parent / "distill_meta.json").read_text())["target"] == pytest.approx(
        0.81
    )


@pytest.mark.slow
def test_device_script_cpu_dry_run(tmp_path):
    """scripts/device/distill_run.sh with DRY_CPU=1: STAGE=teacher trains and exports the tiny
    RL teacher, STAGE=distill runs arms (a) and (c) side by side from it, then the report."""
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "RUNS": str(tmp_path / "runs"),
        "DRY_CPU": "1",
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
    }
    for stage in ("teacher", "distill"):
        r = subprocess.run(
            ["bash", "scripts/device/distill_run.sh"],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**env, "STAGE": stage},
            timeout=500,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if p.suffix != ".png") == [
        "distill.md",
        "distill_runs.tgz",
        "distill_teacher_run.tgz",
    ]
    text = (out / "distill.md").read_text()
    for arm in (
        "(a) on-policy distillation",
        "(b) RL from the same start",
        "(c) SFT on teacher samples",
    ):
        assert f"| {arm} | " in text
    runs = tmp_path / "runs"
    assert "graph=sft_teacher" in (runs / "c_sft" / "command.txt").read_text()
    assert sorted(report.read_metrics(runs / "c_sft")) == [0, 1, 2]
