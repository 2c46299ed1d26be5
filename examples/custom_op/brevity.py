"""A reward op of your own: a bonus for short correct answers, added to the rule reward.

Registered with ``@register_op`` when the graph's ``imports: [brevity]`` imports this module
(from the directory flowrl runs in). Run from this directory:

    flowrl graph validate grpo_brevity.yaml
    flowrl train graph.path=grpo_brevity.yaml model=tiny trainer=smoke
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.ops.context import StageContext
from flowrl.ops.fields import Rewards
from flowrl.ops.registry import register_op


@dataclass
class BrevityConfig:
    """max_tokens: responses up to this many tokens earn the whole bonus; the bonus falls
    linearly to 0 at twice that. bonus: the bonus of a short correct answer (reward units)."""

    max_tokens: int = 64
    bonus: float = 0.1

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


# outputs: the keys of the return type (Rewards: ``rewards`` (B,) float32), which mypy checks
@register_op("reward.brevity", inputs=("rewards", "response_mask"), config=BrevityConfig)
def brevity(ctx: StageContext[None], cfg: BrevityConfig, *, rewards: torch.Tensor,
            response_mask: torch.Tensor) -> Rewards:
    """rewards (B,) float32 + bonus · clamp(2 - length / max_tokens, 0, 1) where rewards > 0
    (a correct answer; NaN stays NaN: an unscorable sample). response_mask: (B, R) bool.
    Logged: ``reward/brevity/bonus_mean``."""
    lengths = response_mask.sum(-1).float()
    scale = (2.0 - lengths / cfg.max_tokens).clamp(0.0, 1.0)
    bonus = torch.where(rewards > 0, cfg.bonus * scale, torch.zeros_like(scale))
    ctx.log(**{"reward/brevity/bonus_mean": bonus.mean()})
    return {"rewards": rewards + bonus}
