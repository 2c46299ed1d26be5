"""Advantage stages: one op per estimator of ``flowrl.algorithms.advantages``."""
from __future__ import annotations

import torch

from flowrl.ops.context import StageContext
from flowrl.ops.registry import NoConfig, register_op


@register_op("advantage.grpo", inputs=("rewards", "group_id", "response_mask"),
             outputs=("advantages",))
def grpo(ctx: StageContext, cfg: NoConfig, *, rewards, group_id, response_mask) -> dict:
    """GRPO group-normalised advantages, (B, R) float32, 0 at masked positions
    (see ``algorithms.advantages.grpo_advantages``)."""
    from flowrl.algorithms.advantages import grpo_advantages

    algo = ctx.resource("algorithm")
    adv = grpo_advantages(rewards, group_id, response_mask, eps=algo.adv_eps,
                          norm_by_std=algo.norm_adv_by_std)
    seq = adv.sum(-1) / response_mask.sum(-1).clamp(min=1)
    ctx.log(**{"advantage/mean": seq.mean(), "advantage/abs_mean": seq.abs().mean(),
               "advantage/zero_frac": (seq == 0).float().mean()})
    return {"advantages": adv}
