"""Prompt sampling: the stage that starts every iteration."""
from __future__ import annotations

from flowrl.ops.context import StageContext
from flowrl.ops.registry import LIST, NoConfig, register_op


@register_op("data.sample",
             outputs=("prompt_ids", "prompt_mask", "group_id", "ground_truth"),
             kinds={"ground_truth": LIST})
def sample(ctx: StageContext, cfg: NoConfig) -> dict:
    """Draw ``trainer.prompts_per_step`` prompts and repeat each ``algorithm.n`` times.

    Outputs: prompt_ids/prompt_mask (B, P) int64/bool left-padded with B = prompts × n;
    group_id (B,) int64 assigned here, unique across steps and ranks (never inferred later from
    prompt text); ground_truth list[str] of length B.
    """
    source = ctx.resource("prompts")
    num_prompts = ctx.resource("trainer").prompts_per_step
    batch = source.sample(num_prompts, ctx.resource("algorithm").n)
    ctx.log(**{"data/prompts": num_prompts, "data/epoch": source.sampler.epoch})
    return {"prompt_ids": batch.prompt_ids, "prompt_mask": batch.prompt_mask,
            "group_id": batch.group_id, "ground_truth": batch.ground_truth}
