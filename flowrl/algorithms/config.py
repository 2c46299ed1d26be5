"""The algorithm knobs a user sweeps (``algorithm.kl_coef=0,0.01``); defaults live here once.

Ops read this from ``ctx.resources["algorithm"]``; graph files pick *which* estimator and loss
(``op: advantage.<estimator>``, the update stage's ``policy_loss`` param: one way each, by the
variant's registered name), this config gives their numbers. No torch import (the run config is
checked before torch loads).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from flowrl.algorithms.variants import ROLLOUT_IS

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
        adv_eps: ε in (r - mean) / (std + ε).
        ppo_epochs: passes over each rollout batch.
        mini_batch_size: sequences per optimizer step (None = the whole rollout batch).
        gamma / lam: discount and GAE λ (GAE, REINFORCE++ return-to-go).
        whiten_advantages: GAE only — batch-whiten the advantages (PPO practice).
        clip_range_value: PPO value-loss clip around the old values, None = unclipped.
        vf_coef: weight of the value loss in the critic update.
        kl_in_reward: subtract kl_coef·KL from the token rewards (True) instead of a KL loss term.
        kl_target / kl_horizon: adaptive KL controller (Ziegler et al. 2019); kl_target None = fixed.
        mask_truncated: drop truncated completions (no stop token) from the loss (DAPO overlong filter).
        recompute_old_logprobs: run the old-logprob stage (graphs whose ``old_logprobs`` stage has
            ``when: ${algorithm.recompute_old_logprobs}``). False is valid only with one optimizer
            step per rollout batch (ppo_epochs 1, no mini_batch_size): π_old is then the current
            policy and the update's own forward gives its logprobs, which saves a full forward pass
            (TRL does the same when num_iterations = 1).
        rollout_is: correction of the rollout-vs-trainer policy mismatch, a name of
            ``algorithms/variants.py`` ROLLOUT_IS: ``none`` or ``tis`` (truncated importance sampling,
            Yao et al. 2025); needs the batch's rollout_logprobs.
        rollout_is_cap: C of ``tis``: per-token weight min(π_old/π_rollout, C), C >= 1.
        distill_coef: weight of the per-token reverse-KL advantage of ``advantage.distill``
            (on-policy distillation: A_t += distill_coef · (log π_teacher − log π_student)).
        distill_clip: clip that per-token log-ratio to [−c, c] before weighting (None = off).
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
    adv_eps: float = 1e-6
    ppo_epochs: int = 1
    mini_batch_size: Optional[int] = None
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    clip_range_value: Optional[float] = 0.2
    vf_coef: float = 0.5
    kl_in_reward: bool = False
    kl_target: Optional[float] = None
    kl_horizon: int = 10000
    mask_truncated: bool = False
    recompute_old_logprobs: bool = True
    rollout_is: str = "none"
    rollout_is_cap: float = 2.0
    distill_coef: float = 1.0
    distill_clip: Optional[float] = None

    def __post_init__(self) -> None:
        if not self.recompute_old_logprobs and (self.ppo_epochs > 1 or self.mini_batch_size):
            raise ValueError("algorithm.recompute_old_logprobs=false needs one optimizer step per "
                             f"rollout batch, got ppo_epochs={self.ppo_epochs}, "
                             f"mini_batch_size={self.mini_batch_size}")
        if self.n < 1:
            raise ValueError(f"algorithm.n must be >= 1, got {self.n}")
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"algorithm.kl_type must be one of {KL_TYPES}, got {self.kl_type!r}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"algorithm.loss_agg_mode must be one of {LOSS_AGG_MODES}, "
                             f"got {self.loss_agg_mode!r}")
        # the ratio is clipped to [1 - low, 1 + high]: low >= 1 leaves no lower bound at all
        if not 0 <= self.clip_ratio_low < 1:
            raise ValueError(f"algorithm.clip_ratio_low must be in [0, 1) (the ratio's lower clip "
                             f"is 1 - clip_ratio_low), got {self.clip_ratio_low}")
        if not 0 <= self.clip_ratio_high < 10:
            raise ValueError(f"algorithm.clip_ratio_high must be in [0, 10), got {self.clip_ratio_high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError(f"algorithm.clip_ratio_c must be > 1 (dual-clip), got {self.clip_ratio_c}")
        if self.ppo_epochs < 1:
            raise ValueError(f"algorithm.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ValueError(f"algorithm.mini_batch_size must be >= 1, got {self.mini_batch_size}")
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"algorithm.{name} must be in [0, 1], got {v}")
        if self.clip_range_value is not None and self.clip_range_value <= 0:
            raise ValueError(f"algorithm.clip_range_value must be > 0 or None, got {self.clip_range_value}")
        if self.vf_coef < 0:
            raise ValueError(f"algorithm.vf_coef must be >= 0, got {self.vf_coef}")
        if self.kl_target is not None and self.kl_target <= 0:
            raise ValueError(f"algorithm.kl_target must be > 0 or None, got {self.kl_target}")
        if self.kl_horizon < 1:
            raise ValueError(f"algorithm.kl_horizon must be >= 1, got {self.kl_horizon}")
        if self.rollout_is not in ROLLOUT_IS:
            raise ValueError(f"algorithm.rollout_is must be one of {sorted(ROLLOUT_IS)}, "
                             f"got {self.rollout_is!r}")
        if self.rollout_is_cap < 1:
            raise ValueError(f"algorithm.rollout_is_cap must be >= 1, got {self.rollout_is_cap}")
        if self.kl_clamp <= 0:
            raise ValueError(f"algorithm.kl_clamp must be > 0, got {self.kl_clamp}")
        if self.distill_coef < 0:
            raise ValueError(f"algorithm.distill_coef must be >= 0, got {self.distill_coef}")
        if self.distill_clip is not None and self.distill_clip <= 0:
            raise ValueError(f"algorithm.distill_clip must be > 0 or null, got {self.distill_clip}")
