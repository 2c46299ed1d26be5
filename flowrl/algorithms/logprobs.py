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
    # a -inf logit (a vocabulary mask, top-k/top-p filtering) has p = 0: its term is 0, not
    # 0·(−inf); the where() is on the factor, so the backward sees no −inf either
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(-1)


def _matmul_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in: autocast's when it is on (what the model's
    own LM head would use under autocast), else the promoted input dtype."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _head(h: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    """(c, V) logits of one chunk, in the weights' dtype (as the LM head computes them)."""
    return h @ w.t() if b is None else torch.addmm(b, h, w.t())


def _chunk_logprobs(logits: Tensor, labels: Tensor, t: float,
                    with_entropy: bool) -> tuple[Tensor, Optional[Tensor]]:
    """fp32 logprob of ``labels`` and entropy of one (c, V) chunk: :func:`token_logprobs` and
    :func:`entropy_from_logits` (same fp32 math), sharing one upcast."""
    x = logits.float().div_(t)
    lse = torch.logsumexp(x, dim=-1)
    lp = x.gather(-1, labels[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return lp, None
    logp = x.sub_(lse[:, None])
    p = logp.exp()
    return lp, -(p * torch.where(p > 0, logp, 0.0)).sum(-1)  # p = 0 (a -inf logit) → 0


def _chunk_grad_logits(logits: Tensor, labels: Tensor, t: float, g_lp: Optional[Tensor],
                       g_ent: Optional[Tensor]) -> Tensor:
    """d loss / d logits of one chunk (fp32, (c, V)) from the gradients of its logprobs/entropy.

    With x = logits / T: d logp[y]/dx = onehot(y) - p and dH/dx = -p * (logp + H), so
    dL/dx = -p * (g_lp + g_ent * (logp + H)) + onehot(y) * g_lp; in place (2 (c, V) fp32 buffers).
    """
    logp = torch.log_softmax(logits.float().div_(t), dim=-1)
    p = logp.exp()
    gl = g_lp[:, None] if g_lp is not None else None
    if g_ent is not None:
        # p = 0 (a -inf logit) contributes 0 to the entropy and its gradient, not 0·(−inf)
        logp = torch.where(p > 0, logp, 0.0)
        ent = -(p * logp).sum(-1, keepdim=True)
        coef = logp.add_(ent).mul_(g_ent[:, None])
        if gl is not None:
            coef.add_(gl)
    elif gl is not None:
        coef = gl
    else:  # autograd calls backward only when an output has a gradient
        raise ValueError("_chunk_grad_logits needs the gradient of the logprobs or the entropy")
    gx = p.mul_(coef).neg_()
    if gl is not None:
        gx.scatter_add_(-1, labels[:, None], gl)
    return gx.div_(t)


_COMPILED: dict[str, object] = {}


def _chunk_fns(compile: bool):
    """The per-chunk math, eager or ``torch.compile``d (Inductor fuses the upcast, scaling and
    reductions into a few kernels that read the (c, V) logits instead of ~10 fp32 passes)."""
    if not compile:
        return _chunk_logprobs, _chunk_grad_logits
    if not _COMPILED:
        _COMPILED["fwd"] = torch.compile(_chunk_logprobs, dynamic=True)
        _COMPILED["bwd"] = torch.compile(_chunk_grad_logits, dynamic=True)
    return _COMPILED["fwd"], _COMPILED["bwd"]


class _LinearLogprobs(torch.autograd.Function):
    """Chunked LM head + fp32 log-softmax: forward keeps only (N,) outputs, backward recomputes each
    chunk's logits (activation recomputation, as liger-kernel's fused linear cross-entropy does)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, t, chunk, with_entropy, entropy_grad, compile):
        dtype = _matmul_dtype(hidden, weight)
        h, w = hidden.to(dtype), weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        chunk_lp, _ = _chunk_fns(compile)
        n = h.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=h.device)
        ent = torch.empty(n, dtype=torch.float32, device=h.device) if with_entropy else None
        for s in range(0, n, chunk):
            lp_c, ent_c = chunk_lp(_head(h[s:s + chunk], w, b), labels[s:s + chunk], t, with_entropy)
            lp[s:s + chunk] = lp_c
            if ent is not None:
                ent[s:s + chunk] = ent_c
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.t, ctx.chunk, ctx.dtype, ctx.compile = t, chunk, dtype, compile
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
        _, chunk_grad = _chunk_fns(ctx.compile)
        n = h.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        # per-chunk products summed in fp32 (one rounding to the weight dtype at the end, as a
        # single (N, V)^T @ (N, H) matmul would)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b \
            else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            g_logits = chunk_grad(_head(h[s:e], w, b), labels[s:e], t,
                                  g_lp[s:e] if g_lp is not None else None,
                                  g_ent[s:e] if g_ent is not None else None).to(dtype)
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
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None, None, None)


def linear_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0,
                    bias: Optional[Tensor] = None, chunk_size: int = 1024,
                    with_entropy: bool = False, entropy_grad: bool = True,
                    compile: bool = False) -> tuple[Tensor, Optional[Tensor]]:
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
        compile: run the per-chunk softmax math through ``torch.compile`` (the matmuls stay
            cuBLAS/MKL); same math, fewer memory passes. Compiles on the first call.

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
                                 bool(with_entropy), bool(entropy_grad), bool(compile))
