"""What a new micro-batch shape costs masked SDPA, per backend: cuDNN attention against the
memory-efficient kernel (issue 24: the update's slow steps).

Why: flowrl's padded micro-batches are cut to a token budget, so their (rows, length) change from
step to step, and transformers' SDPA path hands them to PyTorch with a padding mask. On an H100/H200
PyTorch picks cuDNN attention for that, and cuDNN builds a graph per new shape (other projects
report ~0.1-0.4 s a build). This script times one forward + backward of masked, causal SDPA at a
sequence of shapes never seen before, then at the same shapes again, for each backend, with the
attention layout of the Qwen2.5-0.5B shape (14 query heads of 64, grouped-query keys expanded as
transformers does). It also checks that both backends give the same output.

Usage (a GPU; torch only, nothing else is imported)::

    python benchmarks/sdpa_shapes.py --out benchmarks/results/sdpa_shapes_h100.md
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# (rows, length) of padded micro-batches as the token budget (16,384 positions) cuts them: new each
# step when the step's prompt and answer lengths change
SHAPES = [(40, 384), (56, 272), (64, 240), (48, 320), (36, 416), (72, 224), (44, 352), (52, 296)]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
# HF generate's decode: one query per row against a cache one token longer every step (forward only)
DECODE_ROWS, DECODE_KV = 256, list(range(200, 216))


def _inputs(b: int, L: int, heads: int, d: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, heads, L, d, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_() for _ in range(3))
    # valid tokens first, padding at the row's end (flowrl's left-aligned rows), causal
    lens = torch.randint(L // 2, L + 1, (b,), device="cuda", generator=g)
    key_ok = torch.arange(L, device="cuda")[None, :] < lens[:, None]
    causal = torch.ones(L, L, device="cuda", dtype=torch.bool).tril()
    mask = causal[None, None] & key_ok[:, None, None, :]
    return q, k, v, mask


def _fwd_bwd(backend: SDPBackend, q, k, v, mask) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with sdpa_kernel([backend]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.float().square().mean().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out.detach()


def _decode(backend: SDPBackend, b: int, kv: int, heads: int, d: int) -> float:
    """Seconds of one masked decode-step SDPA call (1 query, ``kv`` keys, no grad)."""
    q = torch.randn(b, heads, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, heads, kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(b, 1, 1, kv, device="cuda", dtype=torch.bool)
    mask[::2, ..., :8] = False  # left padding on every other row
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad(), sdpa_kernel([backend]):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="markdown report path")
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    warm = _inputs(8, 128, args.heads, args.head_dim, 0)  # CUDA context, library loads
    for be in BACKENDS.values():
        _fwd_bwd(be, *warm)
    first: dict[str, list[float]] = {n: [] for n in BACKENDS}
    again: dict[str, list[float]] = {n: [] for n in BACKENDS}
    diffs = []
    for i, (b, L) in enumerate(SHAPES):  # backends interleaved shape by shape
        outs = {}
        for name, be in BACKENDS.items():
            x = _inputs(b, L, args.heads, args.head_dim, 100 + i)
            s, outs[name] = _fwd_bwd(be, *x)
            first[name].append(s)
            again[name].append(_fwd_bwd(be, *x)[0])
        diffs.append((outs["cudnn"].float() - outs["efficient"].float()).abs().max().item())
    decode: dict[str, list[float]] = {n: [] for n in BACKENDS}
    for kv in DECODE_KV:
        for name, be in BACKENDS.items():
            try:
                decode[name].append(_decode(be, DECODE_ROWS, kv, args.heads, args.head_dim))
            except RuntimeError as e:  # the backend refuses this shape: said in the report
                print(f"decode kv={kv} {name}: {str(e).splitlines()[0][:160]}")
    rows = []
    for name in BACKENDS:
        rows.append((name, f"{statistics.median(first[name]) * 1e3:.1f} "
                           f"[{min(first[name]) * 1e3:.1f}-{max(first[name]) * 1e3:.1f}]",
                     f"{statistics.median(again[name]) * 1e3:.2f} "
                     f"[{min(again[name]) * 1e3:.2f}-{max(again[name]) * 1e3:.2f}]",
                     f"{sum(first[name]) * 1e3:.0f}"))
    head = ("backend", "new shape: fwd+bwd ms, median [min-max]", "same shape again: ms",
            f"Σ over the {len(SHAPES)} new shapes, ms")
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    commit = os.environ.get("FLOWRL_COMMIT", "?")
    lines = [f"# Masked SDPA at new shapes: cuDNN against memory-efficient ({torch.cuda.get_device_name()})",
             "", f"- command: `python {' '.join(sys.argv)}`",
             f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; flowrl commit {commit}",
             f"- machine: {torch.cuda.get_device_name()}, {platform.node()}; torch {torch.__version__}, "
             f"cuDNN {torch.backends.cudnn.version()}",
             f"- shapes (rows, length): {SHAPES}; {args.heads} heads of {args.head_dim}, bf16, "
             "causal + key padding mask, one forward + backward each", "", *table, "",
             f"max |cuDNN - efficient| over outputs: {max(diffs):.3g}", "",
             f"Decode steps (HF generate's shape: {DECODE_ROWS} rows, 1 query, a cache of "
             f"{DECODE_KV[0]}-{DECODE_KV[-1]} keys, one longer each call, padding mask, no grad):", ""]
    for name in BACKENDS:
        t = decode[name]
        lines.append(f"- {name}: " + (f"median {statistics.median(t) * 1e3:.2f} ms, first "
                                      f"{t[0] * 1e3:.1f} ms, max {max(t) * 1e3:.1f} ms over {len(t)} "
                                      "calls" if t else "refused every shape"))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
