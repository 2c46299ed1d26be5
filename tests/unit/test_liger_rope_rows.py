"""``rope_over_one_row`` (flowrl/models/kernels.py): liger's RoPE kernel compiles once per batch size,
so the micro-batch's rows reach it as one row. RoPE is per (row, position), so the values must not
change: checked here with transformers' eager ``apply_rotary_pos_emb`` as the inner function (the
same elementwise ops on the same values: bitwise equal, forward and backward). The liger kernel
itself runs in tests/gpu/test_liger_gpu.py."""
from __future__ import annotations

import torch
from transformers.models.llama import modeling_llama

from flowrl.models.kernels import rope_over_one_row


def _inputs(b=3, L=7, hq=4, hk=2, d=8, cos_rows=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    # transformers' layout: projections viewed as (b, L, h, d), then transposed to (b, h, L, d)
    q = torch.randn(b, L, hq, d, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(b, L, hk, d, generator=g).transpose(1, 2).requires_grad_()
    pos = torch.stack([torch.arange(L) + 3 * i for i in range(cos_rows or b)]).float()  # per-row positions
    freqs = pos[..., None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([freqs, freqs], dim=-1)
    return q, k, emb.cos(), emb.sin()


def test_one_row_equals_rows_forward_and_backward():
    seen = []

    def inner(q, k, cos, sin):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(cos.shape)))
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)

    q, k, cos, sin = _inputs()
    q2, k2 = (t.detach().clone().requires_grad_() for t in (q, k))
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = rope_over_one_row(inner)(q2, k2, cos, sin)
    assert seen == [((1, 4, 21, 8), (1, 2, 21, 8), (1, 21, 8))]  # batch 1: one kernel variant
    assert got_q.shape == (3, 4, 7, 8) and got_k.shape == (3, 2, 7, 8)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    w = torch.randn(3, 4, 7, 8, generator=torch.Generator().manual_seed(1))
    ((want_q * w).sum() + want_k.pow(2).sum()).backward()
    ((got_q * w).sum() + got_k.pow(2).sum()).backward()
    assert torch.equal(q2.grad, q.grad) and torch.equal(k2.grad, k.grad)


def test_cos_of_one_row_is_shared_by_every_row():
    q, k, cos, sin = _inputs(cos_rows=1)
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = rope_over_one_row(modeling_llama.apply_rotary_pos_emb)(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_batch_of_one_and_other_layouts_call_inner_unchanged():
    calls = []

    def inner(*args):
        calls.append(args)
        return args[0], args[1]

    q, k, cos, sin = _inputs(b=1)
    assert rope_over_one_row(inner)(q, k, cos, sin)[0] is q
    q, k, cos, sin = _inputs(b=2)
    out = rope_over_one_row(inner)(q, k, cos, sin, 2)  # an unsqueeze_dim: not this layout
    assert out[0] is q and calls[-1][4] == 2 and len(calls) == 2
