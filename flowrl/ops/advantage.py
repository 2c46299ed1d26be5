"""Advantage stages: one op ``advantage.<name>`` per estimator of
``flowrl.algorithms.advantages.ADVANTAGE_ESTIMATORS``, registered by a loop over that registry.

Every op takes ``rewards`` (B,) float32 (NaN = unscorable), ``group_id`` (B,) int64 and
``response_mask`` (B, R) bool, plus the optional ``token_rewards`` (B, R) float32 (from
``reward.token_rewards``: sequence reward on the last valid token, minus in-reward KL) and
``values`` (B, R) float32 (from the critic's ``values`` stage). Estimators flagged ``needs_values``
(GAE) declare ``token_rewards`` and ``values`` as *required*, so an unbound one is a graph
validation error before any model loads. A distillation estimator (``needs_logprobs``:
``advantage.distill``) takes instead ``old_logprobs`` (B, R) float32 (the student's), and
``teacher_logprobs`` (B, R) float32 (the ``teacher`` role's ``logprobs`` stage), both required,
plus an optional task estimator's ``advantages`` (B, R) to add to; it logs ``distill/*``.

Outputs: ``advantages`` (B, R) float32, 0 at masked positions; estimators flagged
``produces_returns`` (GAE, REINFORCE++ and its baseline variant) also output ``returns`` (B, R)
float32 (GAE: the critic's regression target A + V; REINFORCE++: the return-to-go). The others'
"returns" would only repeat the advantages, so they do not declare the output at all.

Group estimators reject ``algorithm.n < 2`` in ``flowrl.train.prepare`` (``validate_estimator``),
before any model loads. The config each estimator reads (``adv_eps``,
``gamma``, ``lam``, ``whiten_advantages``, ``distill_coef``, ``distill_clip``) is the run's ``algorithm`` resource. The ops'
declarations (inputs, outputs) are in ``ops/builtin.py``, made from ``algorithms/variants.py``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator
from flowrl.algorithms.variants import ESTIMATORS
from flowrl.ops.context import StageContext
from flowrl.ops.registry import NoConfig, implements

_BASE_INPUTS = ("rewards", "group_id", "response_mask")
_CRITIC_INPUTS = ("token_rewards", "values")


def log_advantage_metrics(ctx: StageContext, advantages: Tensor, response_mask: Tensor,
                          returns: Optional[Tensor] = None) -> None:
    """Per-sequence mean advantage (mean over valid tokens, then over the batch): ``advantage/mean``,
    ``advantage/abs_mean``, ``advantage/zero_frac`` (share of samples whose advantage is exactly 0:
    zero-variance groups, unscorable or empty samples); with returns, ``returns/mean`` over valid
    tokens."""
    mask = response_mask.bool()
    seq = advantages.sum(-1) / mask.sum(-1).clamp(min=1)
    ctx.log(**{"advantage/mean": seq.mean(), "advantage/abs_mean": seq.abs().mean(),
               "advantage/zero_frac": (seq == 0).float().mean()})
    if returns is not None:
        ctx.log(**{"returns/mean": torch.where(mask, returns, 0.0).sum() / mask.sum().clamp(min=1)})


def log_distill_metrics(ctx: StageContext, student: Tensor, teacher: Tensor, response_mask: Tensor,
                        clip: Optional[float]) -> None:
    """``distill/reverse_kl``: mean over valid tokens of log π_student − log π_teacher (the
    per-token estimate of KL(π_student ‖ π_teacher), nats; it falls as the student learns);
    ``distill/reverse_kl_seq``: its sum per sequence, mean over sequences; with
    ``algorithm.distill_clip``, ``distill/clip_frac``: share of valid tokens whose log-ratio
    was clipped."""
    mask = response_mask.bool()
    kl = torch.where(mask, student.float() - teacher.float(), 0.0)
    n = mask.sum().clamp(min=1)
    ctx.log(**{"distill/reverse_kl": kl.sum() / n, "distill/reverse_kl_seq": kl.sum(-1).mean()})
    if clip is not None:
        ctx.log(**{"distill/clip_frac": ((kl.abs() > clip) & mask).sum() / n})


def make_advantage_op(est: AdvantageEstimator) -> Callable[..., dict]:
    """The op function of estimator ``est``; it calls ``est`` with the run's AlgorithmConfig."""

    # **inputs: the op's declared inputs besides response_mask (the executor passes each, None
    # for an unbound optional one); a distillation op's differ from a reward estimator's
    def op(ctx: StageContext, cfg: NoConfig, *, response_mask, **inputs) -> dict:
        algo = ctx.resource("algorithm")
        try:
            adv, ret = est(response_mask=response_mask, cfg=algo, **inputs)
        except ValueError as e:  # bad shapes, results beyond float32: say which stage got them
            raise ValueError(f"stage '{ctx.stage}' ({op_name}): {e}") from e
        log_advantage_metrics(ctx, adv, response_mask, ret if est.produces_returns else None)
        if est.needs_logprobs:
            log_distill_metrics(ctx, inputs["old_logprobs"], inputs["teacher_logprobs"],
                                response_mask, algo.distill_clip)
        return {"advantages": adv, "returns": ret} if est.produces_returns else {"advantages": adv}

    op_name = f"advantage.{est.name}"
    op.__name__ = f"advantage_{est.name}"
    doc = (est.fn.__doc__ or "").strip()
    op.__doc__ = (f"Advantages from estimator {est.name!r} (``algorithms.advantages``): advantages "
                  f"(B, R) float32{' and returns (B, R) float32' if est.produces_returns else ''}, "
                  f"0 at masked positions." + (f"\n\n{doc}" if doc else ""))
    return op


def _bind_all() -> None:
    """Bind ``advantage.<name>`` (declared in ``ops/builtin.py`` from ``algorithms/variants.py``)
    to each registered estimator; every declared estimator must have a function."""
    for name, est in ADVANTAGE_ESTIMATORS.items():
        implements(f"advantage.{name}")(make_advantage_op(est))
    unbound = sorted(set(ESTIMATORS) - set(ADVANTAGE_ESTIMATORS))
    if unbound:
        raise LookupError(f"advantage estimator(s) {unbound} are declared in "
                          "algorithms/variants.py but algorithms/advantages.py registers no function")


_bind_all()
