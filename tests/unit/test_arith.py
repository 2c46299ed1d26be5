"""The generated ``arith`` task (flowrl/data/arith.py): fixed items per seed, disjoint splits,
difficulty settings, its selection as ``data=arith``, and the verifier that scores it."""
import re

import pytest

from flowrl.data import ArithConfig, DataConfig, load_arith
from flowrl.data.arith import evaluate
from flowrl.data.prompts import ARITH_INSTRUCTION, DEFAULT_INSTRUCTION, load_records
from flowrl.rewards import gsm8k_reward

SMALL = dict(train_size=200, test_size=50)


def test_the_first_items_of_a_seed_are_fixed():
    cfg = ArithConfig(digits=2, num_operands=2, ops="+", **SMALL)
    assert load_arith("test", 3, cfg) == [
        {"question": "What is 63 + 78?", "answer": "63 + 78 = 141\n#### 141", "ground_truth": "141"},
        {"question": "What is 61 + 52?", "answer": "61 + 52 = 113\n#### 113", "ground_truth": "113"},
        {"question": "What is 62 + 19?", "answer": "62 + 19 = 81\n#### 81", "ground_truth": "81"}]
    assert [r["question"] for r in load_arith("train", 2, cfg)] == ["What is 15 + 26?",
                                                                   "What is 87 + 76?"]


def test_the_held_out_split_does_not_depend_on_the_train_size_and_another_seed_differs():
    a = load_arith("test", None, ArithConfig(**SMALL))
    assert load_arith("test", None, ArithConfig(train_size=5000, test_size=50)) == a
    assert load_arith("test", None, ArithConfig(seed=1, **SMALL)) != a
    assert len(a) == 50 and len(load_arith("train", None, ArithConfig(**SMALL))) == 200


def test_train_and_test_never_share_a_question():
    cfg = ArithConfig(digits=1, num_operands=2, ops="+", train_size=1000, test_size=40)
    test = [r["question"] for r in load_arith("test", None, cfg)]
    train = [r["question"] for r in load_arith("train", None, cfg)]
    assert cfg.space_size() == 81 and len(test) == 40 and len(train) == 41  # the rest of the space
    assert len(set(test)) == 40 and len(set(train)) == 41 and not set(test) & set(train)


def test_a_train_split_capped_by_the_expression_space_says_its_size_once(caplog):
    """train_size is an upper bound: the defaults draw 7,100 train items, not 20,000 (the README
    said 20,000); the realized count is logged, once per settings."""
    import logging

    from flowrl.data.arith import _generate

    _generate.cache_clear()  # the warning comes with the generation, which is cached
    with caplog.at_level(logging.INFO, logger="flowrl.data.arith"):
        assert len(load_arith("train")) == 7100 and len(load_arith("test")) == 1000
        assert len(load_arith("train", 5)) == 5
    assert [r.getMessage() for r in caplog.records] == [
        "data.arith: the train split has 7100 items, not train_size=20000: 2-digit expressions "
        "of 2 operands over '+' number 8100 and the test split holds 1000 of them"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flowrl.data.arith"):
        assert len(load_arith("train", None, ArithConfig(**SMALL))) == 200  # not capped: silent
    assert caplog.records == []


def test_difficulty_sets_operand_digits_count_and_operators():
    cfg = ArithConfig(digits=3, num_operands=4, ops="+-*", **SMALL)
    for r in load_arith("train", None, cfg):
        expr = r["question"].removeprefix("What is ").removesuffix("?").split(" ")
        operands, operators = [int(x) for x in expr[::2]], expr[1::2]
        assert len(operands) == 4 and all(100 <= x <= 999 for x in operands)
        assert set(operators) <= set("+-*")
        assert r["ground_truth"] == str(evaluate(operands, operators))
    ops = {op for r in load_arith("train", None, cfg) for op in r["question"].split(" ")[3::2]}
    assert ops == {"+", "-", "*"}


def test_evaluate_applies_precedence():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4], ["*", "-"]) == 2
    assert evaluate([10, 3, 4, 5], ["-", "*", "+"]) == 3
    assert evaluate([5, 7], ["-"]) == -2


@pytest.mark.parametrize("kw, msg", [
    (dict(digits=0), "data.arith.digits must be 1..9, got 0"),
    (dict(num_operands=1), "data.arith.num_operands must be >= 2, got 1"),
    (dict(ops="+/"), "data.arith.ops must be a non-empty string over '+-*', got '+/'"),
    (dict(test_size=0), "data.arith.train_size and test_size must be >= 1, got 20000 and 0"),
    (dict(digits=1, num_operands=2, ops="+", test_size=41),
     "data.arith: 1-digit expressions of 2 operands over '+' number 81; test_size=41 must be at "
     "most half of them"),
])
def test_bad_settings_are_one_clear_error(kw, msg):
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        ArithConfig(**kw)


def test_data_name_arith_loads_the_task_with_its_instruction():
    cfg = DataConfig(name="arith", arith=ArithConfig(digits=2, num_operands=2, ops="+", **SMALL))
    assert cfg.instruction == ARITH_INSTRUCTION and DataConfig().instruction == DEFAULT_INSTRUCTION
    rec = load_records(cfg, "test", 1, for_eval=True)[0]
    assert (rec["prompt"], rec["ground_truth"]) == ("What is 63 + 78?", "141")
    with pytest.raises(ValueError, match="data.name must be one of \\('gsm8k', 'arith', 'visual'\\), got 'x'"):
        DataConfig(name="x")


def test_data_option_selects_the_task_on_the_command_line(tmp_path):
    from flowrl.config import compose, to_train_config

    cfg = to_train_config(compose(["trainer.output_dir=/tmp/x"]))
    assert (cfg.data.name, cfg.data.arith.num_operands) == ("arith", ArithConfig().num_operands)
    # each dataset's own instruction, never the schema's default dataset's (GSM8K's)
    assert cfg.data.instruction == ARITH_INSTRUCTION
    own = tmp_path / "p.jsonl"
    own.write_text('{"prompt": "1 + 1?", "ground_truth": "2"}\n')
    cfg = to_train_config(compose([f"data.path={own}", "trainer.output_dir=/tmp/x"]))
    assert cfg.data.instruction == ""  # a file of your own: none
    cfg = to_train_config(compose(["data=arith", "data.arith.digits=3", "trainer.output_dir=/tmp/x"]))
    assert (cfg.data.name, cfg.data.arith.digits) == ("arith", 3)
    cfg = to_train_config(compose(["data=gsm8k", "trainer.output_dir=/tmp/x"]))
    assert (cfg.data.name, cfg.data.instruction) == ("gsm8k", DEFAULT_INSTRUCTION)
    # a graph's data block still wins over the data option (grpo_tools' longer prompt budget)
    cfg = to_train_config(compose(["graph=grpo_tools", "trainer.output_dir=/tmp/x"]))
    assert (cfg.data.name, cfg.data.max_prompt_tokens) == ("arith", 512)


@pytest.mark.parametrize("response, reward", [
    ("63 + 78 = 141", 1.0),              # the model's own format: the last number
    ("The answer is 141.", 1.0),
    ("#### 141", 1.0),
    ("63 + 78 = 141\n#### 140", 0.0),    # a #### line is the answer, even when the sum above is right
    ("63 + 78 = 131", 0.0),
    ("141 is 63 + 78", 0.0),             # the last number is 78
    ("#### 63", 0.0),                    # a number copied from the question earns nothing
    ("I cannot add these.", 0.0),        # no number at all
    ("", 0.0),
    ("141.0", 1.0),                      # numerically equal
    ("1,41", 0.0),                       # not a number with a thousands separator
])
def test_the_default_verifier_scores_arith_answers_exactly(response, reward):
    from flowrl.ops.reward import RuleRewardConfig

    d = RuleRewardConfig()
    assert gsm8k_reward(response, "141", format_score=d.format_score,
                        fallback_last_number=d.fallback_last_number) == reward
