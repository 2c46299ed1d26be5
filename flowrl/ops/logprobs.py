"""Log-probabilities of the sampled responses under a model role (old policy or reference)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from flowrl.ops.fields import PROMPT, RESPONSE, VISION
from flowrl.ops.registry import register_op

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.engines.base import LogprobEngine
    from flowrl.ops.context import StageContext


@dataclass
class LogprobsConfig:
    """with_entropy: also log the policy entropy (nats, mean over valid tokens)."""

    with_entropy: bool = False


class Logprobs(TypedDict):
    """``logprobs``: log-probability of each response token under the stage's model, (B, R)
    float32, 0 at masked positions."""

    logprobs: Tensor


@register_op("logprobs", inputs=PROMPT + RESPONSE, optional_inputs=("rollout_logprobs",) + VISION,
             config=LogprobsConfig, roles=("actor", "ref", "teacher"))
def logprobs(ctx: StageContext[LogprobEngine], cfg: LogprobsConfig, *, prompt_ids: Tensor,
             prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
             rollout_logprobs: Tensor | None = None, pixel_values: Tensor | None = None,
             image_grid_thw: Tensor | None = None) -> Logprobs:
    """Log-probabilities of the responses at the sampling temperature.

    Recomputes log π(response token) at the sampling temperature (case C08).

    Output: logprobs (B, R) float32, 0 where response_mask is False.
    When ``rollout_logprobs`` is bound, logs ``rollout/logprob_mismatch``: mean |rollout − this|
    over the valid tokens the rollout engine measured (on the steps ``rollout.sampling.logprobs``
    measures) (≈0 for an on-policy setup whose sampler and trainer agree; a stale-weights
    or temperature bug shows up here first). ``pixel_values`` / ``image_grid_thw``: a
    vision-language batch's images (``flowrl.data.images``), the rollout's own.
    """
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
             "response_ids": response_ids, "response_mask": response_mask}
    if pixel_values is not None and image_grid_thw is not None:
        batch.update(pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    import torch

    from flowrl.ops.rebalance import balance_rows

    temp = ctx.run.sampling.temperature
    # equal rows / tokens per data-parallel rank; outputs come back in this rank's row order
    bal = balance_rows(ctx, batch)
    out = ctx.engine.logprobs(bal.batch, temperature=temp, with_entropy=cfg.with_entropy)
    lp, ent = bal.restore(out.logprobs), bal.restore(out.entropy)
    mask = response_mask
    denom = mask.sum().clamp(min=1)
    from flowrl.engines.base import logprobs_measured

    # a step rollout.sampling.logprobs does not measure (NaN): no value, not a 0 that looks fine
    if rollout_logprobs is not None and logprobs_measured(ctx.run.sampling.logprobs, ctx.step):
        # every input arrives on the engine's device (DESIGN.md "Where tensors live"); over the
        # measured tokens (NaN: not measured; no host sync here)
        measured = mask.bool() & ~torch.isnan(rollout_logprobs)
        diff = torch.where(measured, (rollout_logprobs - lp).abs(), 0.0)
        ctx.log(**{"rollout/logprob_mismatch": diff.sum() / measured.sum().clamp(min=1),
                   "rollout/logprob_mismatch_max": diff.max()})
    if cfg.with_entropy and ent is not None:
        ctx.log(**{f"{ctx.stage}/entropy": torch.where(mask, ent, 0.0).sum() / denom})
    return {"logprobs": lp}
