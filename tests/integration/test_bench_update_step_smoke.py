"""CPU smoke test of benchmarks/update_step.py: the variants run train_step on a 2-layer model in
interleaved rounds and the report holds one row each (CUDA-only ones listed as not run), with the
step's FLOP count of the e2e benchmark's formula."""
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

bench = pytest.importorskip("benchmarks.update_step")


def test_smoke_variants_run_and_report(tmp_path):
    out = tmp_path / "us.md"
    assert bench.main(["--device", "cpu", "--variants", "base,noentropy,mbt32k+chunk4k,liger,fsdp",
                       "--rounds", "2", "--steps", "1", "--warmup", "1", "--profile", "",
                       "--out", str(out)]) == 0
    text = out.read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| ([a-z0-9+]+) \|.*$", text, re.M)}
    assert set(rows) >= {"base", "noentropy", "mbt32k+chunk4k", "liger", "fsdp"}
    assert "| 1.00x |" in rows["base"]
    assert "not run (CUDA only)" in rows["liger"]
    assert "not run" not in rows["fsdp"]  # FSDP2 over a one-process gloo world
    import torch.distributed as dist

    assert not dist.is_initialized()  # the benchmark took its world down
    # 2 rounds x 1 timed step: min <= median <= max over 2 values
    lo, hi = (float(x) for x in re.search(r"\[([\d.]+)-([\d.]+)\]", rows["noentropy"]).groups())
    assert 0 < lo <= hi


def test_flop_count_is_the_e2e_formula():
    import torch

    b = {"prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
         "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    s = bench.SHAPES["smoke"]
    H, L, I = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"]
    hd = H // s["num_attention_heads"]
    n = L * (2 * H * H + 2 * H * s["num_key_value_heads"] * hd + 3 * H * I) + bench.VOCAB * H
    # rows of 4 and 6 valid tokens
    assert bench.flops_of(b, "smoke") == 6 * n * 4 + 6 * L * H * 16 + 6 * n * 6 + 6 * L * H * 36


def test_vary_shapes_gives_each_step_its_own_batch_and_every_variant_the_same_sequence():
    import torch

    made = []
    batches = bench.Batches(lambda seed: (made.append(seed), bench._batch(4, 2, 6, 32, 0.9, seed))[1],
                            vary=True, device=torch.device("cpu"))
    a, b = batches.get(0)[0], batches.get(1)[0]
    assert not torch.equal(a["response_mask"], b["response_mask"])  # other lengths, other shapes
    assert batches.get(0)[0] is a and made == [0, 1]  # a second variant's step 0: the same batch
    fixed = bench.Batches(lambda seed: bench._batch(4, 2, 6, 32, 0.9, seed), vary=False,
                          device=torch.device("cpu"))
    assert fixed.get(0)[0] is fixed.get(5)[0]
