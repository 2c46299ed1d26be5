"""Rule verifiers: every GSM8K row of case C10, thousands grouping, the \\boxed{} parser, the
math-verify equivalence reward and the format rewards, all scoring the response text only."""
import pytest

from flowrl.rewards import (
    REWARD_FUNCTIONS,
    extract_boxed,
    extract_gsm8k_answer,
    math_reward,
    math_verify_reward,
)
from flowrl.rewards.format import regex_format_reward

LONG_TAIL = " More text follows. " * 25 + "Step 2: 17 apples, 3 pears, 99 plums."  # ~500 chars


@pytest.mark.parametrize("response, truth, reward", [
    ("2+40=42\n#### 42\n" + LONG_TAIL, "42", 1.0),   # C10 row 1
    ("#### -3", "-3", 1.0),                           # C10 row 2
    ("#### 3", "-3", 0.0),                            # C10 row 3
    ("#### +7", "7", 1.0),                            # C10 row 4
    ("#### 1,000", "1000", 1.0),                      # C10 row 5
])
def test_c10_through_the_registry(response, truth, reward):
    assert REWARD_FUNCTIONS["gsm8k"](response, truth, format_score=0.0,
                                     fallback_last_number=False) == reward


@pytest.mark.parametrize("text, expected", [
    ("#### 1,000,000.50", "1000000.5"),
    ("#### 1,2,3", "1"),          # not a thousands grouping: "1,2,3" is a list, never 123
    ("#### 12,34", "12"),
    ("#### -1,000", "-1000"),
    ("#### 7.000", "7"),          # decimals equal to integers
])
def test_gsm8k_thousands_groups_of_three(text, expected):
    assert extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("so 1,2,3 and 4", "4"),
    ("it is 1,000,", "1000"),     # the trailing comma is punctuation, never the answer
    ("total: 5.", "5"),
    ("answer: ...", None),
])
def test_gsm8k_fallback_never_punctuation(text, expected):
    assert extract_gsm8k_answer(text, fallback_last_number=True) == expected


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),            # nested braces balanced
    (r"\boxed{x^{2}+\sqrt{y_{1}}}", r"x^{2}+\sqrt{y_{1}}"),
    (r"first \boxed{1}, then \fbox{2}", "2"),             # the last box wins, \fbox counts
    (r"\boxed{1} and finally \boxed{2", None),            # the final box is unclosed: no answer
    (r"\boxed{3", None),
    (r"\boxed{}", None),
    (r"\boxed{  }", None),
    (r"\boxed {7}", "7"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),                     # escaped braces are not structure
    (r"\boxed{a\}b}", r"a\}b"),
    ("no box at all", None),
    ("", None),
    (r"\boxed", None),
    ("}}}{{{", None),
])
def test_extract_boxed_table(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("response, truth, reward", [
    (r"The answer is \boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}/2", 1.0),
    (r"\boxed{x = 3}", "3", 1.0),
    (r"\boxed{\{2, 1\}}", r"\{1,2\}", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{4}", "3", 0.0),
    (r"\boxed{3} wait \boxed{4}", "4", 1.0),
    (r"\boxed{4} wait \boxed{3", "4", 0.0),               # unclosed last box: no answer
    ("the answer is 3", "3", 0.0),                        # unboxed answers do not count
    (r"\boxed{3}", r"\boxed{3}", 1.0),                    # a boxed reference is unwrapped
])
def test_math_reward_table(response, truth, reward):
    assert math_reward(response, truth) == reward
    assert REWARD_FUNCTIONS["math"](response, truth, format_score=0.0,
                                    fallback_last_number=False) == reward


def test_math_format_score_only_for_a_wrong_box():
    assert math_reward(r"\boxed{4}", "3", format_score=0.1) == 0.1
    assert math_reward("3", "3", format_score=0.1) == 0.0


def test_math_bad_ground_truth_is_a_data_error():
    with pytest.raises(ValueError, match="ground_truth must parse"):
        math_reward(r"\boxed{1}", "")


@pytest.mark.parametrize("response, truth, reward", [
    ("9 * 2 = 18 dollars.\n#### 18", "18", 1.0),
    ("She makes $18 every day.", "18", 1.0),            # no #### line: still right
    ("The answer is 18 dollars, after 3 days", "18", 1.0),  # an "answer is" statement wins
    ("18 dollars, and 3 eggs are left", "18", 0.0),     # else the LAST number counts
    ("#### 1,000", "1000", 1.0),
    ("#### 18.00", "18", 1.0),
    ("so x = 0.5", r"\frac{1}{2}", 1.0),
    (r"\boxed{7} wait, 8", "7", 1.0),                   # a box outranks later numbers
    ("The answer is -3.", "3", 0.0),
    ("I do not know", "5", 0.0),
    ("", "5", 0.0),
    # the question's own sum, repeated, is no answer (math-verify would evaluate it to 141)
    ("63 + 78 is a math problem that requires adding", "141", 0.0),
    ("84 + 25 = 84 + 25 = ", "109", 0.0),
    ("The sum is 9 * 2 = ", "18", 0.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"the product is $x^2$", "x^2", 1.0),              # a symbolic reference takes expressions
])
def test_math_verify_reward_table(response, truth, reward):
    assert math_verify_reward(response, truth) == reward
    assert REWARD_FUNCTIONS["math_verify"](response, truth, format_score=0.5,
                                           fallback_last_number=False) == reward


def test_math_verify_bad_ground_truth_is_a_data_error():
    with pytest.raises(ValueError, match="ground_truth must parse"):
        math_verify_reward("#### 1", "")


@pytest.mark.parametrize("name, text, reward", [
    ("format_think_answer", "<think>a\nb</think>\n<answer>42</answer>", 1.0),
    ("format_think_answer", "<think>a</think><answer>42</answer> trailing", 0.0),
    ("format_think_answer", "<answer>42</answer>", 0.0),
    ("format_think", "<think>work</think> 42", 1.0),
    ("format_think", "<think>work</think>   ", 0.0),
    ("format_think", "<think>unclosed 42", 0.0),
    ("format_gsm8k", "so\n#### 12", 1.0),
    ("format_gsm8k", "#### twelve", 0.0),
])
def test_format_rewards(name, text, reward):
    assert REWARD_FUNCTIONS[name](text, "ignored") == reward


def test_regex_format_reward_custom_pattern():
    assert regex_format_reward("Answer: 5", pattern=r"Answer: \d+") == 1.0
    assert regex_format_reward("Answer: 5!", pattern=r"Answer: \d+") == 0.0
