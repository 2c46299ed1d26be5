"""CPU smoke test of benchmarks/rollout.py: the HF variants on a 2-layer model, the JSON it writes, and
the markdown report (ratios, floor) built from results."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

rollout = pytest.importorskip("benchmarks.rollout")


def test_hf_variants_run_and_report(tmp_path):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    rollout.main(["--smoke", "--in-process", "--variants", "hf-dynamic,hf-static", "--batches", "2,3",
                  "--prompt-len", "4", "--new-tokens", "5", "--model-dir", str(tmp_path / "m"),
                  "--json-out", str(out), "--md-out", str(md)])
    res = json.loads(out.read_text())
    assert res["errors"] == {}
    got = sorted((r["variant"], r["batch"]) for r in res["rows"])
    assert got == [("hf-dynamic", 2), ("hf-dynamic", 3), ("hf-static", 2), ("hf-static", 3)]
    for r in res["rows"]:
        assert 0 < r["tokens"] <= r["batch"] * 5  # a random model may sample EOS early
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
    assert set(res["floor"]) == {"2", "3"}
    text = md.read_text()
    assert "| hf-static | lp | 3 |" in text and "--smoke --in-process" in text


def _result(rows, floor):
    return dict(command="python benchmarks/rollout.py x", date="d", git="g", gpu="G", n_params=1e6,
                machine={"cpu": "c", "logical_cpus": "1"}, versions={}, prompt_len=4, new_tokens=5,
                rows=rows, errors={}, floor=floor)


def test_report_ratios_and_floor_share():
    rows = [dict(variant="hf-static", batch=8, sampling="lp", tokens=100, seconds=1.0, tokens_per_s=100.0,
                 settings={}),
            dict(variant="vllm-tuned", batch=8, sampling="lp-flat", tokens=100, seconds=0.4,
                 tokens_per_s=250.0, settings={}, effective={"max_num_seqs": 8})]
    text = rollout.report([_result(rows, {"8": 1000.0})], notes="NOTE-X", this_command="python r.py")
    assert "| vllm-tuned | lp-flat | 8 | 250 | 0.40 | 2.50 | 25.0 |" in text
    assert "| hf-static | lp | 8 | 100 | 1.00 | 1.00 | 10.0 |" in text
    assert text.rstrip().endswith("NOTE-X") and "    python r.py" in text


def test_floor_of_the_benchmarked_shape():
    """The floor quoted in benchmarks/results/rollout_h200.md for the 494M Qwen2.5-0.5B shape."""
    import torch
    with torch.device("meta"):
        m = rollout.build_model(False)
    n = sum(p.numel() for p in m.parameters())
    assert n == 494_032_768
    assert rollout.floor_tokens_per_s(256, 128, 256, n, m.config) == pytest.approx(261_831, abs=1)
    assert rollout.floor_tokens_per_s(2048, 128, 256, n, m.config) == pytest.approx(329_612, abs=1)
