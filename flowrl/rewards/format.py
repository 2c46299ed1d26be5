"""Format rewards: does the RESPONSE follow the requested layout (not whether it is right).

Used as a shaping component next to a correctness verifier (``reward.mix``), e.g. the
DeepSeek-R1 style ``<think>...</think><answer>...</answer>`` layout (Guo et al. 2025, §2.2.2).
"""
from __future__ import annotations

import re
from functools import lru_cache

THINK_ANSWER = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
THINK = r"^\s*<think>.*?</think>.*\S.*$"


@lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


def regex_format_reward(response_text: str, ground_truth: str = "", *, pattern: str = THINK_ANSWER,
                        **_: object) -> float:
    """1.0 when the whole response matches ``pattern`` (``re.DOTALL``, ``fullmatch``), else 0.0.

    ``ground_truth`` is ignored (same signature as the correctness verifiers).

    Raises:
        re.error: an invalid ``pattern``.
    """
    return 1.0 if _compiled(pattern).fullmatch(response_text) else 0.0


def think_answer_format_reward(response_text: str, ground_truth: str = "", **_: object) -> float:
    """1.0 for ``<think>…</think>`` then ``<answer>…</answer>`` and nothing else around them."""
    return regex_format_reward(response_text, pattern=THINK_ANSWER)


def think_format_reward(response_text: str, ground_truth: str = "", **_: object) -> float:
    """1.0 for a response that opens with a closed ``<think>…</think>`` block followed by some
    non-blank text (the answer), else 0.0."""
    return regex_format_reward(response_text, pattern=THINK)


def gsm8k_format_reward(response_text: str, ground_truth: str = "", **_: object) -> float:
    """1.0 when the response ends with a GSM8K ``#### <number>`` answer line (right or wrong)."""
    from flowrl.rewards.gsm8k import extract_gsm8k_answer

    return 1.0 if extract_gsm8k_answer(response_text) is not None else 0.0
