"""Smoke run of benchmarks/e2e_vs_trl.py: one tiny step in each framework, report written."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "e2e_vs_trl.py"


def _table(text: str, first_header: str) -> list[list[str]]:
    """Rows (cells stripped) of the markdown table whose header starts with ``first_header``."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows


@pytest.mark.slow
def test_tiny_one_step_writes_both_rows(tmp_path):
    out = tmp_path / "e2e.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny", "--steps", "1", "--prompts-per-step", "2",
         "--n", "2", "--max-new-tokens", "8", "--micro-batch-size", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "--model tiny --steps 1" in text  # the exact command is recorded

    results = _table(text, "framework")
    assert [r[0] for r in results] == ["flowrl", "trl", "flowrl/TRL"]
    for row in results[:2]:
        assert row[1] == "1 of 1"  # one step: nothing to exclude as warm-up
        tokens_per_s, step_s, rss_gib = float(row[2]), float(row[3]), float(row[6])
        assert tokens_per_s > 0 and step_s > 0 and 0.1 < rss_gib < 24
        # 2 prompts x 2 samples, each 1..8 valid tokens
        assert 1 <= float(row[5]) <= 8
    assert re.fullmatch(r"\d+\.\d\d×", results[2][2])

    steps = _table(text.split("### Per step", 1)[1], "framework")
    assert [(r[0], r[1]) for r in steps] == [("flowrl", "1"), ("trl", "1")]
    for r in steps:
        assert 4 <= int(r[4]) <= 4 * 8  # generated tokens of 4 completions

    settings = dict((r[0], r[1:]) for r in _table(text, "setting"))
    assert settings["loss"][1].startswith("loss_type=dapo")
    assert settings["KL"] == ["kl_coef=0.0 (no ref stage)", "beta=0.0 (no ref model)"]
    assert "max_completion_length=8" in settings["sampling"][1]
