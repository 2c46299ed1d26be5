"""Vision-language batches: the sampling stage that also hands out each row's images, and the
rule that keeps vision tokens out of responses (``graphs/grpo_vl.yaml``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowrl.engines.base import RolloutBatch
from flowrl.ops.fields import ImagePrompts
from flowrl.ops.registry import register_op

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.ops.context import StageContext
    from flowrl.ops.spec import NoConfig


def vision_token_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's Qwen2-VL vision token ids (image, video, vision start/end) it has."""
    from flowrl.models.vision import VISION_TOKENS

    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    return [int(i) for i in ids if i is not None and i != tokenizer.unk_token_id]


def cut_at_vision_tokens(out: RolloutBatch, tokenizer: Any) -> RolloutBatch:
    """End each response *before* the first vision token it sampled.

    A sampled ``<|image_pad|>`` in a response would be read by the trainer's forward as an image
    slot with no image (transformers raises on the count mismatch), and no vision token is ever
    a meaningful answer: such a row keeps its tokens before it (mask True, trained on as usual),
    gets pad ids, mask False and logprob 0 from it on, and ``truncated`` True (it has no stop
    token). Rows without one are returned as they are.

    Args:
        out: the engine's batch; response_ids/response_mask/rollout_logprobs (B, R), truncated (B,).
    Returns:
        the batch with the cut applied (new tensors; ``out`` is unchanged).
    """
    import torch

    ids = torch.tensor(vision_token_ids(tokenizer), dtype=out.response_ids.dtype,
                       device=out.response_ids.device)
    hit = torch.isin(out.response_ids, ids) & out.response_mask.bool()
    if not bool(hit.any()):
        return out
    after = hit.long().cumsum(-1) > 0  # the first vision token and everything after it
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return RolloutBatch(
        response_ids=torch.where(after, torch.full_like(out.response_ids, int(pad)), out.response_ids),
        response_mask=out.response_mask & ~after,
        rollout_logprobs=torch.where(after, torch.zeros_like(out.rollout_logprobs),
                                     out.rollout_logprobs),
        truncated=out.truncated | hit.any(-1))


@register_op("data.sample_images")
def sample_images(ctx: StageContext, cfg: NoConfig) -> ImagePrompts:
    """data.sample for prompts with images: also the rows' pixel_values and image_grid_thw.

    ``data.sample`` for prompts with images (``data.image_column``, ``data=visual``).

    Outputs: ``data.sample``'s, plus pixel_values (B, N, D) float32 and image_grid_thw
    (B, K, 3) int64 (``flowrl.data.images``): store entries like any other, freed after their
    last consumer (the update).

    Raises:
        ValueError: the prompts hold no images (use ``graph=grpo`` for text).
    """
    source = ctx.run.prompts
    num_prompts = ctx.run.prompts_per_step
    batch = source.sample(num_prompts, ctx.run.algorithm.n)
    if batch.pixel_values is None or batch.image_grid_thw is None:
        raise ValueError(f"stage '{ctx.stage}' (data.sample_images): the prompts of "
                         f"{source.cfg.source_name} hold no images; set data.image_column, or "
                         "use a text graph (graph=grpo)")
    metrics: dict[str, float | Tensor] = {
        "data/prompts": num_prompts, "data/epoch": source.sampler.epoch,
        "data/skipped_prompts": source.num_skipped,
        "data/prompt_length_max": batch.prompt_ids.shape[1],
        "data/image_patches_mean": batch.image_grid_thw.prod(-1).sum(-1).float().mean()}
    ctx.log(**metrics)
    return {"prompt_ids": batch.prompt_ids, "prompt_mask": batch.prompt_mask,
            "group_id": batch.group_id, "ground_truth": batch.ground_truth,
            "pixel_values": batch.pixel_values, "image_grid_thw": batch.image_grid_thw}
