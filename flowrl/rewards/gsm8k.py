"""GSM8K rule-based verifier: the number after the last ``####`` of a response, compared
numerically with the reference answer (case C10).

Only the RESPONSE is scored: callers pass the decoded response tokens, never prompt + response
(the prompt's own instruction mentions ``#### <number>``).
"""
from __future__ import annotations

import re
from collections import deque
from decimal import Decimal, InvalidOperation
from typing import Optional

MARKER = "####"

# An optional sign (not a binary minus: no word character or ')' right before it), an optional
# currency sign, then digits with optional thousands separators (groups of three only: "1,2,3" is
# a list, not 123) and an optional decimal part.
_NUMBER = re.compile(
    r"(?:(?<![\w)\]])(?P<sign>[-+\u2212]))?\$?"
    r"(?P<digits>(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)(?:\.\d+)?|\.\d+)")


def _canonical(sign: str, digits: str) -> Optional[str]:
    """``("-", "1,000.50") -> "-1000.5"``; integral decimals lose their fraction (``42.0 -> 42``)."""
    try:
        value = Decimal(digits.replace(",", ""))
    except InvalidOperation:
        return None
    if sign in ("-", "\u2212"):
        value = -value
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


# what a _NUMBER match is made of: a match never crosses any other character
_NUMBER_CHARS = frozenset("0123456789,.$+-\u2212")


def _last_match(text: str) -> Optional["re.Match[str]"]:
    """The last ``_NUMBER`` match of ``text``, scanning only the run of number characters around
    its last digit: the whole-text scan took 0.4 ms per 256-token response (0.1 s of a 256-row
    reward stage), and long reasoning texts scale it. Every digit lies in some match, so the last
    match ends at the last digit; it starts inside the maximal run of ``_NUMBER_CHARS`` ending
    there, and a left-to-right scan from that run's start (the lookbehind still sees the character
    before it) finds the same matches there as one from the text's start."""
    end = max(text.rfind(d) for d in "0123456789")
    if end < 0:
        return None
    start = end
    while start > 0 and text[start - 1] in _NUMBER_CHARS:
        start -= 1
    last = deque(_NUMBER.finditer(text, start, end + 1), maxlen=1)
    return last[0] if last else None


def _number_in(text: str, last: bool) -> Optional[str]:
    m = _last_match(text) if last else _NUMBER.search(text)
    if m is None:
        return None
    return _canonical(m.group("sign") or "", m.group("digits"))


def _extract(text: str, fallback_last_number: bool) -> tuple[Optional[str], bool]:
    """(canonical number or None, whether it came from a ``####`` marker)."""
    _, marker, tail = text.rpartition(MARKER)
    if marker:
        # the first number on the first non-empty line after the LAST marker
        line = tail.lstrip().split("\n", 1)[0]
        found = _number_in(line, last=False)
        if found is not None:
            return found, True
    if fallback_last_number:
        return _number_in(text, last=True), False
    return None, False


def extract_gsm8k_answer(text: str, *, fallback_last_number: bool = False) -> Optional[str]:
    """The final numeric answer of a GSM8K-style response, canonicalised.

    The answer is the first number on the first non-empty line after the LAST ``####``. Signs
    (``-3``, ``+7``, unicode minus), ``$``, thousands separators (``1,000``) and trailing text or
    punctuation are handled; the result is a plain decimal string: ``"-3"``, ``"7"``, ``"1000"``,
    ``"42"`` for ``42.0``, ``"0.5"``. With ``fallback_last_number`` a response without a usable
    ``####`` answer yields the last number of the whole text instead.

    Returns:
        The canonical number string, or None when there is no answer (never ``""`` and never
        punctuation).
    """
    return _extract(text, fallback_last_number)[0]


def _to_decimal(s: str) -> Optional[Decimal]:
    found = _number_in(s, last=False)
    return None if found is None else Decimal(found)


def gsm8k_reward(response_text: str, ground_truth: str, *, format_score: float = 0.0,
                 fallback_last_number: bool = False) -> float:
    """Score one decoded response against the GSM8K reference number.

    Args:
        response_text: the decoded RESPONSE tokens only.
        ground_truth: the reference number (``"72"``, ``"1,000"``, ``"-3"``).
        format_score: reward for a ``####`` answer that is wrong (a shaping bonus, default 0).
        fallback_last_number: also accept the last number of the text when there is no
            ``####`` answer (it earns 1.0 when right, 0.0 when wrong, never ``format_score``).

    Returns:
        1.0 if the answer equals the reference numerically (``42.0 == 42``), ``format_score`` if
        a ``####`` answer was given but is wrong, else 0.0.

    Raises:
        ValueError: ``ground_truth`` holds no number (a data error, not an unscorable response).
    """
    truth = _to_decimal(ground_truth)
    if truth is None:
        raise ValueError(f"gsm8k ground_truth must hold a number, got {ground_truth!r}")
    answer, from_marker = _extract(response_text, fallback_last_number)
    if answer is None:
        return 0.0
    if Decimal(answer) == truth:
        return 1.0
    return float(format_score) if from_marker else 0.0
