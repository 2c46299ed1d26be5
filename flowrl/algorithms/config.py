"""The algorithm knobs a user sweeps (``algorithm.kl_coef=0,0.01``); defaults live here once.

Ops read this from ``ctx.resources["algorithm"]``; graph files pick *which* estimator and loss
(one op per variant), this config gives their numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "k3")


@dataclass
class AlgorithmConfig:
    """Attributes:
        n: samples per prompt (group size). Group-baseline estimators need n >= 2.
        kl_coef: weight of the KL-to-reference loss term; 0 disables the ref stage.
        kl_type: KL estimator, one of k1, k2, k3 (Schulman 2020 "Approximating KL divergence").
        kl_clamp: |Δ| clamp applied *before* exp in k3 (case C05).
        clip_ratio_low / clip_ratio_high: PPO ε below / above 1 (DAPO clip-higher when they differ).
        clip_ratio_c: dual-clip constant c > 1 for negative advantages (Ye et al. 2020), None = off.
        loss_agg_mode: how per-token losses are reduced (see algorithms/losses.py).
        entropy_coef: weight of the entropy bonus (0 = metric only).
        norm_adv_by_std: GRPO divides by the group std (False = Dr.GRPO-style centring only).
        adv_eps: ε in (r - mean) / (std + ε).
        ppo_epochs: passes over each rollout batch.
        mini_batch_size: sequences per optimizer step (None = the whole rollout batch).
    """

    n: int = 4
    kl_coef: float = 0.0
    kl_type: str = "k3"
    kl_clamp: float = 10.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = None
    loss_agg_mode: str = "token-mean"
    entropy_coef: float = 0.0
    norm_adv_by_std: bool = True
    adv_eps: float = 1e-6
    ppo_epochs: int = 1
    mini_batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"algorithm.n must be >= 1, got {self.n}")
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"algorithm.kl_type must be one of {KL_TYPES}, got {self.kl_type!r}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"algorithm.loss_agg_mode must be one of {LOSS_AGG_MODES}, "
                             f"got {self.loss_agg_mode!r}")
        for name in ("clip_ratio_low", "clip_ratio_high"):
            v = getattr(self, name)
            if not 0 <= v < 10:
                raise ValueError(f"algorithm.{name} must be in [0, 10), got {v}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError(f"algorithm.clip_ratio_c must be > 1 (dual-clip), got {self.clip_ratio_c}")
        if self.ppo_epochs < 1:
            raise ValueError(f"algorithm.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ValueError(f"algorithm.mini_batch_size must be >= 1, got {self.mini_batch_size}")
