"""benchmarks/arith_learning.py: the before/after/curve numbers it reads from a run's
metrics.jsonl, and a report of two named runs; trainer.eval.every's range check."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import arith_learning as report  # noqa: E402


def write_run(folder: Path, accs: dict[int, float], peak: float) -> Path:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(
        "trainer:\n  total_steps: 4\n  prompts_per_step: 64\n  eval: {limit: null, every: 2}\n"
        "algorithm: {n: 8}\nmodel: {path: smollm2}\ndata: {name: arith, arith: {digits: 2}}\n")
    rows = []
    for step in range(5):
        if step:
            rows.append({"step": step, "reward/mean": 0.1 * step, "perf/step_s": 2.0 + step,
                         "perf/peak_device_gib": peak + step, "perf/weight_sync_bytes": 2.0 ** 20})
        if step in accs:
            rows.append({"step": step, "eval/accuracy": accs[step], "eval/n": 1000.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "command.txt").write_text("python -m flowrl.train trainer=arith_gpu\n")
    return folder


def test_headline_reads_before_after_and_costs(tmp_path):
    run = report.load_run(write_run(tmp_path / "full", {0: 0.2, 2: 0.35, 4: 0.5}, peak=10.0))
    assert sorted(run["evals"]) == [0, 2, 4] and len(run["steps"]) == 4
    h = report.headline(run)
    assert (h["before"], h["after"], h["best"], h["after_step"]) == (0.2, 0.5, 0.5, 4.0)
    assert h["delta"] == pytest.approx(0.3)
    se2 = 0.2 * 0.8 / 1000 + 0.5 * 0.5 / 1000
    assert h["delta_ci"] == pytest.approx(1.96 * se2 ** 0.5)
    assert (h["step_s"], h["peak_device_gib"], h["sync_bytes"]) == (4.5, 14.0, 2.0 ** 20)


def test_report_of_two_runs(tmp_path):
    full = write_run(tmp_path / "full", {0: 0.2, 2: 0.35, 4: 0.5}, peak=10.0)
    lora = write_run(tmp_path / "lora", {0: 0.2, 4: 0.3}, peak=5.0)
    stem = tmp_path / "out" / "learning_h200"
    assert report.main([f"full={full}", f"lora={lora}", "--out-stem", str(stem)]) == 0
    md = stem.with_suffix(".md").read_text()
    assert "| full | 0.200 | 0.500 | +30.0 ± 4.0 | 0.500 | 4 |" in md
    assert "| lora | 0.200 | 0.300 | +10.0 ± 3.8 | 0.300 | 4 |" in md
    assert "`full`: +30.0 points (meets the issue's +20); `lora`: +10.0 points (misses" in md
    assert (stem / "lora" / "metrics.jsonl").is_file()  # kept: the report re-renders from it
    assert report.main([f"full={stem / 'full'}", "--out-stem", str(stem)]) == 0


def test_eval_every_must_not_be_negative():
    from flowrl.config import EvalConfig

    assert EvalConfig().every == 0
    with pytest.raises(ValueError, match=r"^trainer.eval.every must be >= 0 \(0 = only "
                                         r"before/after\), got -1$"):
        EvalConfig(every=-1)
