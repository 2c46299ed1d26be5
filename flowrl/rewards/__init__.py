"""Rule-based verifiers. ``REWARD_FUNCTIONS`` maps a scorer name to
``fn(response_text: str, ground_truth: str, **kwargs) -> float`` (the ``reward.rule`` op passes
``format_score`` and ``fallback_last_number``; scorers ignore what they do not use).

Every scorer reads the RESPONSE text only. User functions with prompt fields and metadata follow
the contract of ``flowrl.rewards.function`` (op ``reward.function``).
"""
from typing import Callable

from flowrl.rewards.format import (
                                   gsm8k_format_reward,
                                   regex_format_reward,
                                   think_answer_format_reward,
                                   think_format_reward,
)
from flowrl.rewards.gsm8k import extract_gsm8k_answer, gsm8k_reward
from flowrl.rewards.math import extract_boxed, math_reward, math_verify_reward

RewardFn = Callable[..., float]


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "gsm8k": gsm8k_reward,
    "math": math_reward,
    "math_verify": math_verify_reward,
    "format_think": think_format_reward,
    "format_think_answer": think_answer_format_reward,
    "format_gsm8k": gsm8k_format_reward,
}

__all__ = ["REWARD_FUNCTIONS", "RewardFn", "extract_boxed", "extract_gsm8k_answer", "gsm8k_reward",
           "math_reward", "math_verify_reward", "regex_format_reward", "think_answer_format_reward",
           "think_format_reward", "gsm8k_format_reward"]
