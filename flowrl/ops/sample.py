"""Prompt sampling: the stage that starts every iteration."""
from __future__ import annotations

from typing import TYPE_CHECKING

from flowrl.ops.fields import Prompts
from flowrl.ops.registry import register_op

if TYPE_CHECKING:
    from flowrl.ops.context import StageContext
    from flowrl.ops.spec import NoConfig


@register_op("data.sample")
def sample(ctx: StageContext, cfg: NoConfig) -> Prompts:
    """Draw prompts_per_step prompts, each repeated algorithm.n times.

    Draws ``trainer.prompts_per_step`` prompts and repeats each ``algorithm.n`` times.
    Outputs: prompt_ids/prompt_mask (B, P) int64/bool left-padded with B = prompts × n;
    group_id (B,) int64 assigned here, unique across steps and ranks (never inferred later from
    prompt text); ground_truth list[str] of length B. Logs ``data/skipped_prompts``: the
    over-long prompts drawn and skipped so far (``PromptSource``); ``data/prompt_length_max``:
    P, the padded prompt width in tokens (what the step pays for; ``placement=auto``'s refit
    reads it where the plan had only ``data.max_prompt_tokens``).
    """
    source = ctx.run.prompts
    num_prompts = ctx.run.prompts_per_step
    batch = source.sample(num_prompts, ctx.run.algorithm.n)
    ctx.log(**{"data/prompts": num_prompts, "data/epoch": source.sampler.epoch,
               "data/skipped_prompts": source.num_skipped,  # over-long draws, cumulative
               "data/prompt_length_max": batch.prompt_ids.shape[1]})  # a shape: no sync
    return {"prompt_ids": batch.prompt_ids, "prompt_mask": batch.prompt_mask,
            "group_id": batch.group_id, "ground_truth": batch.ground_truth}
