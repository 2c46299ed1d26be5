"""Per-token log-probabilities and entropy at the sampling temperature: from logits, or fused with
the LM head over chunks of tokens so the (tokens, V) fp32 logits never exist at once."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T)[label] per position.

    Args:
        logits: (B, R, V) any float dtype; the logits that *predict* ``labels`` (already shifted:
            position t holds the model output at input position t-1).
        labels: (B, R) int64.
        temperature: sampling temperature T > 0 (T = 0, greedy, is scored at T = 1).

    Returns:
        (B, R) float32. Computed in fp32 (case C08: the trainer's recomputed logprob must equal the
        sampler's, which used the same temperature).
    """
    t = temperature if temperature > 0 else 1.0
    x = logits.float() / t
    # logsumexp form avoids materialising a second (B, R, V) tensor for log_softmax
    picked = torch.gather(x, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy (nats) of softmax(logits / T) per position. logits (B, R, V) → (B, R) float32."""
    t = temperature if temperature > 0 else 1.0
    x = logits.float() / t
    logp = torch.log_softmax(x, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _matmul_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in: autocast's when it is on (what the model's
    own LM head would use under autocast), else the promoted input dtype."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _scaled_logits(h: Tensor, w: Tensor, b: Optional[Tensor], t: float) -> Tensor:
    """fp32 (c, V) logits / T of one chunk (the matmul in the weights' dtype, as the LM head)."""
    logits = h @ w.t() if b is None else torch.addmm(b, h, w.t())
    return logits.float().div_(t)


class _LinearLogprobs(torch.autograd.Function):
    """Chunked LM head + fp32 log-softmax: forward keeps only (N,) outputs, backward recomputes each
    chunk's logits (activation recomputation, as liger-kernel's fused linear cross-entropy does)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, t, chunk, with_entropy, entropy_grad):
        dtype = _matmul_dtype(hidden, weight)
        h, w = hidden.to(dtype), weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        n = h.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=h.device)
        ent = torch.empty(n, dtype=torch.float32, device=h.device) if with_entropy else None
        for s in range(0, n, chunk):
            x = _scaled_logits(h[s:s + chunk], w, b, t)
            lse = torch.logsumexp(x, dim=-1)
            lp[s:s + chunk] = x.gather(-1, labels[s:s + chunk, None]).squeeze(-1) - lse
            if ent is not None:
                logp = x.sub_(lse[:, None])
                ent[s:s + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.t, ctx.chunk, ctx.dtype = t, chunk, dtype
        ctx.set_materialize_grads(False)  # an unused entropy gives None, not a (N,) zero tensor
        if ent is not None and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, labels = ctx.saved_tensors
        t, chunk, dtype = ctx.t, ctx.chunk, ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        h, w = hidden.to(dtype), weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        n = h.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        # per-chunk products summed in fp32 (one rounding to the weight dtype at the end, as a
        # single (N, V)^T @ (N, H) matmul would)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b \
            else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logp = torch.log_softmax(_scaled_logits(h[s:e], w, b, t), dim=-1)
            p = logp.exp()
            # x = logits / T:  d logp[y] / dx = onehot(y) - p ;  d H / dx = -p * (logp + H), so
            # dL/dx = -p * (g_lp + g_ent * (logp + H)) + onehot(y) * g_lp  (in place: 2 (c, V) fp32)
            gl = g_lp[s:e, None] if g_lp is not None else None
            if g_ent is not None:
                ent = -(p * logp).sum(-1, keepdim=True)
                coef = logp.add_(ent).mul_(g_ent[s:e, None])
                if gl is not None:
                    coef.add_(gl)
            else:
                coef = gl
            gx = p.mul_(coef).neg_()
            if gl is not None:
                gx.scatter_add_(-1, labels[s:e, None], gl)
            g_logits = gx.div_(t).to(dtype)
            if need_h:
                grad_h[s:e] = (g_logits @ w).to(hidden.dtype)
            if need_w:
                if dtype == torch.float32:
                    grad_w.addmm_(g_logits.t(), h[s:e])
                else:
                    grad_w += (g_logits.t() @ h[s:e]).float()
            if need_b:
                grad_b += g_logits.float().sum(0)
        return (grad_h, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None, None)


def linear_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0,
                    bias: Optional[Tensor] = None, chunk_size: int = 1024,
                    with_entropy: bool = False, entropy_grad: bool = True,
                    ) -> tuple[Tensor, Optional[Tensor]]:
    """``token_logprobs`` / ``entropy_from_logits`` of ``hidden @ weight.T + bias`` without the
    (N, V) logits: the LM head and the fp32 log-softmax run over ``chunk_size`` tokens at a time, in
    forward and again (recomputed) in backward, so peak extra memory is a few (chunk_size, V) fp32
    buffers plus one (V, H) fp32 weight-gradient accumulator, whatever N is.

    Args:
        hidden: (N, H) final hidden states (after the last norm) of the positions that predict
            ``labels``; any float dtype, differentiable.
        weight: (V, H) LM-head (output-embedding) weight; bias: (V,) or None.
        labels: (N,) int64 token ids.
        temperature: T > 0 divides the logits; T = 0 (greedy) is scored at T = 1 (case C08).
        chunk_size: tokens per chunk (>= 1).
        with_entropy: also return the entropy (nats) of softmax(logits / T).
        entropy_grad: False = the entropy is a metric: no gradient flows through it.

    Returns:
        ``(logprobs, entropy)``: (N,) float32 each (entropy None unless ``with_entropy``), on
        ``hidden``'s device. The logits are computed in the dtype ``F.linear`` would use (autocast's
        when enabled), then upcast to fp32 like :func:`token_logprobs`.

    Raises:
        ValueError: ``chunk_size < 1`` or mismatched shapes.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] \
            or labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden (N, H), weight (V, H), labels (N,); got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    t = temperature if temperature > 0 else 1.0
    return _LinearLogprobs.apply(hidden, weight, bias, labels, float(t), int(chunk_size),
                                 bool(with_entropy), bool(entropy_grad))
