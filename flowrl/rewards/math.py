"""Math verifiers built on the ``math-verify`` library (Hugging Face):

- ``math_reward``: the last ``\\boxed{...}`` (or ``\\fbox{...}``) of a response, checked for
  mathematical equivalence with the reference (a boxed answer is required);
- ``math_verify_reward``: no required format: math-verify finds the final answer in the response
  itself (what the GSM8K evaluation reports next to the strict ``#### n`` verifier).

Only the RESPONSE is scored (callers pass the decoded response tokens); a prompt's few-shot
``\\boxed{}`` examples therefore never count.
"""
from __future__ import annotations

import logging
import re
from typing import Optional

log = logging.getLogger(__name__)

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _closing_brace(text: str, start: int) -> Optional[int]:
    """Index of the ``}`` closing the ``{`` just before ``start`` (escaped ``\\{``/``\\}`` are
    literal characters, not braces), or None when it never closes."""
    depth, i = 1, start
    while i < len(text):
        c = text[i]
        if c == "\\":  # skip the escaped character (\{, \}, \\)
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_boxed(text: str) -> Optional[str]:
    """Content of the LAST ``\\boxed{...}``/``\\fbox{...}`` of ``text``, braces balanced.

    ``"so \\boxed{\\frac{1}{2}}."`` → ``"\\frac{1}{2}"``; a box whose brace never closes gives
    None (a truncated response has no answer, whatever earlier boxes said), as does an empty box
    (``\\boxed{ }``). Never raises.
    """
    last: Optional[str] = None
    for m in _BOX.finditer(text):
        end = _closing_brace(text, m.end())
        # later boxes win, even an unclosed one: the response's final word is what counts
        last = None if end is None else text[m.end():end].strip()
    return last or None


def _parse(expr: str):
    from math_verify import parse

    return parse(f"${expr}$")


def math_reward(response_text: str, ground_truth: str, *, format_score: float = 0.0,
                **_: object) -> float:
    """Score a response whose final answer is boxed.

    Args:
        response_text: decoded RESPONSE tokens only.
        ground_truth: reference answer as LaTeX or plain text (``"\\frac{1}{2}"``, ``"0.5"``,
            ``"\\boxed{3}"`` — a boxed reference is unwrapped first).
        format_score: reward for a boxed answer that is not equivalent (shaping, default 0).

    Returns:
        1.0 when ``math_verify.verify(gold, answer)`` holds (``\\frac{1}{2}`` = ``0.5``,
        ``x=3`` = ``3``, ``\\{1,2\\}`` = ``\\{2,1\\}``), ``format_score`` for a boxed but wrong or
        unparseable answer, 0.0 without a (closed) box.

    Raises:
        ValueError: ``ground_truth`` parses to nothing (a data error, not an unscorable sample).
    """
    from math_verify import verify

    gold_text = extract_boxed(ground_truth) or ground_truth
    gold = _parse(gold_text)
    if not gold:
        raise ValueError(f"math ground_truth must parse as an expression, got {ground_truth!r}")
    answer = extract_boxed(response_text)
    if answer is None:
        return 0.0
    pred = _parse(answer)
    if pred and verify(gold, pred):
        return 1.0
    return float(format_score)


def math_verify_reward(response_text: str, ground_truth: str, **_: object) -> float:
    """Format-free answer check: math-verify picks the final answer out of the whole response
    and compares it with the reference.

    ``math_verify.parse`` with its default extraction (LaTeX and plain expressions) takes, in its
    order of priority, a ``\\boxed{}`` answer, an "answer is ..."/"Answer: ..." statement, else the
    LAST number or expression of the text; ``verify`` then tests equivalence (``18.00`` = ``18``,
    ``1,000`` = ``1000``, ``1/2`` = ``0.5``). It credits a right number however it is written
    (``"#### 18"``, ``"so she makes $18."``, ``"\\boxed{18}"``), so on GSM8K the gap to the strict
    ``#### n`` verifier is the answer format, not the arithmetic. A numeric reference needs a
    numeric answer: math-verify would evaluate an extracted expression itself, so a response that
    only repeats the question's sum (``"63 + 78 is a math problem"``, reference 141) or stops at
    ``"... 9 * 2 = "`` scored 1 (found on the arith task's eval by a fresh-user check); it scores 0.

    Args:
        response_text: decoded RESPONSE tokens only.
        ground_truth: the reference answer (``"18"``, ``"-3"``, ``"\\frac{1}{2}"``; a boxed
            reference is unwrapped first).

    Returns:
        1.0 when the extracted answer is equivalent to the reference, else 0.0 (a different answer
        or none found). Never ``format_score``: there is no format to reward.

    Raises:
        ValueError: ``ground_truth`` parses to nothing (a data error, not an unscorable sample).
    """
    from math_verify import parse, verify

    gold = _parse(extract_boxed(ground_truth) or ground_truth)
    if not gold:
        raise ValueError(f"math_verify ground_truth must parse as an expression, got {ground_truth!r}")
    pred = parse(response_text)
    if not pred:
        return 0.0
    if getattr(gold[0], "is_Number", False) and not getattr(pred[0], "is_Number", False):
        return 0.0  # an unevaluated expression ("63 + 78") is the question, not an answer
    return 1.0 if verify(gold, pred) else 0.0
