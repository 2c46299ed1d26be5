"""Advantage stages: one op ``advantage.<name>`` per estimator of
``flowrl.algorithms.variants.ESTIMATORS``, registered by a loop over that registry.

Every op takes ``rewards`` (B,) float32 (NaN = unscorable), ``group_id`` (B,) int64 and
``response_mask`` (B, R) bool, plus the optional ``token_rewards`` (B, R) float32 (from
``reward.token_rewards``: sequence reward on the last valid token, minus in-reward KL) and
``values`` (B, R) float32 (from the critic's ``values`` stage). Estimators flagged ``needs_values``
(GAE) declare ``token_rewards`` and ``values`` as *required*, so an unbound one is a graph
validation error before any model loads. A distillation estimator (``needs_logprobs``:
``advantage.distill``) takes instead ``old_logprobs`` (B, R) float32 (the student's), and
``teacher_logprobs`` (B, R) float32 (the ``teacher`` role's ``logprobs`` stage), both required,
plus an optional task estimator's ``advantages`` (B, R) to add to; it logs ``distill/*``.

Outputs (the op's return ``TypedDict``, its output contract): :class:`Advantages`,
``advantages`` (B, R) float32, 0 at masked positions; estimators flagged ``produces_returns``
(GAE, REINFORCE++ and its baseline variant) return :class:`AdvantagesAndReturns`, also
``returns`` (B, R) float32 (GAE: the critic's regression target A + V; REINFORCE++: the
return-to-go). The others' "returns" would only repeat the advantages, so they do not declare
the output at all.

Group estimators reject ``algorithm.n < 2`` in ``flowrl.train.prepare`` (``validate_estimator``),
before any model loads. The config each estimator reads (``adv_eps``,
``gamma``, ``lam``, ``whiten_advantages``, ``distill_coef``, ``distill_clip``) is the run's ``algorithm`` (``ctx.run.algorithm``). The ops
are declared here, one per estimator of ``algorithms/variants.py`` (torch-free), and call the
estimator functions of ``algorithms/advantages.py`` (imported on the first call).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, TypedDict

from flowrl.algorithms.variants import ESTIMATORS, EstimatorSpec
from flowrl.ops.registry import register_op

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.ops.context import StageContext
    from flowrl.ops.spec import NoConfig

_CRITIC_INPUTS = ("token_rewards", "values")


class Advantages(TypedDict):
    """``advantage.<estimator>``: ``advantages`` (B, R) float32, one per response token, 0 at
    masked positions."""

    advantages: Tensor


class AdvantagesAndReturns(Advantages):
    """An estimator flagged ``produces_returns``: :class:`Advantages` plus ``returns`` (B, R)
    float32, 0 at masked positions (GAE: A + V, the critic's regression target; REINFORCE++:
    the discounted return-to-go)."""

    returns: Tensor


def log_advantage_metrics(ctx: StageContext, advantages: Tensor, response_mask: Tensor,
                          returns: Optional[Tensor] = None) -> None:
    """Per-sequence mean advantage (mean over valid tokens, then over the batch): ``advantage/mean``,
    ``advantage/abs_mean``, ``advantage/zero_frac`` (share of samples whose advantage is exactly 0:
    zero-variance groups, unscorable or empty samples); with returns, ``returns/mean`` over valid
    tokens."""
    import torch

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
    import torch

    mask = response_mask.bool()
    kl = torch.where(mask, student.float() - teacher.float(), 0.0)
    n = mask.sum().clamp(min=1)
    ctx.log(**{"distill/reverse_kl": kl.sum() / n, "distill/reverse_kl_seq": kl.sum(-1).mean()})
    if clip is not None:
        ctx.log(**{"distill/clip_frac": ((kl.abs() > clip) & mask).sum() / n})


def make_advantage_op(spec: EstimatorSpec) -> Callable[..., Advantages]:
    """The op function of estimator ``spec``: it calls the estimator function registered under
    its name (``algorithms.advantages.ADVANTAGE_ESTIMATORS``) with the run's AlgorithmConfig and
    returns :class:`AdvantagesAndReturns` when ``spec.produces_returns``, else
    :class:`Advantages` (``register_op`` takes the op's outputs from that type).

    Raises (on a call): LookupError when ``algorithms/advantages.py`` registers no function for
    an estimator ``algorithms/variants.py`` declares.
    """
    op_name = f"advantage.{spec.name}"

    # **inputs: the op's declared inputs besides response_mask (the executor passes each, None
    # for an unbound optional one); a distillation op's differ from a reward estimator's
    def estimate(ctx: StageContext, response_mask: Tensor,
                 inputs: dict[str, Tensor | None]) -> tuple[Tensor, Tensor]:
        from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS

        if spec.name not in ADVANTAGE_ESTIMATORS:
            raise LookupError(f"advantage estimator {spec.name!r} is declared in "
                              "algorithms/variants.py but algorithms/advantages.py registers no "
                              "function")
        est = ADVANTAGE_ESTIMATORS[spec.name]
        algo = ctx.run.algorithm
        try:
            adv, ret = est(response_mask=response_mask, cfg=algo, **inputs)
        except ValueError as e:  # bad shapes, results beyond float32: say which stage got them
            raise ValueError(f"stage '{ctx.stage}' ({op_name}): {e}") from e
        log_advantage_metrics(ctx, adv, response_mask, ret if spec.produces_returns else None)
        if spec.needs_logprobs:
            student, teacher = inputs["old_logprobs"], inputs["teacher_logprobs"]
            assert student is not None and teacher is not None  # required inputs
            log_distill_metrics(ctx, student, teacher, response_mask, algo.distill_clip)
        return adv, ret

    def op(ctx: StageContext, cfg: NoConfig, *, response_mask: Tensor,
           **inputs: Tensor | None) -> Advantages:
        return {"advantages": estimate(ctx, response_mask, inputs)[0]}

    def op_with_returns(ctx: StageContext, cfg: NoConfig, *, response_mask: Tensor,
                        **inputs: Tensor | None) -> AdvantagesAndReturns:
        adv, ret = estimate(ctx, response_mask, inputs)
        return {"advantages": adv, "returns": ret}

    fn: Callable[..., Advantages] = op_with_returns if spec.produces_returns else op
    fn.__name__ = f"advantage_{spec.name}"
    fn.__doc__ = (f"Advantages from estimator {spec.name!r} (``algorithms.advantages``): "
                  f"advantages (B, R) float32"
                  f"{' and returns (B, R) float32' if spec.produces_returns else ''}, 0 at masked "
                  "positions.")
    return fn


def _register_all() -> None:
    """One op per estimator of ``algorithms/variants.py``: estimators that read the critic
    (GAE) require ``token_rewards`` and ``values`` (an unbound one is a validation error before
    any model loads), the others take them optionally; the outputs are the keys of the op's
    return type (``returns`` only where it differs from the advantages:
    :func:`make_advantage_op`). A distillation estimator (``needs_logprobs``) reads the student's
    and the teacher's logprobs of the sampled tokens, and optionally a task estimator's
    ``advantages`` to add its own to (GRPO + distillation)."""
    for name, spec in ESTIMATORS.items():
        doc = f"Advantages from estimator {name!r}"
        if spec.needs_logprobs:
            register_op(f"advantage.{name}", inputs=("response_mask", "old_logprobs",
                                                     "teacher_logprobs"),
                        optional_inputs=("advantages",), doc=doc)(make_advantage_op(spec))
            continue
        register_op(
            f"advantage.{name}",
            inputs=("rewards", "group_id", "response_mask")
            + (_CRITIC_INPUTS if spec.needs_values else ()),
            optional_inputs=() if spec.needs_values else _CRITIC_INPUTS,
            doc=doc)(make_advantage_op(spec))


_register_all()
