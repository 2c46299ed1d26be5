"""Generative reward model (GenRM, LLM-as-a-judge; Zheng et al. 2023 "Judging LLM-as-a-Judge"):
the judge prompt template and a robust parser for the score the judge writes.

The parser reads the LAST score statement of a judgement, normalised to [0, 1] by its scale:
``Score: 7/10`` → 0.7, ``[[7]]`` → 0.7 (MT-Bench's bracket format, default scale 10),
``8 out of 10`` → 0.8, ``Rating: 4.5`` → 0.45 (default scale 10), ``4/5`` → 0.8,
``Score (0-10): 9/10`` → 0.9 (a stated range is not a score). A bare
fraction counts only over 5, 10 or 100 (``3/4 of the apples`` is reasoning, not a score). Anything
it cannot read, or a value outside its scale, gives NaN (unscorable), never a guess.
"""
from __future__ import annotations

import math
import re

DEFAULT_JUDGE_TEMPLATE = (
    "Please act as an impartial judge and rate the response to the question below for "
    "correctness and clarity of reasoning.\n\n"
    "[Question]\n{question}\n\n[Response]\n{response}\n\n[Reference answer]\n{ground_truth}\n\n"
    "Reply with a short explanation, then the score on its own line as \"Score: X/10\"."
)

_NUM = r"([-+]?\d+(?:\.\d+)?)"
_SCALE = r"(?:\s*(?:/|out\s+of)\s*" + _NUM + r")?"
# Tried in this order, most explicit first; the LAST match of the first pattern that matches wins
# (judges restate the score at the end). Group 1 = value, group 2 = written scale (optional).
_PATTERNS: tuple[re.Pattern, ...] = (
    re.compile(r"\[\[\s*" + _NUM + _SCALE + r"\s*\]\]", re.IGNORECASE),          # [[7]], [[7/10]]
    re.compile(r"\b(?:score|rating|grade)\b[^\d\n]{0,12}?" + _NUM + r"\**" + _SCALE,
               re.IGNORECASE),                                                    # Score: 7/10
    re.compile(_NUM + r"\s*out\s+of\s*" + _NUM, re.IGNORECASE),                  # 8 out of 10
    # a bare fraction only with a usual rating scale: "3/4 of 20" in the reasoning is no score
    re.compile(r"(?<![\d.])" + _NUM + r"\s*/\s*(5|10|100)(?!\d|\.\d)"),             # 7/10
)


# a scale's RANGE ("(0-10)", "on a scale of 1 to 10") holds numbers that are not the score
_RANGES = re.compile(r"\(\s*\d+\s*(?:-|–|to)\s*\d+\s*\)|\bscale\s+(?:of|from)\s+\d+\s*(?:-|–|to)\s*\d+",
                     re.IGNORECASE)


def parse_judge_score(text: str, *, scale: float = 10.0) -> float:
    """The judge's score normalised to [0, 1], or NaN when there is none.

    Args:
        text: the judge's generated text.
        scale: maximum of a score written without its own scale (``[[7]]``, ``Rating: 4.5``).
            A written scale (``7/10``, ``4 out of 5``) always wins.

    Returns:
        ``value / scale`` as a float in [0, 1]; NaN for no score, a zero scale, or a value
        outside [0, scale]. Never raises.
    """
    text = _RANGES.sub(" ", text)
    for pattern in _PATTERNS:
        matches = list(pattern.finditer(text))
        if not matches:
            continue
        m = matches[-1]
        value = float(m.group(1))
        den = m.group(2)
        top = float(den) if den is not None else float(scale)
        if top <= 0 or not 0.0 <= value <= top:
            return float("nan")
        return value / top
    return float("nan")


def render_judge_prompt(template: str, *, question: str, response: str, ground_truth: str = "",
                        stage: str = "genrm") -> str:
    """Fill a judge template; its placeholders may be ``{question}``, ``{response}`` and
    ``{ground_truth}`` (literal braces doubled: ``{{``).

    Raises:
        ValueError: an unknown placeholder, naming the stage.
    """
    try:
        return template.format(question=question, response=response, ground_truth=ground_truth)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"stage '{stage}': judge template has a bad placeholder {e}; use "
                         "{question}, {response}, {ground_truth} (double literal braces)") from e


def mean_of_judgements(scores: list[float]) -> float:
    """Average of the parseable judgements (NaN ones left out); NaN when none parsed."""
    ok = [s for s in scores if math.isfinite(s)]
    return sum(ok) / len(ok) if ok else float("nan")
