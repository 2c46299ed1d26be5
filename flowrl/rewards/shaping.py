"""Reward shaping on tensors: DAPO soft overlong punishment and the weighted mix of components.

Pure torch; no flowrl imports (the ops in ``flowrl/ops/reward.py`` wrap these).
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_length: int, buffer_length: int,
                     penalty_factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13)::

        R_length(y) = 0                                   |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                    = -1                                  L_max < |y|

    scaled by ``penalty_factor`` (verl's ``overlong_buffer.penalty_factor``).

    Args:
        lengths: (B,) response lengths in tokens (int or float), EOS included.
        max_length: L_max, tokens.
        buffer_length: L_cache, tokens (the linear ramp's width), 1 <= L_cache <= L_max.
        penalty_factor: multiplier of the penalty (>= 0).

    Returns:
        (B,) float32 in [-penalty_factor, 0].

    Raises:
        ValueError: a bad length setting.
    """
    if buffer_length < 1 or max_length < buffer_length:
        raise ValueError(f"overlong: need 1 <= buffer_length <= max_length, got buffer_length="
                         f"{buffer_length}, max_length={max_length}")
    if penalty_factor < 0:
        raise ValueError(f"overlong: penalty_factor must be >= 0, got {penalty_factor}")
    expected = max_length - buffer_length
    over = lengths.float() - expected
    r = (-over / buffer_length).clamp(min=-1.0, max=0.0)
    return r * penalty_factor


def mix_rewards(components: Mapping[str, Tensor], weights: Mapping[str, float]) -> Tensor:
    """Weighted sum ``sum_k w_k * r_k`` of named (B,) reward components.

    A component with weight 0 is left out entirely (its NaNs too); a NaN (unscorable) in any
    component with a non-zero weight makes that sample's mixed reward NaN: an unscorable part
    means an unscorable whole, never a silent 0.

    Args:
        components: name → (B,) float rewards, NaN = unscorable; all of one length.
        weights: name → weight for every component name.

    Returns:
        (B,) float32.

    Raises:
        ValueError: no components, a length mismatch, or a component without a weight.
    """
    if not components:
        raise ValueError("mix_rewards needs at least one component")
    sizes = {k: tuple(v.shape) for k, v in components.items()}
    if len(set(sizes.values())) != 1 or len(next(iter(sizes.values()))) != 1:
        raise ValueError(f"reward components must all be (B,) of one length, got {sizes}")
    missing = sorted(set(components) - set(weights))
    if missing:
        raise ValueError(f"reward components {missing} have no weight")
    first = next(iter(components.values()))
    total = torch.zeros(first.shape, dtype=torch.float32)
    for name, r in components.items():
        w = float(weights[name])
        if w != 0.0:
            total = total + w * r.float()
    return total
