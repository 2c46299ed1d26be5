"""Rule-based reward stage: decode the response only and score it with a verifier."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from flowrl.ops.context import StageContext
from flowrl.ops.registry import register_op

log = logging.getLogger(__name__)


@dataclass
class RuleRewardConfig:
    """verifier: key in ``flowrl.rewards.REWARD_FUNCTIONS``; format_score: reward for a
    well-formed but wrong answer; fallback_last_number: accept the last number when no ``####``."""

    verifier: str = "gsm8k"
    format_score: float = 0.0
    fallback_last_number: bool = False

    def __post_init__(self) -> None:
        from flowrl.rewards import REWARD_FUNCTIONS

        if self.verifier not in REWARD_FUNCTIONS:
            raise ValueError(f"verifier must be one of {sorted(REWARD_FUNCTIONS)}, got {self.verifier!r}")


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Text of the valid response tokens only (never the prompt or the template's prefill)."""
    return [tokenizer.decode(ids[m].tolist(), skip_special_tokens=True)
            for ids, m in zip(response_ids, response_mask)]


@register_op("reward.rule", inputs=("response_ids", "response_mask", "ground_truth"),
             outputs=("rewards",), config=RuleRewardConfig)
def rule_reward(ctx: StageContext, cfg: RuleRewardConfig, *, response_ids, response_mask,
                ground_truth) -> dict:
    """Score each response against its ground truth.

    Output: rewards (B,) float32; NaN marks an unscorable sample (the verifier raised or returned a
    non-finite value): it is counted in ``reward/unscorable`` and excluded from group statistics.
    Logged: reward mean/std over scorable samples, accuracy (reward == 1).
    """
    from flowrl.rewards import REWARD_FUNCTIONS

    fn = REWARD_FUNCTIONS[cfg.verifier]
    texts = decode_responses(ctx.resource("tokenizer"), response_ids, response_mask)
    scores = []
    for text, gt in zip(texts, ground_truth):
        try:
            r = float(fn(text, gt, format_score=cfg.format_score,
                         fallback_last_number=cfg.fallback_last_number))
            scores.append(r if math.isfinite(r) else float("nan"))
        except Exception as e:  # a verifier bug must not kill the run: mark the sample unscorable
            log.warning("stage %s: verifier %s raised %r; sample marked unscorable", ctx.stage, cfg.verifier, e)
            scores.append(float("nan"))
    rewards = torch.tensor(scores, dtype=torch.float32)
    ok = torch.isfinite(rewards)
    valid = rewards[ok]
    ctx.log(**{
        "reward/mean": valid.mean() if valid.numel() else float("nan"),
        "reward/std": valid.std() if valid.numel() > 1 else 0.0,
        "reward/accuracy": (valid == 1.0).float().mean() if valid.numel() else 0.0,
        "reward/unscorable": (~ok).sum(),
    })
    return {"rewards": rewards}
