"""Rule-based verifiers. ``REWARD_FUNCTIONS`` maps a scorer name to
``fn(response_text: str, ground_truth: str, **kwargs) -> float``."""
from typing import Callable

from flowrl.rewards.gsm8k import extract_gsm8k_answer, gsm8k_reward

RewardFn = Callable[..., float]
REWARD_FUNCTIONS: dict[str, RewardFn] = {"gsm8k": gsm8k_reward}

__all__ = ["REWARD_FUNCTIONS", "RewardFn", "extract_gsm8k_answer", "gsm8k_reward"]
