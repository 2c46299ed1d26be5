"""Policy losses, value loss, entropy bonus and loss aggregation.

Policy-loss registry calling convention (what ``ops/update.py`` does)::

    per_token_loss, stats = POLICY_LOSSES[policy_loss](    # the update stage's policy_loss param
        logprobs, old_logprobs, advantages, response_mask,
        clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c)
    loss = aggregate_loss(per_token_loss, response_mask, cfg.loss_agg_mode,
                          num_tokens=global_tokens, num_seqs=global_seqs, max_response_len=R_max)

``per_token_loss`` is (B, R) float32, exactly 0 at masked positions; ``stats`` maps names to (B, R)
float32 tensors (0 at masked positions) that the caller aggregates with the same mask. Everything
that involves a ratio is computed through ``torch.where(response_mask, ·, 0)`` *before* ``exp``, so
NaN/inf garbage at masked positions reaches neither the loss nor the gradient.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from flowrl.algorithms.variants import POLICY_LOSSES as POLICY_LOSS_NAMES
from flowrl.algorithms.variants import ROLLOUT_IS as ROLLOUT_IS_NAMES
from flowrl.algorithms.variants import SFT_LOSSES as SFT_LOSS_NAMES

LOG_RATIO_CLAMP = 20.0  # |log r| beyond 20 (r > 4.8e8) only happens on garbage; keeps exp finite

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
AggFn = Callable[[Tensor, Tensor, float, float, Optional[int]], Tensor]
LOSS_AGGREGATIONS: dict[str, AggFn] = {}


def _register(table: dict, name: str):
    def deco(fn):
        if name in table:
            raise ValueError(f"{name!r} registered twice")
        table[name] = fn
        return fn
    return deco


def register_policy_loss(name: str):
    """Decorator: register ``fn(logprobs, old_logprobs, advantages, response_mask, *, clip_ratio_low,
    clip_ratio_high, clip_ratio_c=None) -> (per_token_loss, stats)`` in :data:`POLICY_LOSSES`.

    Raises:
        ValueError: ``name`` is not declared in ``algorithms/variants.py`` (POLICY_LOSSES), where a
            graph's ``policy_loss`` param is checked without torch.
    """
    if name not in POLICY_LOSS_NAMES:
        raise ValueError(f"policy loss {name!r} is not declared in flowrl/algorithms/variants.py")
    return _register(POLICY_LOSSES, name)


def register_aggregation(name: str):
    """Decorator: register ``fn(masked_loss, mask, num_tokens, num_seqs, max_response_len)`` in LOSS_AGGREGATIONS."""
    return _register(LOSS_AGGREGATIONS, name)


def masked_log_ratio(logprobs: Tensor, old_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """log(π_θ/π_old) at valid positions, 0 (ratio 1, zero gradient) at masked ones; (B, R) float32,
    clamped to ±LOG_RATIO_CLAMP."""
    lr = torch.where(response_mask.bool(), logprobs.float() - old_logprobs.float(), 0.0)
    return lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _clipped_objective(ratio: Tensor, adv: Tensor, mask: Tensor, low: float, high: float,
                       c: Optional[float]) -> tuple[Tensor, dict[str, Tensor]]:
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual = torch.zeros_like(clipped)
    if c is not None:
        pg3 = -adv * c
        dual = (adv < 0) & (pg3 < loss)
        loss = torch.where(adv < 0, torch.minimum(loss, pg3), loss)
    z = lambda t: torch.where(mask, t.float(), 0.0)  # noqa: E731
    return z(loss), {"ratio": z(ratio.detach()), "clipfrac": z(clipped), "dual_clipfrac": z(dual)}


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
                  clip_ratio_low: float, clip_ratio_high: float,
                  clip_ratio_c: Optional[float] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, per token (Schulman et al. 2017, eq. 7), as a loss to minimise:

        L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)),  r = exp(logp − old_logp)

    with decoupled ε_low/ε_high ("clip-higher", DAPO, Yu et al. 2025, eq. 8) and, if ``clip_ratio_c``
    is set, dual-clip for A < 0 only: L = min(L, −A·c) (Ye et al. 2020, "Mastering Complex Control in
    MOBA Games", eq. 5). Case C07: (r=10, A=−1, c=3) → 3 with zero gradient; (0.1, +1) → −0.1.

    Args:
        logprobs: (B, R) float (requires grad); old_logprobs, advantages: (B, R) float;
        response_mask: (B, R) bool. Values at masked positions may be NaN/inf: they are never used.
    Returns:
        (per_token_loss (B, R) float32, 0 at masked; stats {"ratio", "clipfrac", "dual_clipfrac",
        "approx_kl" (k1 of π_old‖π_θ)} each (B, R) float32, 0 at masked).
    Raises:
        ValueError: clip_ratio_c given and <= 1.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"algorithm.clip_ratio_c must be > 1 (dual-clip), got {clip_ratio_c}")
    mask = response_mask.bool()
    log_ratio = masked_log_ratio(logprobs, old_logprobs, mask)
    adv = torch.where(mask, advantages.float(), 0.0)
    loss, stats = _clipped_objective(log_ratio.exp(), adv, mask, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    stats["approx_kl"] = (-log_ratio).detach()
    return loss, stats


@register_policy_loss("gspo")
def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
              clip_ratio_low: float, clip_ratio_high: float,
              clip_ratio_c: Optional[float] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token (Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5–7 and 13–14).

    Sequence ratio s_i = exp(mean over valid tokens of log r_{i,t}); per-token
    s_{i,t} = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)] (same value as s_i, per-token gradient);
    L_{i,t} = max(−A·s_{i,t}, −A·clip(s_{i,t}, 1 − ε_low, 1 + ε_high)). Aggregate with
    ``seq-mean-token-mean`` for the paper's objective. The paper's ε are ~3e-4 / 4e-4.

    Shapes/returns as :func:`ppo_clip_loss` (stats: "ratio" = s_{i,t}, "clipfrac", "dual_clipfrac"=0).
    Raises ValueError if ``clip_ratio_c`` is set (dual-clip is not defined for GSPO).
    """
    if clip_ratio_c is not None:
        raise ValueError("algorithm.clip_ratio_c (dual-clip) is not supported by policy_loss 'gspo'")
    mask = response_mask.bool()
    lr = masked_log_ratio(logprobs, old_logprobs, mask)
    seq_lr = lr.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    lp = torch.where(mask, logprobs.float(), 0.0)
    log_s = seq_lr.detach() + lp - lp.detach()
    adv = torch.where(mask, advantages.float(), 0.0)
    return _clipped_objective(log_s.exp(), adv, mask, clip_ratio_low, clip_ratio_high, None)


@register_policy_loss("vanilla")
def vanilla_pg_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
                    clip_ratio_low: float = 0.0, clip_ratio_high: float = 0.0,
                    clip_ratio_c: Optional[float] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Unclipped importance-weighted policy gradient −A·r (Williams 1992, REINFORCE; on-policy r ≡ 1,
    gradient −A∇logπ). The clip arguments are accepted for the uniform convention and ignored.
    Shapes/returns as :func:`ppo_clip_loss`."""
    mask = response_mask.bool()
    ratio = masked_log_ratio(logprobs, old_logprobs, mask).exp()
    adv = torch.where(mask, advantages.float(), 0.0)
    zero = torch.zeros_like(adv)
    return torch.where(mask, -adv * ratio, 0.0), {"ratio": torch.where(mask, ratio.detach(), 0.0),
                                                 "clipfrac": zero, "dual_clipfrac": zero}


# ----------------------------------------------------------------------------- SFT losses
SFTLossFn = Callable[[Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]
SFT_LOSSES: dict[str, SFTLossFn] = {}


def register_sft_loss(name: str):
    """Decorator: register ``fn(logprobs, response_mask) -> (per_token_loss, stats)`` in
    :data:`SFT_LOSSES` (``update.sft``'s ``loss`` param). Same conventions as a policy loss:
    (B, R) float32, exactly 0 at masked positions, aggregated by ``aggregate_loss``.

    Raises:
        ValueError: ``name`` is not declared in ``algorithms/variants.py`` (SFT_LOSSES).
    """
    if name not in SFT_LOSS_NAMES:
        raise ValueError(f"SFT loss {name!r} is not declared in flowrl/algorithms/variants.py")
    return _register(SFT_LOSSES, name)


@register_sft_loss("nll")
def nll_loss(logprobs: Tensor, response_mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the given tokens (supervised fine-tuning; here on a teacher's
    samples, ``graphs/sft_teacher.yaml``): L_t = −log π_θ(y_t) at valid positions. Aggregated
    with ``algorithm.loss_agg_mode`` like every loss (``token-mean``: the mean NLL per token).

    Args:
        logprobs: (B, R) float, log π_θ of the tokens (requires grad); response_mask: (B, R) bool.
            Masked positions may hold NaN/inf: they reach neither the loss nor the gradient.
    Returns:
        (per_token_loss (B, R) float32, 0 at masked; stats {"nll"}: the loss, detached).
    """
    mask = response_mask.bool()
    loss = torch.where(mask, -logprobs.float(), 0.0)
    return loss, {"nll": loss.detach()}


# ----------------------------------------------------------------------------- aggregation

@register_aggregation("token-mean")
def _token_mean(x, mask, num_tokens, num_seqs, max_len):
    return x.sum() / num_tokens


@register_aggregation("seq-mean-token-mean")
def _seq_mean_token_mean(x, mask, num_tokens, num_seqs, max_len):
    return (x.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs


@register_aggregation("seq-mean-token-sum")
def _seq_mean_token_sum(x, mask, num_tokens, num_seqs, max_len):
    return x.sum() / num_seqs


@register_aggregation("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(x, mask, num_tokens, num_seqs, max_len):
    if max_len is None or max_len < 1:
        raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs max_response_len >= 1")
    return x.sum() / (num_seqs * max_len)


def aggregate_loss(per_token_loss: Tensor, response_mask: Tensor, mode: str, *, num_tokens: float,
                   num_seqs: float, max_response_len: Optional[int] = None) -> Tensor:
    """Reduce a (B, R) per-token loss of ONE micro-batch to a scalar, with GLOBAL denominators.

    ``num_tokens`` / ``num_seqs`` are the valid-token / non-empty-sequence counts of the whole
    mini-batch across micro-batches and data-parallel ranks (see :func:`loss_denominators`), so
    the sum of the micro-batch results is the mini-batch loss (case C02: token-mean 1.0 for 1, 2 or 4
    micro-batches; seq-mean-token-mean 2.0).

    Modes: ``token-mean`` Σ l / N_tok (DAPO, Yu et al. 2025, eq. 8); ``seq-mean-token-mean``
    Σ_i (Σ_t l_it / |o_i|) / N_seq (GRPO, Shao et al. 2024, eq. 3); ``seq-mean-token-sum``
    Σ l / N_seq; ``seq-mean-token-sum-norm`` Σ l / (N_seq · max_response_len) (Dr.GRPO, Liu et al.
    2025, eq. in §3.2: a constant normaliser).

    Args: per_token_loss (B, R) float (masked values ignored, even NaN); response_mask (B, R) bool.
    Returns: 0-dim float32 tensor (0 when the mini-batch has no valid token).
    Raises: ValueError for an unknown mode, negative denominators, or a missing max_response_len.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {sorted(LOSS_AGGREGATIONS)}")
    if num_tokens < 0 or num_seqs < 0:
        raise ValueError(f"num_tokens and num_seqs must be >= 0, got {num_tokens}, {num_seqs}")
    mask = response_mask.bool()
    x = torch.where(mask, per_token_loss.float(), 0.0)
    # an empty mini-batch has a zero numerator: any positive denominator gives the right 0
    return LOSS_AGGREGATIONS[mode](x, mask, float(num_tokens) or 1.0, float(num_seqs) or 1.0, max_response_len)


RolloutISFn = Callable[[Tensor, float], Optional[Tensor]]
ROLLOUT_IS: dict[str, RolloutISFn] = {}


def register_rollout_is(name: str):
    """Decorator: register ``fn(ratio, cap) -> per-token weight (B, R) or None`` in
    :data:`ROLLOUT_IS` (``algorithm.rollout_is``). Raises ValueError for a name
    ``algorithms/variants.py`` does not declare."""
    if name not in ROLLOUT_IS_NAMES:
        raise ValueError(f"rollout_is {name!r} is not declared in flowrl/algorithms/variants.py")
    return _register(ROLLOUT_IS, name)


def rollout_is_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Token-level importance ratio between the trainer's and the sampler's policy,
    π_old(y_t) / π_rollout(y_t) = exp(old_logprobs − rollout_logprobs): 1 when the rollout engine
    ran the trainer's weights with the same numerics; off-policy batches (placement staleness
    k ≥ 1) and sampler/trainer kernel mismatches move it away from 1.
    Returns (B, R) float32, detached, 1 at masked positions (log clamped to ±LOG_RATIO_CLAMP)."""
    return masked_log_ratio(old_logprobs.detach(), rollout_logprobs.detach(), response_mask).exp()


@register_rollout_is("none")
def no_rollout_is(ratio: Tensor, cap: float) -> Optional[Tensor]:
    """No correction: the loss treats rollout samples as drawn from π_old."""
    return None


@register_rollout_is("tis")
def truncated_is(ratio: Tensor, cap: float) -> Optional[Tensor]:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
    You Off-Policy RL Training", eq. 3): each token's loss is weighted by min(π_old/π_rollout, C),
    the ratio detached, C = ``algorithm.rollout_is_cap``. Returns (B, R) float32."""
    return ratio.clamp(max=cap)


def loss_denominators(response_mask: Tensor) -> tuple[float, float]:
    """(valid-token count, count of sequences with ≥ 1 valid token) of a (B, R) bool mask. Sum these over
    micro-batches and ranks (all-reduce) to get the global ``num_tokens`` / ``num_seqs``."""
    m = response_mask.bool()
    return float(m.sum()), float(m.any(-1).sum())


def mask_truncated(response_mask: Tensor, truncated: Tensor) -> Tensor:
    """Drop truncated completions (DAPO "overlong filtering", Yu et al. 2025 §3.4): rows with
    ``truncated`` (B,) bool get an all-False mask, so they leave both numerator and denominator of
    every aggregation (and, given to an estimator, group statistics). Returns (B, R) bool."""
    return response_mask.bool() & ~truncated.bool().unsqueeze(1)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, *,
               clip_range_value: Optional[float]) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (PPO; Schulman et al. 2017 §5 / OpenAI baselines ppo2):

        L = ½ max((V − G)², (V_old + clip(V − V_old, −c, c) − G)²)      (c = None: ½ (V − G)²)

    Args: values (B, R) float (requires grad); old_values, returns (B, R) float; response_mask (B, R) bool.
    Returns: (per_token_loss (B, R) float32, 0 at masked; stats {"vf_clipfrac"} (B, R) float32).
    Raises: ValueError if clip_range_value <= 0.
    """
    if clip_range_value is not None and clip_range_value <= 0:
        raise ValueError(f"algorithm.clip_range_value must be > 0 or None, got {clip_range_value}")
    mask = response_mask.bool()
    v = torch.where(mask, values.float(), 0.0)
    old = torch.where(mask, old_values.float(), 0.0)
    ret = torch.where(mask, returns.float(), 0.0)
    l1 = (v - ret).square()
    if clip_range_value is None:
        loss, clipped = l1, torch.zeros_like(mask)
    else:
        l2 = (old + (v - old).clamp(-clip_range_value, clip_range_value) - ret).square()
        loss, clipped = torch.maximum(l1, l2), l2 > l1
    return torch.where(mask, 0.5 * loss, 0.0), {"vf_clipfrac": torch.where(mask, clipped.float(), 0.0)}


def entropy_bonus(entropy: Tensor, response_mask: Tensor, mode: str, *, num_tokens: float, num_seqs: float,
                  max_response_len: Optional[int] = None) -> Tensor:
    """Mean entropy over valid tokens only, aggregated like the policy loss (same mode/denominators).
    The total loss is ``pg_loss − entropy_coef · entropy_bonus``. entropy: (B, R) float; returns a scalar."""
    return aggregate_loss(entropy, response_mask, mode, num_tokens=num_tokens, num_seqs=num_seqs,
                          max_response_len=max_response_len)
