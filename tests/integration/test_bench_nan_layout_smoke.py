"""CPU smoke test of benchmarks/nan_layout_check.py (issue 25's NaN check): both layouts run
through raw SDPA and the train engine's own path, and the report counts every case (on CPU's math
backend none is NaN: the NaN is a GPU-backend question)."""
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

bench = pytest.importorskip("benchmarks.nan_layout_check")


def test_smoke_both_layouts_report(tmp_path):
    out = tmp_path / "nan.md"
    assert bench.main(["--device", "cpu", "--lengths", "16", "--seeds", "1", "--layers", "1", "--vocab", "512",
                       "--md-out", str(out)]) == 0
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in out.read_text().splitlines() if line.startswith(("| sdpa", "| model"))]
    assert rows == [["sdpa math", "left-padded", "0/1"], ["sdpa math", "left-aligned", "0/1"],
                    ["model sdpa", "left-padded", "0/1"], ["model sdpa", "left-aligned", "0/1"]]
