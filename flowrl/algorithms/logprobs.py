"""Per-token log-probabilities and entropy from logits, at the sampling temperature."""
from __future__ import annotations

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
