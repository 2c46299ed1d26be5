"""Packed micro-batches under ``sdpa_varlen`` / ``sdpa_flex`` on one GPU: equal to padded, and how much faster.

Run (one H200, about 2-3 minutes, most of it flex_attention's first compile):
    python benchmarks/packing_gpu_check.py --out benchmarks/results/packing_h200.md

1. Equivalence (fp32, TF32 off): tiny random Llama and Qwen2 (grouped-query heads), the train
   engine's packed layout (``padding_free=true``: flex_attention over a BlockMask on CUDA) against
   the padded one (SDPA with a padding mask): max |Δ| of per-token logprobs and of every gradient
   (pass: ≤ 1e-4; the CPU tests hold 1e-5 for the dense-mask path, tests/unit/test_sdpa_flex.py).
   ``sdpa_varlen`` (torch's ``varlen_attn``: FlashAttention, bf16 only) in bf16: the packed layout's
   and the padded SDPA layout's max |Δ logprob| from an fp32 padded reference of the same weights
   (pass: packed ≤ 2 × padded + 1e-2), and the cosine of their gradients (pass: ≥ 0.99).
2. Speed (bf16 weights, the e2e benchmark's Qwen2.5-0.5B shape): one update-sized micro-batch of
   50 sequences, ragged prompts of 60-200 tokens and responses of 128-256 (~16k valid tokens, about the
   GPU default ``max_tokens_per_micro_batch``), forward + backward of the token-mean logprob
   loss, four layouts: padded SDPA (what every GPU number so far ran), packed with SDPA's dense
   (T, T) mask (``attn=sdpa``, ``padding_free=true``), packed ``sdpa_varlen`` (torch's
   ``varlen_attn``, the GPU default: nothing compiled), packed ``sdpa_flex`` (flex_attention), and
   that with ``trainer.engine.logprob_compile=true`` (the chunked LM-head logprobs
   compiled; off by default until it measures faster). Median of 5 timed
   iterations after 2 warm-ups; the first call's seconds (compile) reported apart; MFU against
   989 TFLOP/s with the e2e benchmark's FLOP count (valid tokens only); the stream syncs the host
   makes inside that micro-batch (``torch.cuda.set_sync_debug_mode("warn")``: each one stalls
   the host until the GPU has drained, so the next kernels are queued late).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, git_revision, markdown_table, text_table, utc_now, versions  # noqa: E402

PEAK = 989e12
DEVICE = "cuda"  # --device cpu: a smoke run of this script (dense-mask packing, a small shape)
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=1024)


def _engine(model, padding_free: str, compile_logprobs: bool = False):
    from flowrl.engines.config import TrainEngineConfig
    from flowrl.engines.train.local import LocalTrainEngine

    return LocalTrainEngine(model, TrainEngineConfig(lr=1e-5, logprob_chunk_size=1024,
                                                     padding_free=padding_free,
                                                     logprob_compile=compile_logprobs))


def _batch(n_rows: int, p_range, r_range, vocab: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    P, R = p_range[1], r_range[1]
    p_len = torch.randint(p_range[0], p_range[1] + 1, (n_rows,), generator=g)
    r_len = torch.randint(r_range[0], r_range[1] + 1, (n_rows,), generator=g)
    p_mask = torch.arange(P)[None] >= (P - p_len)[:, None]
    r_mask = torch.arange(R)[None] < r_len[:, None]
    return dict(prompt_ids=torch.randint(3, vocab, (n_rows, P), generator=g), prompt_mask=p_mask,
                response_ids=torch.randint(3, vocab, (n_rows, R), generator=g), response_mask=r_mask)


def _tiny(kind: str, attn: str, dtype, **shape):
    import torch

    from flowrl.models.loading import ModelConfig, build_tiny, tiny_model_config

    tiny = {**tiny_model_config("llama"), "model_type": kind, **shape}
    return build_tiny(ModelConfig(tiny=tiny, attn_implementation=attn), dtype, device=torch.device(DEVICE))


def _loss_backward(eng, b):
    # b on the host, as train_step hands each micro-batch's ids and masks to _logprobs
    lp, _ = eng._logprobs(b, 1.0, with_entropy=False)
    m = b["response_mask"].to(lp.device)
    loss = -(lp * m).sum() / m.sum()
    loss.backward()
    return lp


def equivalence() -> list[list]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for kind in ("llama", "qwen2"):
        model = _tiny(kind, "sdpa_flex", torch.float32, vocab_size=1024, num_attention_heads=4,
                      num_key_value_heads=2)
        b = _batch(6, (2, 9), (1, 12), 1024, seed=1)
        out = {}
        for pf in ("false", "true"):
            eng = _engine(copy.deepcopy(model), pf)
            lp = _loss_backward(eng, b)
            out[pf] = (lp.detach(), {n: p.grad for n, p in eng.model.named_parameters()})
        dlp = (out["true"][0] - out["false"][0]).abs().max().item()
        dg = max((out["true"][1][n] - g).abs().max().item() for n, g in out["false"][1].items())
        rows.append([kind, f"{dlp:.2e}", f"{dg:.2e}", "pass" if max(dlp, dg) <= 1e-4 else "FAIL"])
    return rows


def varlen_equivalence() -> list[list]:
    """bf16 packed sdpa_varlen and bf16 padded SDPA against an fp32 padded reference."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for kind in ("llama", "qwen2"):
        model = _tiny(kind, "sdpa_varlen", torch.float32, vocab_size=1024, num_attention_heads=4,
                      num_key_value_heads=2)
        b = _batch(6, (2, 9), (1, 12), 1024, seed=1)
        m = b["response_mask"].to(DEVICE)
        ref = _loss_backward(_engine(copy.deepcopy(model), "false"), b).detach()
        out = {}
        for pf in ("false", "true"):
            eng = _engine(copy.deepcopy(model).to(torch.bfloat16), pf)
            lp = _loss_backward(eng, b).detach().float()
            g = torch.cat([p.grad.float().flatten() for p in eng.model.parameters()])
            out[pf] = ((lp - ref)[m].abs().max().item(), g)
        (e_pad, g_pad), (e_pk, g_pk) = out["false"], out["true"]
        cos = torch.nn.functional.cosine_similarity(g_pk, g_pad, dim=0).item()
        ok = e_pk <= 2 * e_pad + 1e-2 and cos >= 0.99
        rows.append([kind, f"{e_pad:.2e}", f"{e_pk:.2e}", f"{cos:.5f}", "pass" if ok else "FAIL"])
    return rows


QWEN05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
               intermediate_size=4864, tie_word_embeddings=True, vocab_size=49152)


def speed(iters: int = 5) -> list[list]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    shape = QWEN05B if DEVICE == "cuda" else SMOKE
    b = _batch(50 if DEVICE == "cuda" else 4, (60, 200), (128, 256), shape["vocab_size"], seed=2)
    valid = int(b["prompt_mask"].sum() + b["response_mask"].sum())
    seqs = (b["prompt_mask"].sum(1) + b["response_mask"].sum(1)).tolist()
    n = None
    rows = []
    for label, attn, pf, comp in (
            ("padded, SDPA", "sdpa", "false", False),
            ("packed, SDPA dense mask", "sdpa", "true", False),
            ("packed, sdpa_varlen (varlen_attn)", "sdpa_varlen", "true", False),
            ("packed, sdpa_flex (flex_attention)", "sdpa_flex", "true", False),
            ("packed, sdpa_flex + logprob_compile", "sdpa_flex", "true", True)):
        model = _tiny("qwen2", attn, torch.bfloat16, **shape)
        n = n or sum(p.numel() for p in model.parameters())
        eng = _engine(model, pf, comp)
        times = []
        cuda = DEVICE == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(iters + 2):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            _loss_backward(eng, b)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            eng.model.zero_grad(set_to_none=True)
        syncs = "n/a"
        if cuda:  # stream syncs the host makes inside one micro-batch (the train loop's body)
            import warnings

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    _loss_backward(eng, b)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            eng.model.zero_grad(set_to_none=True)
            syncs = str(sum("synchroniz" in str(w.message) for w in caught))
        med = statistics.median(times[2:])
        L, d = shape["num_hidden_layers"], shape["hidden_size"]
        flops = sum(6 * n * s + 6 * L * d * s * s for s in seqs)
        rows.append([label, f"{times[0]:.2f}", f"{med * 1e3:.0f}", f"{valid / med:,.0f}",
                     f"{flops / med / PEAK:.1%}" if cuda else "n/a",
                     f"{torch.cuda.max_memory_allocated() / 2**30:.1f}" if cuda else "n/a", syncs])
        del eng, model
        if cuda:
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()
    import torch

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (--device cpu: a smoke run)", file=sys.stderr)
        return 2
    eq_head = ["model", "max |Δ logprob|", "max |Δ grad|", "≤ 1e-4"]
    eq = equivalence()
    print(text_table(eq_head, eq), flush=True)
    vq_head = ["model", "padded bf16: max |Δ logprob| vs fp32", "packed sdpa_varlen bf16: same",
               "gradient cosine", "pass"]
    vq = varlen_equivalence()
    print(text_table(vq_head, vq), flush=True)
    sp_head = ["layout", "first call s", "median ms (fwd+bwd)", "valid tokens/s", "MFU", "peak GiB",
               "host syncs in the micro-batch"]
    sp = speed(args.iters)
    print(text_table(sp_head, sp), flush=True)
    if args.out:
        v = versions(["torch", "transformers", "triton"])
        args.out.write_text("\n".join([
            "# Packed micro-batches under sdpa_varlen / sdpa_flex on one GPU", "",
            "Produced by `benchmarks/packing_gpu_check.py` (see its docstring).", "",
            f"- command: `{command_line()}`", f"- date: {utc_now()}; flowrl commit {git_revision()}",
            f"- device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU'}; " + ", ".join(f"{k} {x}" for k, x in v.items()),
            "", "## Packed = padded (fp32, TF32 off)", "", markdown_table(eq_head, eq), "",
            "## sdpa_varlen (bf16) against an fp32 padded reference", "",
            markdown_table(vq_head, vq), "",
            "## One 16k-token micro-batch, Qwen2.5-0.5B shape, bf16" if DEVICE == "cuda" else
            "## Smoke run: 4 rows, a 2-layer shape, bf16 on CPU", "", markdown_table(sp_head, sp), ""]))
        print(f"wrote {args.out}")
    return 0 if all(r[-1] == "pass" for r in eq + vq) else 1


if __name__ == "__main__":
    sys.exit(main())
