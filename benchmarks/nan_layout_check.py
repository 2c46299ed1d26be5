"""Issue 25's NaN gradient norm: does an attention query that attends to nothing (a left-padded
row's leading pads) give a NaN gradient on the GPU, and does the train engine's left-aligned
layout avoid it?

The GPU run of the default job (SmolLM2-135M, bf16 compute under FSDP2) hit "non-finite grad norm
(nan)" at step 6. The suspected cause: in the old padded layout every row was
``[left pads | prompt | response | right pads]``; under a causal mask a leading pad query sees only
pads, so its attention row is empty; some SDPA backends return NaN for such rows in the forward
and, though the loss never reads those positions, their backward can still write NaN into dK/dV
of real positions. The engine now left-aligns the rows (``flowrl.algorithms.masks.left_align``:
pads only at the row's end, so every query attends to at least itself).

Two checks, each over several sequence lengths L (the report's hypothesis named L = 64 mod 128)
and seeds:

1. ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with a boolean mask per backend
   (cuDNN, memory-efficient, math; flash takes no mask), bf16, SmolLM2's head shape (9 heads,
   head dim 64): rows with leading empty queries ("left-padded") vs the same rows left-aligned.
   A case is NaN when any gradient of q/k/v, or the loss over the valid queries, is not finite.
2. ``model``: a random Llama of SmolLM2-135M's layer shape (4 layers), bf16, ``sdpa`` attention,
   the sum of response-token logprobs backward, in the old left-padded layout (attention mask
   with leading zeros) and in the engine's layout (``LocalTrainEngine`` logprobs + backward path
   through ``_response_logits``).

    python benchmarks/nan_layout_check.py --md-out benchmarks/results/nan_layout_h200.md   # GPU, ~1 min
    python benchmarks/nan_layout_check.py --device cpu --lengths 64 --seeds 1               # CPU smoke

Prints a table; writes the markdown report with the command, commit, machine and date.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    command_line,
    git_revision,
    machine_info,
    markdown_table,
    text_table,
    utc_now,
    versions,
)

HEADS, HEAD_DIM = 9, 64  # SmolLM2-135M


def _pads(B: int, L: int, seed: int) -> torch.Tensor:
    """(B,) leading pad counts: half the rows padded by 1..L/2 tokens, the rest by none."""
    g = torch.Generator().manual_seed(seed)
    pads = torch.randint(1, max(2, L // 2), (B,), generator=g)
    pads[B // 2:] = 0
    return pads


def sdpa_case(backend: str, L: int, seed: int, device: str, aligned: bool) -> bool:
    """True when the case produced a non-finite loss or gradient."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B = 8
    pads = _pads(B, L, seed)
    pos = torch.arange(L)
    # valid keys: left-padded = positions >= pad; left-aligned = positions < L - pad
    valid = pos[None, :] < (L - pads)[:, None] if aligned else pos[None, :] >= pads[:, None]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    mask = (causal[None] & valid[:, None, :]).to(device)  # (B, L, L)
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(B, HEADS, L, HEAD_DIM, device=device, dtype=torch.bfloat16,
                           generator=g).requires_grad_() for _ in range(3))
    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}[backend]
    with sdpa_kernel([kind]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    qv = valid.to(device)[:, None, :, None]
    loss = torch.where(qv, out, torch.zeros_like(out)).float().sum()
    loss.backward()
    grads = [t.grad for t in (q, k, v)]
    return not (torch.isfinite(loss) and all(gr is not None and torch.isfinite(gr).all() for gr in grads))


def model_case(L: int, seed: int, device: str, aligned: bool, layers: int = 4,
               vocab: int = 49152) -> bool:
    """A random SmolLM2-shaped Llama (``layers`` layers), bf16 sdpa: True when a gradient is not
    finite."""
    import transformers

    from flowrl.engines.config import TrainEngineConfig
    from flowrl.engines.train.local import LocalTrainEngine

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=vocab,
                                   max_position_embeddings=2048, tie_word_embeddings=True,
                                   attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    B, P = 8, L // 2
    R = L - P
    pads = _pads(B, P, seed)
    g = torch.Generator().manual_seed(seed)
    p_ids = torch.randint(3, vocab, (B, P), generator=g)
    p_mask = torch.arange(P)[None, :] >= pads[:, None]
    r_ids = torch.randint(3, vocab, (B, R), generator=g)
    r_len = torch.randint(1, R + 1, (B,), generator=g)
    r_mask = torch.arange(R)[None, :] < r_len[:, None]
    if aligned:  # the train engine's own layout and gather (flowrl.engines.train.local)
        eng = LocalTrainEngine(model, TrainEngineConfig(micro_batch_size=B, logprob_chunk_size=None,
                                                        padding_free="false"), trainable=True)
        mb = dict(prompt_ids=p_ids, prompt_mask=p_mask, response_ids=r_ids, response_mask=r_mask)
        logits, _ = eng._response_logits(mb)
    else:  # the old layout: [left pads | prompt | response | right pads], positions from the mask
        ids = torch.cat([p_ids, r_ids], 1).to(device)
        attn = torch.cat([p_mask, r_mask], 1).to(device)
        position_ids = (attn.long().cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn.long(), position_ids=position_ids).logits
        logits = logits[:, P - 1:P + R - 1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, r_ids.to(device)[..., None]).squeeze(-1)
    loss = torch.where(r_mask.to(device), lp, torch.zeros_like(lp)).sum()
    loss.backward()
    bad = not torch.isfinite(loss) or any(p.grad is not None and not torch.isfinite(p.grad).all()
                                          for p in model.parameters())
    return bool(bad)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", default="64,128,192,256,320,448",
                    help="comma list of sequence lengths L")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4, help="layers of the model check")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary of the model check")
    ap.add_argument("--md-out", type=Path)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    backends = ["cudnn", "efficient", "math"] if args.device == "cuda" else ["math"]
    rows = []
    for check in [*(f"sdpa {b}" for b in backends), "model sdpa"]:
        for layout in ("left-padded", "left-aligned"):
            counts = []
            for L in lengths:
                nan = err = 0
                for seed in range(args.seeds):
                    try:
                        if check == "model sdpa":
                            nan += model_case(L, seed, args.device, layout == "left-aligned",
                                              args.layers, args.vocab)
                        else:
                            nan += sdpa_case(check.split()[1], L, seed, args.device,
                                             layout == "left-aligned")
                    except RuntimeError as e:  # a backend that refuses the inputs
                        err += 1
                        last = str(e).splitlines()[0][:80]
                counts.append(f"{nan}/{args.seeds}" + (f" ({err} refused: {last})" if err else ""))
            rows.append([check, layout, *counts])
            print(check, layout, counts, flush=True)
    headers = ["check", "layout", *(f"L={L} NaN" for L in lengths)]
    print(text_table(headers, rows))
    if args.md_out:
        v = versions(["torch", "transformers"])
        m = machine_info()
        gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none"
        text = "\n".join([
            "# Issue 25's NaN: empty attention rows (left-padded) vs the engine's left-aligned rows",
            "",
            f"- command: `{command_line()}`",
            f"- date: {utc_now()}; flowrl commit {git_revision()}",
            f"- machine: {gpu}; {m.get('cpu', '?')}; torch {v.get('torch')}, transformers {v.get('transformers')}",
            f"- cudnn: {torch.backends.cudnn.version() if args.device == 'cuda' else '-'}",
            "",
            "Each cell: cases with a non-finite loss or gradient / cases run (seeds). What the checks"
            " are: the script's docstring.",
            "",
            markdown_table(headers, rows), ""])
        args.md_out.parent.mkdir(parents=True, exist_ok=True)
        args.md_out.write_text(text)
        print(f"wrote {args.md_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
