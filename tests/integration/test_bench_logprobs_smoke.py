"""CPU smoke test of benchmarks/logprobs.py: every CPU variant runs on a 2-layer model and the
report holds its row; fp32 paths agree with the plain one."""
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

bench = pytest.importorskip("benchmarks.logprobs")


def test_smoke_variants_run_and_report(tmp_path):
    out = tmp_path / "lp.md"
    assert bench.main(["--smoke", "--chunk-sizes", "5", "--out", str(out)]) == 0
    text = out.read_text()
    assert "--smoke" in text and "Failed variants" not in text
    for name in ("plain", "chunked", "packed-sdpa", "packed-sdpa+chunked", "chunked-5"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
        assert float(re.split(r"\s*\|\s*", row)[-2]) < 1e-5, row  # max |Δlp| vs plain, fp32
