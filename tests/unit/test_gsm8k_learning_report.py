"""benchmarks/gsm8k_learning.py: the format-vs-accuracy split of the strict gain, the verdict it
prints, and a report (markdown, kept run files, PNG when matplotlib is there) from a run dir."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gsm8k_learning as report  # noqa: E402


def ev(strict, mv, fmt, n=1319.0, unformatted=0.0):
    return {"eval/accuracy": strict, "eval/accuracy_strict": strict, "eval/accuracy_math_verify": mv,
            "eval/format_frac": fmt, "eval/math_verify_unformatted_frac": unformatted, "eval/n": n,
            "eval/truncated_frac": 0.1, "eval/response_length_mean": 200.0, "eval/seconds": 4.0}


def test_decompose_is_exact():
    before, after = ev(0.02, 0.10, 0.10), ev(0.12, 0.13, 0.60)
    d = report.decompose(before, after)
    # P0 = 0.02 / 0.10 = 0.2, P1 = 0.12 / 0.60 = 0.2: the whole gain is format
    assert d["P0"] == pytest.approx(0.2) and d["P1"] == pytest.approx(0.2)
    assert d["format_part"] == pytest.approx(0.50 * 0.2)
    assert d["accuracy_part"] == pytest.approx(0.0, abs=1e-12)
    assert d["format_part"] + d["accuracy_part"] == pytest.approx(d["d_strict"])
    # 95% half-width of a difference of two independent binomial fractions over 1319 answers
    se = lambda p: (p * (1 - p) / 1319) ** 0.5  # noqa: E731
    assert d["d_mv_ci"] == pytest.approx(1.96 * (se(0.10) ** 2 + se(0.13) ** 2) ** 0.5)


@pytest.mark.parametrize("before, after, verdict", [
    (ev(0.02, 0.10, 0.10), ev(0.12, 0.11, 0.60), "format learning"),      # math-verify flat
    (ev(0.02, 0.10, 0.10), ev(0.20, 0.25, 0.70), "Part of the gain is arithmetic"),
    (ev(0.02, 0.20, 0.10), ev(0.10, 0.10, 0.70), "Arithmetic got worse"),
    (ev(0.02, 0.10, 0.10), ev(0.021, 0.101, 0.11), "Neither strict nor math-verify"),
])
def test_verdict(before, after, verdict):
    lines = report.reading(before, after)
    assert verdict in next(line for line in lines if "Verdict" in line)


def test_report_from_a_run_dir(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(
        "trainer:\n  total_steps: 2\n  prompts_per_step: 64\n  eval: {limit: null, split: test}\n"
        "algorithm: {n: 8}\nmodel: {path: smollm2}\n")
    (run / ".hydra" / "overrides.yaml").write_text("- trainer=gsm8k_gpu\n- rollout=vllm\n")
    before, after = ev(0.02, 0.10, 0.10), ev(0.12, 0.11, 0.60)
    rows = [{"step": 0, **before},
            {"step": 1, "reward/mean": 0.05, "reward/accuracy": 0.01, "perf/step_s": 4.0},
            {"step": 2, "reward/mean": 0.15, "reward/accuracy": 0.05, "perf/step_s": 5.0},
            {"step": 2, "perf/checkpoint_s": 1.0}, {"step": 2, **after}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"eval_before": before, "eval_after": after,
                                                  "model_load_s": 90.0}))
    stem = tmp_path / "out" / "gsm8k"
    assert report.main([str(run), "--out-stem", str(stem), "--commit", "abc1234",
                        "--machine", "1 x H200"]) == 0
    md = (stem.with_suffix(".md")).read_text()
    assert "`python -m flowrl.train trainer=gsm8k_gpu rollout=vllm`" in md
    assert "commit abc1234" in md and "Machine: 1 x H200" in md
    assert "| strict accuracy (`#### n` right) | 0.020 | 0.120 | +0.100 |" in md
    assert "| answers with a `#### n` line | 0.100 | 0.600 | +0.500 |" in md
    assert "format learning" in md
    assert "| 2 | 0.1500 | 0.050 |" in md  # the step table merges a step's rows
    kept = stem.parent / "gsm8k"
    assert (kept / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()
    assert json.loads((kept / "meta.json").read_text())["commit"] == "abc1234"
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert stem.with_suffix(".png").is_file() == has_mpl
    # re-rendered from the kept files alone: the same facts
    assert report.main([str(kept), "--out-stem", str(kept)]) == 0
    again = kept.with_suffix(".md").read_text()
    assert "commit abc1234" in again and "Machine: 1 x H200" in again
    assert "| strict accuracy (`#### n` right) | 0.020 | 0.120 | +0.100 |" in again
