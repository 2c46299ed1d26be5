"""CPU smoke test of benchmarks/vlm.py: a 2-layer Qwen2.5-VL (the 3B run's architecture) through
flowrl's HF rollout with images, the trainer's logprobs and one update, and the markdown table."""
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

vlm = pytest.importorskip("benchmarks.vlm")


@pytest.mark.slow  # builds and saves a model, then three timed phases: ~40 s on 2 busy cores
def test_smoke_rows_and_report(tmp_path):
    md = tmp_path / "vlm.md"
    assert vlm.main(["--smoke", "--model-dir", str(tmp_path / "m"), "--md-out", str(md)]) == 0
    lines = md.read_text().splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| variant")]
    assert [r.split(" | ")[0] for r in rows] == ["| hf-rollout", "| logprobs", "| train-step"]
    # 2 prompts x n=2 x 8 new tokens: the random model rarely stops early
    assert 0 < int(rows[0].split(" | ")[2]) <= 32
    assert "--smoke" in md.read_text() and "grad_norm=" in rows[2]
