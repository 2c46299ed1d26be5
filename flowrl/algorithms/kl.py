"""KL(π_θ ‖ π_ref) per-token estimators and KL-coefficient controllers.

Estimators follow Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html),
with Δ = ref_logp − logp (log of the ratio π_ref/π_θ, samples drawn from π_θ):

    k1 = −Δ                 unbiased, high variance, can be negative
    k2 = ½ Δ²               biased, low variance
    k3 = exp(Δ) − Δ − 1     unbiased, low variance, ≥ 0 ("low_var_kl")

k3 overflows for large Δ: it is computed with Δ clamped to ±clamp *before* exp and its value clamped
at ``clamp`` (case C05), so the gradient is finite (0 in the saturated region).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

KLFn = Callable[[Tensor, Optional[float]], Tensor]
KL_ESTIMATORS: dict[str, KLFn] = {}


def register_kl(name: str):
    """Decorator: register ``fn(delta, clamp) -> (B, R)`` under ``name`` in :data:`KL_ESTIMATORS`."""
    def deco(fn: KLFn) -> KLFn:
        if name in KL_ESTIMATORS:
            raise ValueError(f"KL estimator {name!r} registered twice")
        KL_ESTIMATORS[name] = fn
        return fn
    return deco


@register_kl("k1")
def k1(delta: Tensor, clamp: Optional[float]) -> Tensor:
    """k1 = −Δ = logp − ref_logp (Schulman 2020). ``clamp`` is ignored (no overflow possible)."""
    return -delta


@register_kl("k2")
def k2(delta: Tensor, clamp: Optional[float]) -> Tensor:
    """k2 = ½ Δ² (Schulman 2020). ``clamp`` is ignored."""
    return 0.5 * delta.square()


@register_kl("k3")
def k3(delta: Tensor, clamp: Optional[float]) -> Tensor:
    """k3 = exp(Δ) − Δ − 1 (Schulman 2020), with Δ ∈ [−clamp, clamp] before exp and value ≤ clamp.

    Case C05: Δ = 100 → 10 with gradient 0; Δ = 1 → e − 2 = 0.718282 with the unclamped gradient.
    ``clamp=None`` disables both clamps.
    """
    if clamp is None:
        return torch.expm1(delta) - delta
    d = delta.clamp(-clamp, clamp)
    return (torch.expm1(d) - d).clamp(max=clamp)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kl_type: str, clamp: Optional[float], *,
               response_mask: Optional[Tensor] = None) -> Tensor:
    """Per-token KL estimate of π_θ against π_ref.

    Args:
        logprobs: (B, R) float (may require grad); ref_logprobs: (B, R) float.
        kl_type: key of :data:`KL_ESTIMATORS` ("k1", "k2", "k3"); clamp: see :func:`k3`. No
            defaults here: both are the run's (``AlgorithmConfig.kl_type`` / ``kl_clamp``), the
            one home of the estimator's default.
        response_mask: optional (B, R) bool; if given, Δ is set to 0 at masked positions *before* the
            estimator so NaN/inf garbage there yields value 0 and gradient 0 (not NaN).
    Returns:
        (B, R) float32 (0 at masked positions when ``response_mask`` is given).
    Raises:
        ValueError: unknown ``kind``.
    """
    if kl_type not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kl_type!r}; known: {sorted(KL_ESTIMATORS)}")
    delta = ref_logprobs.float() - logprobs.float()
    if response_mask is not None:
        delta = torch.where(response_mask.bool(), delta, 0.0)
    return KL_ESTIMATORS[kl_type](delta, clamp)


def apply_kl_penalty(token_rewards: Tensor, logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor,
                     kl_coef: float, kl_type: str, clamp: Optional[float]) -> tuple[Tensor, Tensor]:
    """In-reward KL penalty (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022, eq. 2): r_t − β·KL_t.

    Args:
        token_rewards: (B, R) float32; logprobs / ref_logprobs: (B, R) float (detached: rewards carry
            no gradient); response_mask: (B, R) bool; kl_coef: β ≥ 0; kl_type, clamp: as
            :func:`kl_penalty` (the run's ``algorithm.kl_type`` / ``kl_clamp``).
    Returns:
        (new token_rewards (B, R) float32, kl (B, R) float32), both 0 at masked positions. The mean
        of ``kl`` over valid tokens is what a KL controller is updated with.
    Raises:
        ValueError: unknown ``kl_type`` or negative ``kl_coef``.
    """
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    mask = response_mask.bool()
    kl = kl_penalty(logprobs.detach(), ref_logprobs.detach(), kl_type, clamp, response_mask=mask)
    out = torch.where(mask, token_rewards.float() - kl_coef * kl, 0.0)
    return out, torch.where(mask, kl, 0.0)


class FixedKLController:
    """Constant KL coefficient β. ``update`` is a no-op (Ziegler et al. 2019, fixed-β baseline)."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"algorithm.kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, Any]:
        """``{"kl_coef": β}`` (JSON-able; checkpointed by the job through the op registry)."""
        return {"kl_coef": float(self.value)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. Raises KeyError when ``kl_coef`` is missing."""
        self.value = float(state["kl_coef"])


class AdaptiveKLController:
    """Adaptive β (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences", §2.2 eq. 3):

        e_t = clip(KL_t / KL_target − 1, −0.2, 0.2),   β_{t+1} = β_t (1 + K_β e_t),  K_β = n_steps / horizon.

    ``update(current_kl, n_steps)`` takes the measured mean KL and the number of samples since the last
    update; returns the new β. Raises ValueError for non-positive target/horizon or negative β.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if init_kl_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs kl_coef >= 0, target > 0, horizon > 0; got "
                             f"{init_kl_coef}, {target}, {horizon}")
        self.value, self.target, self.horizon = float(init_kl_coef), float(target), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, Any]:
        """``{"kl_coef": β}``: the adapted coefficient; target and horizon are config."""
        return {"kl_coef": float(self.value)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. Raises KeyError when ``kl_coef`` is missing."""
        self.value = float(state["kl_coef"])


def kl_controller(kl_coef: float, target: Optional[float] = None, horizon: int = 10000):
    """Adaptive controller when ``target`` is set, fixed otherwise (``algorithm.kl_target``)."""
    return FixedKLController(kl_coef) if target is None else AdaptiveKLController(kl_coef, target, horizon)
