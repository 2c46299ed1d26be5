"""GenRM score parser and judge template (flowrl/rewards/genrm.py)."""
import math

import pytest

from flowrl.rewards.genrm import (
    DEFAULT_JUDGE_TEMPLATE,
    mean_of_judgements,
    parse_judge_score,
    render_judge_prompt,
)


@pytest.mark.parametrize("text, score", [
    ("Score: 7/10", 0.7),
    ("[[7]]", 0.7),
    ("[[8.5]]", 0.85),
    ("[[3/5]]", 0.6),
    ("8 out of 10", 0.8),
    ("7/10", 0.7),
    ("Rating: 4.5", 0.45),
    ("I give it 4/5.", 0.8),
    ("The score is **9**", 0.9),
    ("Score: 7 out of 10", 0.7),
    ("rating of 9.5/10", 0.95),
    ("grade: 0", 0.0),
    ("10/10 would read again", 1.0),
    ("17/100", 0.17),
    ("Score: 3/10 ... on reflection, final Score: 6/10", 0.6),   # the last statement wins
    ("3/4 of 20 is 15, correct. Score: 8", 0.8),                 # reasoning fractions ignored
    ("Explanation [[2]] then Score: 9/10", 0.2),                  # [[x]] beats other forms
    ("Score (0-10): 9/10\n\nReferee: 72", 0.9),                   # a stated range is no score
    ("Score (0-10): 1\n\nRefer to this answer", 0.1),
    ("On a scale of 1 to 10, my rating is 8.", 0.8),
    ("Rating (1-5): 4", 0.4),                                     # default scale, not the range
])
def test_parse_judge_score_table(text, score):
    assert parse_judge_score(text) == pytest.approx(score, abs=1e-12)


@pytest.mark.parametrize("text", [
    "", "no idea", "The response is fine.", "took 3/4 of it", "Score: 12/10", "score -1",
    "score: 7/0", "7/10.5", "Steps 1/2 then rate it",
    "Score (0-10): 72\n\n[Sender]",                                 # out of range: no guess
    'the score is "Natalia sold 72 clips. 48 clips"',
])
def test_unparseable_is_nan(text):
    assert math.isnan(parse_judge_score(text))


def test_default_scale_applies_only_without_a_written_scale():
    assert parse_judge_score("Rating: 4", scale=5) == 0.8
    assert parse_judge_score("Rating: 4/10", scale=5) == 0.4
    assert math.isnan(parse_judge_score("[[6]]", scale=5))


def test_mean_of_judgements_skips_nan():
    assert mean_of_judgements([0.2, float("nan"), 0.6]) == pytest.approx(0.4)
    assert math.isnan(mean_of_judgements([float("nan")] * 3))


def test_render_template():
    text = render_judge_prompt(DEFAULT_JUDGE_TEMPLATE, question="Q?", response="R.", ground_truth="7")
    assert "[Question]\nQ?" in text and "[Response]\nR." in text and "[Reference answer]\n7" in text
    with pytest.raises(ValueError, match="stage 'judge': judge template has a bad placeholder"):
        render_judge_prompt("{answer}", question="", response="", stage="judge")
