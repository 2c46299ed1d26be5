"""Advantage estimators: one small function per variant, registered by name.

Registry calling convention (what ``ops/advantage.py`` does)::

    est = ADVANTAGE_ESTIMATORS[name]            # an AdvantageEstimator
    advantages, returns = est(rewards=..., group_id=..., response_mask=...,
                              token_rewards=None, values=None, cfg=algorithm_config)

Every estimator receives all five tensors (``None`` where the graph has none; a distillation
estimator, ``est.needs_logprobs``, also ``old_logprobs``, ``teacher_logprobs`` and a task
estimator's ``advantages``) plus the ``AlgorithmConfig``, and returns ``(advantages, returns)``, both (B, R) float32 and exactly 0 at
masked positions. Estimators without a critic return ``returns = advantages`` (the reward signal
the critic-less update would regress to; nothing downstream trains on it). ``est.needs_groups``
marks group-baseline estimators (rejected for ``n < 2`` by :func:`validate_estimator`),
``est.needs_values`` marks the critic-based ones, ``est.produces_returns`` those whose ``returns``
differ from ``advantages`` (a return-to-go or value target a graph may consume).

Conventions (rl_math cases): a sample is *scorable* when its reward is finite and it has at least
one valid token; only scorable samples enter group/batch statistics and the others get advantage
0. Groups come from an explicit ``group_id`` (case C11), never from position or prompt text. Std
is the Bessel-corrected sample std computed two-pass (never E[x²]−E[x]²); a set whose values are
all equal has std exactly 0 (case C01). Statistics are computed in float64, results are float32;
a result float32 cannot hold (|x| > 3.4e38: RLOO or Dr.GRPO of rewards near float32's limit) is a
ValueError (:func:`to_float32`), never a silent inf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from flowrl.algorithms.variants import ESTIMATORS

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: ``fn(rewards, group_id, response_mask, token_rewards, values, cfg)``."""

    name: str
    fn: AdvantageFn
    needs_groups: bool = False
    needs_values: bool = False
    produces_returns: bool = False
    needs_logprobs: bool = False

    def __call__(self, *, rewards: Optional[Tensor] = None, group_id: Optional[Tensor] = None,
                 response_mask: Tensor, token_rewards: Optional[Tensor] = None,
                 values: Optional[Tensor] = None, old_logprobs: Optional[Tensor] = None,
                 teacher_logprobs: Optional[Tensor] = None, advantages: Optional[Tensor] = None,
                 cfg: Any) -> tuple[Tensor, Tensor]:
        if self.needs_groups and group_id is None:
            raise ValueError(f"advantage estimator {self.name!r} needs group_id")
        if self.needs_values and (values is None or token_rewards is None):
            raise ValueError(f"advantage estimator {self.name!r} needs token_rewards and values")
        if self.needs_logprobs and (old_logprobs is None or teacher_logprobs is None):
            raise ValueError(f"advantage estimator {self.name!r} needs old_logprobs and teacher_logprobs")
        extra = {"old_logprobs": old_logprobs, "teacher_logprobs": teacher_logprobs,
                 "advantages": advantages} if self.needs_logprobs else {}
        return self.fn(rewards=rewards, group_id=group_id, response_mask=response_mask.bool(),
                       token_rewards=token_rewards, values=values, cfg=cfg, **extra)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_estimator(name: str):
    """Decorator: register ``fn`` under ``name`` in :data:`ADVANTAGE_ESTIMATORS`, with the
    interface flags ``variants.ESTIMATORS[name]`` declares.

    Raises:
        ValueError: ``name`` is registered twice or not declared in ``algorithms/variants.py``.
    """
    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} registered twice")
        if name not in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is not declared in "
                             "flowrl/algorithms/variants.py (ESTIMATORS)")
        spec = ESTIMATORS[name]
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(name, fn, spec.needs_groups,
                                                        spec.needs_values, spec.produces_returns,
                                                        spec.needs_logprobs)
        return fn
    return deco


# ----------------------------------------------------------------------------- helpers

def scorable(rewards: Optional[Tensor], response_mask: Tensor) -> Tensor:
    """(B,) bool: finite reward (if ``rewards`` is given) AND at least one valid token."""
    ok = response_mask.bool().any(dim=1)
    return ok if rewards is None else ok & torch.isfinite(rewards)


def _group_grid(rewards: Tensor, ok: Tensor, group_id: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Lay the scorable rewards out on a (G, n_max) float64 grid, vectorised (no loop over samples).

    Returns (x (G, n), valid (G, n) bool, row (B,), col (B,)): sample b sits at x[row[b], col[b]].
    """
    _, row = torch.unique(group_id, return_inverse=True)
    G = int(row.max()) + 1 if row.numel() else 0
    counts = torch.bincount(row, minlength=G)
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(row, stable=True)
    col = torch.empty_like(row)
    col[order] = torch.arange(row.numel(), device=row.device) - starts[row[order]]
    n = max(int(counts.max()) if G else 0, 1)
    x = torch.zeros(G, n, dtype=torch.float64, device=rewards.device)
    v = torch.zeros(G, n, dtype=torch.bool, device=rewards.device)
    x[row, col] = torch.where(ok, rewards, 0.0).double()
    v[row, col] = ok
    return x, v, row, col


def _set_stats(x: Tensor, valid: Tensor, dim: int = -1) -> tuple[Tensor, Tensor, Tensor]:
    """Two-pass (count, mean, sample std) of ``x`` over ``valid`` along ``dim``; std is exactly 0 for a
    constant set or one with < 2 members."""
    cnt = valid.sum(dim)
    mean = torch.where(valid, x, 0.0).sum(dim) / cnt.clamp(min=1)
    dev = torch.where(valid, x - mean.unsqueeze(dim), 0.0)
    std = (dev.square().sum(dim) / (cnt - 1).clamp(min=1)).sqrt()
    hi = torch.where(valid, x, -torch.inf).amax(dim)
    lo = torch.where(valid, x, torch.inf).amin(dim)
    std = torch.where((hi == lo) | (cnt < 2), 0.0, std)
    return cnt, mean, std


_F32_MAX = torch.finfo(torch.float32).max


def to_float32(x: Tensor, what: str = "advantages") -> Tensor:
    """A float64 result as float32, refusing what float32 cannot hold.

    The statistics are float64, so nothing overflows while computing (rewards up to float32's
    3.4e38 give r − mean up to 6.8e38, far inside float64). A *result* above 3.4e38 in magnitude
    would become ±inf in float32 (then NaN in the loss): an unnormalised estimator (RLOO,
    Dr.GRPO, a return-to-go) of rewards above ~1.7e38. Such rewards are a reward-function bug;
    say so instead of training on inf.

    Raises:
        ValueError: a finite float64 value of ``x`` lies outside float32's range.
    """
    big = torch.isfinite(x) & (x.abs() > _F32_MAX)
    if big.any():
        worst = float(x[big].abs().max())
        raise ValueError(f"{what} reach {worst:.3g}, beyond float32's {_F32_MAX:.3g} (they would "
                         "be inf): the rewards are too large for this estimator; scale them down "
                         "(reward scores of this size are usually a reward-function bug)")
    return x.to(torch.float32)


def _broadcast(adv: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) float64 → (B, R) float32, 0 at masked positions; ValueError (:func:`to_float32`) for
    a value beyond float32's range."""
    return torch.where(response_mask, to_float32(adv).unsqueeze(1), 0.0)


def group_center(rewards: Tensor, group_id: Tensor, response_mask: Tensor, *, eps: float = 1e-6,
                 norm_by_std: bool = True) -> Tensor:
    """(B,) float64 per-sample (r - group mean) [/ (group std + eps)] over scorable samples.

    Unscorable samples and groups with < 2 scorable samples get 0; a constant group gets exactly 0.
    """
    ok = scorable(rewards, response_mask)
    x, v, row, col = _group_grid(rewards, ok, group_id)
    cnt, mean, std = _set_stats(x, v)
    dev = torch.where(std[row] > 0, x[row, col] - mean[row], 0.0)  # constant group → exactly 0
    adv = dev / (std[row] + eps) if norm_by_std else dev
    return torch.where(ok & (cnt[row] >= 2), adv, 0.0)


def whiten(x: Tensor, mask: Tensor, *, eps: float = 1e-6, shift_mean: bool = True) -> Tensor:
    """Batch whitening over valid positions: (x - mean) / (std + eps), 0 at masked positions.

    x: (B, R) float; mask: (B, R) bool. Mean and sample std are over all valid positions of the batch
    (two-pass, float64); a constant batch or one with < 2 valid positions gives std 0 (then only the
    mean is removed). ``shift_mean=False`` adds the mean back (scale only). Returns float32.
    Under data parallelism the caller must pass globally reduced statistics (not done here).
    """
    mask = mask.bool()
    if not mask.any():
        return torch.zeros(mask.shape, dtype=torch.float32, device=x.device)
    xd = torch.where(mask, x.double(), 0.0)
    _, mean, std = _set_stats(xd.flatten(), mask.flatten())
    out = (xd - mean) / (std + eps) if std > 0 else xd - mean
    if not shift_mean:
        out = out + mean
    return to_float32(torch.where(mask, out, 0.0))


def place_on_last_token(rewards: Tensor, response_mask: Tensor,
                        dtype: torch.dtype = torch.float32) -> Tensor:
    """(B,) sequence rewards → (B, R) token rewards of ``dtype`` on the last valid token (NaN → 0)."""
    B, R = response_mask.shape
    pos = torch.arange(R, device=response_mask.device).expand(B, R)
    last = torch.where(response_mask, pos, -1).amax(dim=1, keepdim=True)
    r = torch.nan_to_num(rewards.to(dtype), nan=0.0).unsqueeze(1)
    return torch.where((pos == last) & response_mask, r, 0.0)


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go G_t = Σ_{k≥t, valid} γ^(#valid steps between) r_k; masked positions are skipped
    (they neither receive nor pass on return) and are 0. (B, R) → (B, R) float32; ValueError
    (:func:`to_float32`) for a return beyond float32's range."""
    return to_float32(_returns64(token_rewards, response_mask, gamma), "returns")


def _returns64(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """:func:`discounted_returns` in float64 (what whitening reads: no float32 round trip)."""
    mask = response_mask.bool()
    r = torch.where(mask, token_rewards.double(), 0.0)
    out = torch.zeros_like(r)
    carry = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):  # loop over time, vectorised over the batch
        carry = torch.where(mask[:, t], r[:, t] + gamma * carry, carry)
        out[:, t] = carry
    return torch.where(mask, out, 0.0)


# ----------------------------------------------------------------------------- estimators

def grpo_advantages(rewards: Tensor, group_id: Tensor, response_mask: Tensor, *, eps: float = 1e-6,
                    norm_by_std: bool = True) -> Tensor:
    """GRPO outcome-supervision advantage (Shao et al. 2024, DeepSeekMath, eq. 3 / §4.1.2).

    A_i = (r_i − mean(r_group)) / (std(r_group) + eps), broadcast over the valid tokens of sample i.

    Args:
        rewards: (B,) float32, NaN = unscorable. group_id: (B,) int64 (any values, any order).
        response_mask: (B, R) bool. eps: added to the sample std. norm_by_std: False = Dr.GRPO.
    Returns:
        (B, R) float32, 0 at masked positions, for unscorable samples, for groups with < 2
        scorable samples, and exactly 0 for zero-variance groups (C01). Permutation-invariant (C11).
    Raises:
        ValueError: shapes disagree.
    """
    _check(rewards, group_id, response_mask)
    return _broadcast(group_center(rewards, group_id, response_mask.bool(), eps=eps,
                                   norm_by_std=norm_by_std), response_mask.bool())


def dr_grpo_advantages(rewards: Tensor, group_id: Tensor, response_mask: Tensor) -> Tensor:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", eq. in §3.2): A_i = r_i − mean(r_group),
    no std division. Shapes and zero rules as :func:`grpo_advantages`. Raises ValueError on bad shapes."""
    return grpo_advantages(rewards, group_id, response_mask, norm_by_std=False)


def rloo_advantages(rewards: Tensor, group_id: Tensor, response_mask: Tensor, *, norm_by_std: bool = False,
                    eps: float = 1e-6) -> Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics", eq. 6; Kool et al. 2019): A_i = r_i − mean_{j≠i} r_j
    over the scorable siblings of i.

    ``norm_by_std=True`` also divides by the leave-one-out sample std + eps; when the leave-one-out set
    is constant (or has one member) its std counts as exactly 0 and the division is skipped (case C01:
    rewards [0, .95×7] → A_0 = −0.95). Vectorised on a (G, n, n) grid (no loop over samples).

    Args/returns as :func:`grpo_advantages`: (B, R) float32; 0 for unscorable samples and for samples
    with no scorable sibling. Raises ValueError on bad shapes.
    """
    _check(rewards, group_id, response_mask)
    mask = response_mask.bool()
    ok = scorable(rewards, mask)
    x, v, row, col = _group_grid(rewards, ok, group_id)
    G, n = x.shape
    eye = torch.eye(n, dtype=torch.bool, device=rewards.device)
    others = v.unsqueeze(1) & ~eye  # (G, i, j): j is a scorable sibling of i
    cnt, mean, std = _set_stats(x.unsqueeze(1).expand(G, n, n), others)
    adv = x - mean
    if norm_by_std:
        adv = torch.where(std > 0, adv / (std + eps), adv)
    adv = torch.where(v & (cnt >= 1), adv, 0.0)
    return _broadcast(adv[row, col], mask)


def reinforce_pp_advantages(token_rewards: Tensor, response_mask: Tensor, *, rewards: Optional[Tensor] = None,
                            gamma: float = 1.0, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262, eqs. 7–8): return-to-go of token rewards, batch-whitened.

    Args:
        token_rewards: (B, R) float32 (sequence reward on the last valid token, minus in-reward KL).
        response_mask: (B, R) bool. rewards: optional (B,) — NaN rows are excluded (advantage 0).
    Returns:
        (advantages, returns), (B, R) float32, 0 at masked positions and for unscorable rows.
    """
    mask = response_mask.bool() & scorable(rewards, response_mask).unsqueeze(1)
    returns = _returns64(token_rewards, mask, gamma)  # whitened in float64, then float32
    return whiten(returns, mask, eps=eps), to_float32(returns, "returns")


def reinforce_pp_baseline_advantages(rewards: Tensor, group_id: Tensor, response_mask: Tensor, *,
                                     token_rewards: Optional[Tensor] = None, gamma: float = 1.0,
                                     eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025, §3 "REINFORCE++-baseline"): subtract the group mean reward (on the
    last valid token) from the token rewards, return-to-go, then batch whitening.

    rewards (B,) NaN = unscorable; group_id (B,) int64; token_rewards (B, R) or None (= rewards placed on
    the last valid token). Returns (advantages, returns), (B, R) float32, 0 where masked/unscorable.
    """
    _check(rewards, group_id, response_mask)
    mask = response_mask.bool()
    # float64 throughout: r − mean of rewards near float32's limit overflows float32 (inf, then NaN
    # from whitening) although the whitened advantages are small
    f64 = torch.float64
    tr = place_on_last_token(rewards, mask, f64) if token_rewards is None else token_rewards.double()
    centred_shift = group_center(rewards, group_id, mask, norm_by_std=False) - torch.nan_to_num(rewards.double())
    tr = tr + place_on_last_token(centred_shift, mask, f64)  # r − mean on the last token
    return reinforce_pp_advantages(tr, mask, rewards=rewards, gamma=gamma, eps=eps)


def gae(token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, eq. 16), over valid tokens only.

    δ_t = r_t + γ V_{t'} − V_t with t' the next *valid* position (V = 0 after the last one: terminal),
    A_t = δ_t + γλ A_{t'}. Masked positions never feed the recursion (case C06: mask [1,1,0],
    r [0,1,0], V [0,0,100], γ=1, λ=.95 → A = returns = [0.95, 1.0, 0]); NaN there is harmless.

    Args: token_rewards, values: (B, R) float; response_mask: (B, R) bool.
    Returns: (advantages, returns = advantages + values), (B, R) float32, 0 at masked positions.
    Raises: ValueError (:func:`to_float32`) for a result beyond float32's range.
    """
    mask = response_mask.bool()
    r = torch.where(mask, token_rewards.double(), 0.0)
    v = torch.where(mask, values.double(), 0.0)
    adv = torch.zeros_like(r)
    next_v = torch.zeros_like(r[:, 0])
    next_a = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):  # loop over time, vectorised over the batch
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        m = mask[:, t]
        adv[:, t] = torch.where(m, a, 0.0)
        next_a = torch.where(m, a, next_a)
        next_v = torch.where(m, v[:, t], next_v)
    return to_float32(adv), to_float32(torch.where(mask, adv + v, 0.0), "returns")


def reverse_kl_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, response_mask: Tensor,
                          *, coef: float = 1.0, clip: Optional[float] = None,
                          task_advantages: Optional[Tensor] = None) -> Tensor:
    """On-policy distillation advantage: the negative per-token reverse KL to the teacher
    (Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD), eq. 3 with the
    student's own samples; Thinking Machines, "On-Policy Distillation", 2025).

    With y ~ π_student, the per-token estimate of KL(π_student ‖ π_teacher) at position t is
    log π_student(y_t) − log π_teacher(y_t); its negative is the advantage of token t alone, no
    discounting (each token is rewarded for its own log-ratio, not for those after it)::

        A_t = coef · clip(log π_teacher(y_t) − log π_student(y_t), −c, c)  [+ task_advantages_t]

    Fed to the policy-gradient loss (stop-gradient on A), the update's expected gradient is the
    gradient of −reverse KL. Positive where the teacher likes the token more than the student.

    Args:
        student_logprobs: (B, R) float, log π_student of the sampled tokens (the trainer's
            ``old_logprobs``, at the sampling temperature).
        teacher_logprobs: (B, R) float, log π_teacher of the same tokens, same temperature.
        response_mask: (B, R) bool; masked positions contribute nothing (NaN/inf there is ignored).
        coef: ``algorithm.distill_coef``, ≥ 0. clip: ``algorithm.distill_clip`` c > 0, or None.
        task_advantages: optional (B, R) advantages of a task-reward estimator (GRPO + distillation)
            added unchanged.
    Returns:
        (B, R) float32, exactly 0 at masked positions.
    Raises:
        ValueError: shapes disagree.
    """
    shapes = {tuple(student_logprobs.shape), tuple(teacher_logprobs.shape), tuple(response_mask.shape)}
    if task_advantages is not None:
        shapes.add(tuple(task_advantages.shape))
    if len(shapes) != 1 or student_logprobs.dim() != 2:
        raise ValueError(f"expected old_logprobs, teacher_logprobs, response_mask (and advantages) "
                         f"all (B, R); got {tuple(student_logprobs.shape)}, "
                         f"{tuple(teacher_logprobs.shape)}, {tuple(response_mask.shape)}"
                         + (f", {tuple(task_advantages.shape)}" if task_advantages is not None else ""))
    mask = response_mask.bool()
    ratio = torch.where(mask, teacher_logprobs.float() - student_logprobs.float(), 0.0)
    if clip is not None:
        ratio = ratio.clamp(-clip, clip)
    adv = coef * ratio
    if task_advantages is not None:
        adv = adv + task_advantages.float()
    return torch.where(mask, adv, 0.0)


def _check(rewards: Tensor, group_id: Tensor, response_mask: Tensor) -> None:
    if rewards.dim() != 1 or group_id.shape != rewards.shape or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"expected rewards (B,), group_id (B,), response_mask (B, R); got "
                         f"{tuple(rewards.shape)}, {tuple(group_id.shape)}, {tuple(response_mask.shape)}")


# ----------------------------------------------------------------------------- registry entries

@register_estimator("grpo")
def _grpo(*, rewards, group_id, response_mask, cfg, **_):
    a = grpo_advantages(rewards, group_id, response_mask, eps=cfg.adv_eps)
    return a, a


@register_estimator("dr_grpo")
def _dr_grpo(*, rewards, group_id, response_mask, **_):
    a = dr_grpo_advantages(rewards, group_id, response_mask)
    return a, a


@register_estimator("rloo")
def _rloo(*, rewards, group_id, response_mask, **_):
    a = rloo_advantages(rewards, group_id, response_mask)
    return a, a


@register_estimator("rloo_std")
def _rloo_std(*, rewards, group_id, response_mask, cfg, **_):
    a = rloo_advantages(rewards, group_id, response_mask, norm_by_std=True, eps=cfg.adv_eps)
    return a, a


@register_estimator("reinforce_pp")
def _reinforce_pp(*, rewards, response_mask, token_rewards, cfg, **_):
    tr = place_on_last_token(rewards, response_mask) if token_rewards is None else token_rewards
    return reinforce_pp_advantages(tr, response_mask, rewards=rewards, gamma=cfg.gamma, eps=cfg.adv_eps)


@register_estimator("reinforce_pp_baseline")
def _reinforce_pp_baseline(*, rewards, group_id, response_mask, token_rewards, cfg, **_):
    return reinforce_pp_baseline_advantages(rewards, group_id, response_mask, token_rewards=token_rewards,
                                            gamma=cfg.gamma, eps=cfg.adv_eps)


@register_estimator("gae")
def _gae(*, response_mask, token_rewards, values, cfg, **_):
    adv, ret = gae(token_rewards, values, response_mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        adv = whiten(adv, response_mask, eps=cfg.adv_eps)
    return adv, ret


@register_estimator("distill")
def _distill(*, response_mask, old_logprobs, teacher_logprobs, advantages, cfg, **_):
    a = reverse_kl_advantages(old_logprobs, teacher_logprobs, response_mask, coef=cfg.distill_coef,
                              clip=cfg.distill_clip, task_advantages=advantages)
    return a, a
