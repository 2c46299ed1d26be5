"""GSM8K answer extraction and reward (case C10 plus edge cases)."""
import pytest

from flowrl.rewards import REWARD_FUNCTIONS, extract_gsm8k_answer, gsm8k_reward

LONG_TAIL = " More text follows. " * 25 + "Step 2: 17 apples, 3 pears, 99 plums."  # ~500 chars


@pytest.mark.parametrize("response, truth, reward", [
    # --- case C10, every row ---
    ("2+40=42\n#### 42\n" + LONG_TAIL, "42", 1.0),
    ("#### -3", "-3", 1.0),
    ("#### 3", "-3", 0.0),
    ("#### +7", "7", 1.0),
    ("#### 1,000", "1000", 1.0),
    # --- own rows ---
    ("#### 42.0", "42", 1.0),                      # decimal equal to an integer
    ("#### 42.50", "42.5", 1.0),                   # trailing zeros
    ("#### 0.5", "1/2", 0.0),                      # only decimals are numbers here
    ("The total is\n#### $1,000.", "1000", 1.0),   # currency, separator, trailing period
    ("#### 5\nwait, recheck\n#### 6", "6", 1.0),   # the LAST marker wins
    ("#### 6\nwait, recheck\n#### 5", "6", 0.0),
    ("I have no idea.", "6", 0.0),                 # no answer at all
    ("", "6", 0.0),
    ("#### -5", "5", 0.0),                         # negative vs positive
    ("#### 5", "-5", 0.0),
    ("####\n  18 dollars", "18", 1.0),             # answer on the next line
    ("#### 72 clips.", "72", 1.0),                 # trailing words
    ("#### 1,234,567", "1,234,567", 1.0),          # ground truth with separators
    ("#### \u22124", "-4", 1.0),                   # unicode minus
])
def test_gsm8k_reward_table(response, truth, reward):
    assert gsm8k_reward(response, truth) == reward


@pytest.mark.parametrize("text, expected", [
    ("#### 42", "42"),
    ("#### -3", "-3"),
    ("#### +7", "7"),
    ("#### 1,000", "1000"),
    ("#### $1,000.", "1000"),
    ("#### 42.0", "42"),
    ("#### 3.140", "3.14"),
    ("#### -0", "0"),
    ("#### -$12", "-12"),
    ("#### .5", "0.5"),
    ("#### 12-3", "12"),           # a binary minus is not a sign
    ("#### 1\n#### 2\n#### 3!", "3"),
    ("####", None),
    ("#### ,", None),               # never punctuation
    ("#### .", None),
    ("#### the answer\n 5", None),  # only the first non-empty line after the marker counts
    ("answer 41, so 42", None),     # no marker and no fallback
])
def test_extract(text, expected):
    assert extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("so the answer is 1,250.", "1250"),
    ("5 - 3 = 2", "2"),
    ("it is 7-3", "3"),             # binary minus, not -3
    ("#### none\nbut 12 apples then 13.", "13"),
    ("####", None),
    ("no digits here!", None),
    ("x = -8.", "-8"),
])
def test_extract_fallback_last_number(text, expected):
    assert extract_gsm8k_answer(text, fallback_last_number=True) == expected


def test_format_score_only_for_a_wrong_marker_answer():
    assert gsm8k_reward("#### 5", "6", format_score=0.1) == 0.1
    assert gsm8k_reward("#### 6", "6", format_score=0.1) == 1.0
    assert gsm8k_reward("the answer is 5", "6", format_score=0.1) == 0.0
    # a fallback answer never earns the format score
    assert gsm8k_reward("the answer is 5", "6", format_score=0.1, fallback_last_number=True) == 0.0
    assert gsm8k_reward("the answer is 6", "6", format_score=0.1, fallback_last_number=True) == 1.0


def test_fallback_is_off_by_default():
    assert gsm8k_reward("the answer is 6", "6") == 0.0
    assert gsm8k_reward("the answer is 6", "6", fallback_last_number=True) == 1.0


def test_unparsable_ground_truth_raises():
    with pytest.raises(ValueError, match="ground_truth must hold a number"):
        gsm8k_reward("#### 1", "n/a")


def test_registry():
    assert REWARD_FUNCTIONS["gsm8k"] is gsm8k_reward
    assert REWARD_FUNCTIONS["gsm8k"]("#### 1,000", "1000") == 1.0


@pytest.mark.parametrize("text, last", [
    ("1,2345", "2345"),            # not a thousands group: the scan restarts inside the run
    ("total 1,234,567.5 units", "1234567.5"),
    ("x-12", "12"),                # a word character before '-': a binary minus, no sign
    ("(-3", "-3"),
    ("a 7 then $-1,000", "-1000"),
    ("ends 4.", "4"),
    ("2.5.3", "0.3"),              # "2.5" then ".3"
    ("no digits at all", None),
    ("", None),
])
def test_the_last_number_is_the_whole_texts_last_match(text, last):
    assert extract_gsm8k_answer(text, fallback_last_number=True) == last


def test_the_last_number_scan_agrees_with_a_scan_of_the_whole_text():
    """The fallback scans only the run of number characters around the last digit; a full
    left-to-right scan of the text (the definition) must give the same number on any text."""
    import random
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.reward_stage import whole_text_number as whole_text
    from flowrl.rewards.gsm8k import _number_in

    rng = random.Random(0)
    alphabet = "0123456789,.$+-\u2212 )]ax\n#"
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        for last in (True, False):
            assert _number_in(text, last) == whole_text(text, last), (text, last)
