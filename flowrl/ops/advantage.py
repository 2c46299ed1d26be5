"""Advantage stages: one op ``advantage.<name>`` per estimator of
``flowrl.algorithms.advantages.ADVANTAGE_ESTIMATORS``, registered by a loop over that registry.

Every op takes ``rewards`` (B,) float32 (NaN = unscorable), ``group_id`` (B,) int64 and
``response_mask`` (B, R) bool, plus the optional ``token_rewards`` (B, R) float32 (from
``reward.token_rewards``: sequence reward on the last valid token, minus in-reward KL) and
``values`` (B, R) float32 (from the critic's ``values`` stage). Estimators flagged ``needs_values``
(GAE) declare ``token_rewards`` and ``values`` as *required*, so an unbound one is a graph
validation error before any model loads.

Outputs: ``advantages`` (B, R) float32, 0 at masked positions; estimators flagged
``produces_returns`` (GAE, REINFORCE++ and its baseline variant) also output ``returns`` (B, R)
float32 (GAE: the critic's regression target A + V; REINFORCE++: the return-to-go). The others'
"returns" would only repeat the advantages, so they do not declare the output at all.

Group estimators reject ``algorithm.n < 2`` in ``flowrl.train.prepare`` (``validate_estimator``),
before any model loads. The config each estimator reads (``adv_eps``,
``gamma``, ``lam``, ``whiten_advantages``) is the run's ``algorithm`` resource. The ops'
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


def make_advantage_op(est: AdvantageEstimator) -> Callable[..., dict]:
    """The op function of estimator ``est``; it calls ``est`` with the run's AlgorithmConfig."""

    def op(ctx: StageContext, cfg: NoConfig, *, rewards, group_id, response_mask,
           token_rewards=None, values=None) -> dict:
        try:
            adv, ret = est(rewards=rewards, group_id=group_id, response_mask=response_mask,
                           token_rewards=token_rewards, values=values, cfg=ctx.resource("algorithm"))
        except ValueError as e:  # bad shapes: say which stage got them
            raise ValueError(f"stage '{ctx.stage}' ({op_name}): {e}") from e
        log_advantage_metrics(ctx, adv, response_mask, ret if est.produces_returns else None)
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
