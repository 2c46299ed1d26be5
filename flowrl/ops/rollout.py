"""Generation through a generate role's engine (HF or vLLM: one seam): the student's ``rollout``
and, for SFT on teacher samples, the teacher's ``teacher_rollout``."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from flowrl.ops.fields import PROMPT, VISION, Generated, Rollout
from flowrl.ops.registry import register_op

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.engines.base import RolloutBatch, RolloutEngine, SamplingConfig
    from flowrl.ops.context import StageContext
    from flowrl.ops.spec import NoConfig


@register_op("rollout.generate", inputs=PROMPT, optional_inputs=VISION, roles=("rollout",))
def generate(ctx: StageContext[RolloutEngine], cfg: NoConfig, *, prompt_ids: Tensor,
             prompt_mask: Tensor, pixel_values: Tensor | None = None,
             image_grid_thw: Tensor | None = None) -> Rollout:
    """One response per prompt row with rollout.sampling.

    Generates with the run's ``rollout.sampling`` settings.

    Outputs: response_ids (B, R) int64 right-padded; response_mask (B, R) bool;
    rollout_logprobs (B, R) float32 at the sampling temperature (NaN in the valid tokens on a step
    ``rollout.sampling.logprobs`` does not measure: :func:`step_sampling`); truncated (B,) bool.
    With ``pixel_values`` / ``image_grid_thw`` (a vision-language batch, ``flowrl.data.images``)
    the engine sees the images, and a response ends before any vision token it samples
    (``flowrl.ops.vision.cut_at_vision_tokens``).
    """
    t0 = time.perf_counter()
    images = None
    if pixel_values is not None and image_grid_thw is not None:
        images = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    out = ctx.engine.generate(prompt_ids, prompt_mask, step_sampling(ctx),
                              generator=ctx.generator, images=images)
    if images is not None:
        from flowrl.ops.vision import cut_at_vision_tokens

        out = cut_at_vision_tokens(out, ctx.run.tokenizer)
    # rollout/empty_response_frac: no token at all, a generation that failed (the reward ops
    # mark it unscorable)
    log_samples(ctx, out, time.perf_counter() - t0)
    return {"response_ids": out.response_ids, "response_mask": out.response_mask,
            "rollout_logprobs": out.rollout_logprobs, "truncated": out.truncated}


def step_sampling(ctx: StageContext) -> "SamplingConfig":
    """``rollout.sampling`` for this step's generate call: ``logprobs=sampled`` becomes ``all``
    on the steps that measure them (``flowrl.engines.base.logprobs_measured``), else ``none``."""
    import dataclasses

    from flowrl.engines.base import logprobs_measured

    sampling = ctx.run.sampling
    if sampling.logprobs != "sampled":
        return sampling
    return dataclasses.replace(
        sampling, logprobs="all" if logprobs_measured(sampling.logprobs, ctx.step) else "none")


def log_samples(ctx: StageContext, out: "RolloutBatch", seconds: float, prefix: str = "") -> None:
    """Length, truncation, empty-response and throughput metrics of a generate call, each key
    under ``prefix`` (``teacher/`` for the teacher's samples, so they never overwrite the
    student's ``response/*`` in a graph that has both)."""
    lengths = out.response_mask.sum(-1).float()
    ctx.log(**{f"{prefix}{k}": v for k, v in {
        "response/length_mean": lengths.mean(), "response/length_max": lengths.max(),
        "response/truncated_frac": out.truncated.float().mean(),
        "rollout/empty_response_frac": (lengths == 0).float().mean(),
        "perf/rollout_tokens_per_s": lengths.sum() / max(seconds, 1e-9)}.items()})


@register_op("teacher.generate", inputs=PROMPT, roles=("teacher_rollout",))
def teacher_generate(ctx: StageContext[RolloutEngine], cfg: NoConfig, *, prompt_ids: Tensor,
                     prompt_mask: Tensor) -> Generated:
    """The teacher samples one response per prompt row with rollout.sampling (never synced).

    SFT on teacher samples (``graphs/sft_teacher.yaml``), with the run's ``rollout.sampling``
    settings, on the ``teacher_rollout`` role's engine: its own frozen copy of ``teacher.path``, never synced.

    Outputs: response_ids (B, R) int64 right-padded; response_mask (B, R) bool (the first stop
    token kept); truncated (B,) bool. Logged: ``teacher/response/length_mean`` and the rest of
    :func:`log_samples` under ``teacher/``.
    """
    import dataclasses

    t0 = time.perf_counter()
    # the teacher's logprobs are not an output here: ask its engine for none
    params = dataclasses.replace(ctx.run.sampling, logprobs="none")
    out = ctx.engine.generate(prompt_ids, prompt_mask, params, generator=ctx.generator)
    log_samples(ctx, out, time.perf_counter() - t0, prefix="teacher/")
    return {"response_ids": out.response_ids, "response_mask": out.response_mask,
            "truncated": out.truncated}
