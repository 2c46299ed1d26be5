"""The train engine's forward paths, timed: plain (full logits) vs chunked LM head vs padding-free.

GPU run (one H200, about 3 min; the lead's command):
    python benchmarks/logprobs.py --out benchmarks/results/logprobs_h200.md
CPU smoke (2-layer model, numbers meaningless; tests/integration/test_bench_logprobs_smoke.py):
    python benchmarks/logprobs.py --smoke --out /tmp/logprobs_smoke.md

Model: random Qwen2.5-0.5B-shaped ``Qwen2ForCausalLM`` (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, ``--vocab`` 151936, tied embeddings) in bf16 on the GPU. Workload: one GRPO-like
mini-batch of ``--rows`` sequences, prompts of ``--prompt-len`` tokens at most (left-padded, length
uniform in [half, full]), responses of ``--response-len`` at most (right-padded, uniform in
[1/8, full]); cut by the engine into token-budget micro-batches (``--micro-tokens``), as
``train_step`` does. Each variant is a ``LocalTrainEngine`` over the same model weights:

- ``fwd``: ``engine.logprobs(batch, T, with_entropy=True)`` (no grad: old/ref logprobs);
- ``fwd+bwd``: per micro-batch ``engine._logprobs`` (entropy as a metric) and the backward of a
  token-sum policy-gradient loss, gradients accumulated (no optimizer step: it is the same for all).

Reported: median milliseconds of ``--repeats`` timed calls after ``--warmup`` calls (the first call
of ``flex_attention`` and of ``+compile`` (``logprob_compile``) compiles; its seconds are the
"first call" column), peak CUDA memory above the
model (``max_memory_allocated`` minus the memory before the call), response tokens per second of
``fwd+bwd``, and the largest |logprob - plain's| over valid tokens (bf16: expect ~1e-2, the rounding
of bf16 logits in a different matmul shape).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import (  # noqa: E402
    REPO_ROOT,
    command_line,
    git_revision,
    machine_info,
    markdown_table,
    text_table,
    utc_now,
    versions,
)

from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine

# name -> (attn_implementation, logprob_chunk_size, padding_free, logprob_compile); "chunked-N"
# variants come from --chunk-sizes
VARIANTS = {
    "plain": ("sdpa", None, "false", False),
    "chunked": ("sdpa", 1024, "false", False),
    "chunked+compile": ("sdpa", 1024, "false", True),
    "packed-sdpa": ("sdpa", None, "true", False),
    "packed-sdpa+chunked": ("sdpa", 1024, "true", False),
    "packed-flex+chunked": ("flex_attention", 1024, "true", False),
    "packed-flex+chunked+compile": ("flex_attention", 1024, "true", True),
}


def build_model(args, device: torch.device):
    import transformers

    if args.smoke:
        cfg = transformers.Qwen2Config(vocab_size=1024, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=128, tie_word_embeddings=True)
    else:
        cfg = transformers.Qwen2Config(vocab_size=args.vocab, hidden_size=896, num_hidden_layers=24,
                                       num_attention_heads=14, num_key_value_heads=2,
                                       intermediate_size=4864, tie_word_embeddings=True,
                                       max_position_embeddings=32768)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM._from_config(cfg, dtype=dtype,
                                                           attn_implementation="sdpa")
    return model


def make_batch(args, vocab: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(1)
    B, P, R = args.rows, args.prompt_len, args.response_len
    p_len = torch.randint(max(1, P // 2), P + 1, (B,), generator=g)
    r_len = torch.randint(max(1, R // 8), R + 1, (B,), generator=g)
    p_mask = torch.arange(P).flip(0)[None] < p_len[:, None]
    r_mask = torch.arange(R)[None] < r_len[:, None]
    batch = dict(prompt_ids=torch.randint(3, vocab, (B, P), generator=g) * p_mask,
                 prompt_mask=p_mask,
                 response_ids=torch.randint(3, vocab, (B, R), generator=g) * r_mask,
                 response_mask=r_mask,
                 advantages=torch.randn(B, 1, generator=g).expand(B, R).contiguous())
    return {k: v.to(device) for k, v in batch.items()}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, warmup: int, repeats: int) -> dict:
    """First-call seconds, median ms of the timed calls, peak memory above the start (GiB)."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    first_s = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        fn()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else float("nan")
    return dict(first_s=first_s, ms=1e3 * statistics.median(times), peak_gib=peak, out=out)


def run_variant(name: str, spec, model, batch, args, device) -> dict:
    attn, chunk, pf, compile_ = spec
    model.set_attn_implementation(attn)
    eng = LocalTrainEngine(model, TrainEngineConfig(
        lr=0.0, logprob_chunk_size=chunk, padding_free=pf, logprob_compile=compile_,
        max_tokens_per_micro_batch=args.micro_tokens))
    eng.optimizer = None  # no step is taken: free AdamW's moments before timing
    eng.scheduler = None
    gc.collect()
    B = batch["response_ids"].shape[0]
    mask = batch["response_mask"]
    T = args.temperature

    def fwd():
        return eng.logprobs(batch, T, with_entropy=True).logprobs

    def fwd_bwd():
        eng.model.train()
        for rows in eng._partitions(batch):
            mb = eng._micro_batch(batch, rows, B)
            lp, _ = eng._logprobs(mb, T, with_entropy=True, entropy_grad=False)
            (-(lp * mb["advantages"] * mb["response_mask"]).sum() / mask.sum()).backward()
        eng.model.zero_grad(set_to_none=True)

    try:
        f = _timed(fwd, device, args.warmup, args.repeats)
        fb = _timed(fwd_bwd, device, args.warmup, args.repeats)
        row = dict(variant=name, attn=attn, chunk=chunk or "-", padding_free=pf, compile=compile_,
                   packed=eng._padding_free, fused_head=eng._head is not None,
                   fwd_ms=f["ms"], fwd_peak_gib=f["peak_gib"], fwd_bwd_ms=fb["ms"],
                   fwd_bwd_peak_gib=fb["peak_gib"], first_s=f["first_s"] + fb["first_s"],
                   tokens_per_s=float(mask.sum()) / (fb["ms"] / 1e3), logprobs=f["out"].float())
    finally:
        eng = None  # drop the engine (and its module references) before the next variant
        model.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="2-layer model on CPU, 1 repeat")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma list of {list(VARIANTS)} and chunked-N")
    ap.add_argument("--chunk-sizes", default="", help="extra chunked-N variants, e.g. 256,4096")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--micro-tokens", type=int, default=16384)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/logprobs_h200.md")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.prompt_len, args.response_len = 6, 8, 12
        args.micro_tokens, args.warmup, args.repeats = 64, 1, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    names = [n for n in args.variants.split(",") if n]
    names += [f"chunked-{c}" for c in args.chunk_sizes.split(",") if c]
    if "plain" not in names:
        names.insert(0, "plain")  # the reference of the |Δ logprob| column

    model = build_model(args, device)
    batch = make_batch(args, model.config.vocab_size, device)
    mask = batch["response_mask"]
    rows, errors = [], {}
    for name in names:
        spec = VARIANTS.get(name)
        if spec is None and name.startswith("chunked-"):
            spec = ("sdpa", int(name.split("-", 1)[1]), "false", False)
        if spec is None:
            raise SystemExit(f"unknown variant {name!r}")
        if args.smoke and (spec[0] == "flex_attention" or spec[3]):
            continue  # torch.compile on CPU: minutes
        try:
            rows.append(run_variant(name, spec, model, batch, args, device))
        except Exception as e:  # one failing variant (e.g. flex on an old stack) keeps the rest
            errors[name] = f"{type(e).__name__}: {e}"[:300]
            print(f"{name}: {errors[name]}", file=sys.stderr)
    ref = next(r["logprobs"] for r in rows if r["variant"] == "plain")
    headers = ["variant", "attn", "chunk", "packed", "compile", "fwd ms", "fwd peak GiB", "fwd+bwd ms",
               "fwd+bwd peak GiB", "resp tok/s (fwd+bwd)", "first call s", "max |Δlp| vs plain"]
    table = [[r["variant"], r["attn"], r["chunk"], r["packed"], r["compile"], f"{r['fwd_ms']:.1f}",
              f"{r['fwd_peak_gib']:.2f}", f"{r['fwd_bwd_ms']:.1f}", f"{r['fwd_bwd_peak_gib']:.2f}",
              f"{r['tokens_per_s']:,.0f}", f"{r['first_s']:.1f}",
              f"{(r['logprobs'] - ref)[mask].abs().max().item():.2e}"] for r in rows]
    print(text_table(headers, table))
    n_params = sum(p.numel() for p in model.parameters())
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "none (CPU)"
    tokens = int(mask.sum()) + int(batch["prompt_mask"].sum())
    lines = [
        "# Train-engine forward paths: plain vs chunked LM head vs padding-free", "",
        f"- command: `{command_line(None if argv is None else [__file__, *argv])}`", f"- date: {utc_now()}, commit {git_revision()}",
        f"- device: {gpu}; machine: {machine_info()}",
        f"- versions: {versions(['torch', 'transformers'])}",
        f"- model: Qwen2-shaped, {n_params / 1e6:.0f}M parameters, vocab {model.config.vocab_size}, "
        f"{next(model.parameters()).dtype}; batch: {args.rows} rows, {int(mask.sum())} valid response "
        f"tokens, {tokens} valid tokens, padded {tuple(batch['prompt_ids'].shape)} + "
        f"{tuple(batch['response_ids'].shape)}; micro-batch token budget {args.micro_tokens}; "
        f"T = {args.temperature}; median of {args.repeats} after {args.warmup} warm-up calls",
        "", markdown_table(headers, table), ""]
    if errors:
        lines += ["Failed variants:", ""] + [f"- {k}: `{v}`" for k, v in errors.items()] + [""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
