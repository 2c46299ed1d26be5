"""Greedy evaluation: strict (#### n), math-verify and format fractions from scripted responses,
batching through the rollout engine, the whole split with limit=None, and the per-answer file."""
import json

import pytest
import torch

from flowrl.config import EvalConfig, to_train_config
from flowrl.data import DataConfig, PromptSource, load_gsm8k
from flowrl.engines.base import RolloutBatch
from flowrl.models import ModelConfig, load_tokenizer
from flowrl.ops.reward import RuleRewardConfig
from flowrl.runtime.step.evaluate import evaluate_greedy, rule_eval_scorer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


class ScriptedRollout:
    """Returns the next scripted response texts, in call order, and records each call's size
    and sampling parameters. ``truncated`` marks the rows whose text is listed in ``cut``."""

    def __init__(self, tok, texts, cut=()):
        self.tok, self.texts, self.cut, self.calls = tok, list(texts), set(cut), []

    def generate(self, prompt_ids, prompt_mask, params, generator=None):
        B = prompt_ids.shape[0]
        self.calls.append((B, params))
        texts, self.texts = self.texts[:B], self.texts[B:]
        ids = [self.tok.encode(t, add_special_tokens=False) for t in texts]
        R = max(len(i) for i in ids)
        response_ids = torch.full((B, R), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros(B, R, dtype=torch.bool)
        for b, row in enumerate(ids):
            response_ids[b, :len(row)] = torch.tensor(row)
            mask[b, :len(row)] = True
        return RolloutBatch(response_ids, mask, torch.zeros(B, R),
                            torch.tensor([t in self.cut for t in texts]))


def test_three_scores_and_batches(tok, tmp_path):
    truths = [r["ground_truth"] for r in load_gsm8k("test", limit=5)]
    texts = [f"2 + 2 = 4, so\n#### {truths[0]}",          # strict, math-verify, format
             f"So the answer is {truths[1]}.",              # math-verify only: no #### line
             "#### 123456789",                              # formatted, wrong
             "I am not sure",                               # nothing
             f"{truths[4]} first, then 1, 2 and #### 7"]   # wrong #### answer; math-verify: 7
    engine = ScriptedRollout(tok, texts, cut={"I am not sure"})
    src = PromptSource(DataConfig(), tok)
    out = evaluate_greedy(engine, src, tok, rule_eval_scorer(RuleRewardConfig(fallback_last_number=False)), split="test", limit=5, batch_size=2,
                          max_new_tokens=7, stop_token_ids=(5,), samples_path=tmp_path / "s.jsonl")
    assert [b for b, _ in engine.calls] == [2, 2, 1]
    params = engine.calls[0][1]
    assert (params.temperature, params.max_new_tokens, params.stop_token_ids) == (0.0, 7, [5])
    lengths = [len(tok.encode(t, add_special_tokens=False)) for t in texts]
    assert out["eval/n"] == 5.0
    assert out["eval/accuracy"] == out["eval/accuracy_strict"] == pytest.approx(1 / 5)
    assert out["eval/accuracy_math_verify"] == pytest.approx(2 / 5)
    assert out["eval/format_frac"] == pytest.approx(3 / 5)
    assert out["eval/math_verify_unformatted_frac"] == pytest.approx(1 / 5)
    assert out["eval/reward_mean"] == pytest.approx(1 / 5)
    assert out["eval/truncated_frac"] == pytest.approx(1 / 5)
    assert out["eval/response_length_mean"] == pytest.approx(sum(lengths) / 5)
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["ground_truth"] for r in rows] == truths
    assert [r["response"] for r in rows] == texts
    assert [(r["strict"], r["math_verify"], r["format"]) for r in rows] == [
        (1.0, 1.0, 1.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0)]
    assert [r["truncated"] for r in rows] == [False, False, False, True, False]


def test_limit_none_is_the_whole_split_and_zero_is_none(tok):
    engine = ScriptedRollout(tok, ["#### 0"] * 1319)
    src = PromptSource(DataConfig(), tok)
    out = evaluate_greedy(engine, src, tok, rule_eval_scorer(RuleRewardConfig(fallback_last_number=False)), split="test", limit=None,
                          batch_size=2048, max_new_tokens=4)
    assert [b for b, _ in engine.calls] == [1319]  # one generate call for the whole split
    zero = sum(r["ground_truth"] == "0" for r in load_gsm8k("test"))
    assert out["eval/n"] == 1319.0 and out["eval/format_frac"] == 1.0
    assert out["eval/accuracy_strict"] == pytest.approx(zero / 1319)
    assert evaluate_greedy(engine, src, tok, rule_eval_scorer(RuleRewardConfig(fallback_last_number=False)), split="test", limit=0, batch_size=1,
                           max_new_tokens=4) == {}


def test_eval_config_limit_null_means_all():
    assert EvalConfig(limit=None).limit is None
    assert to_train_config({"trainer": {"eval": {"limit": None}}}).trainer.eval.limit is None
    with pytest.raises(ValueError, match="limit must be >= 0 or null"):
        EvalConfig(limit=-1)


def test_gpu_recipe_evaluates_the_whole_split():
    from flowrl.config import compose

    cfg = to_train_config(compose(["trainer=gsm8k_gpu", "rollout=vllm", "trainer.output_dir=/tmp/x"]))
    assert cfg.trainer.eval.limit is None and cfg.trainer.eval.before and cfg.trainer.eval.after
    assert cfg.trainer.eval.batch_size >= 1319  # one generate call for the split
    assert (cfg.trainer.prompts_per_step, cfg.algorithm.n, cfg.rollout.backend) == (64, 8, "vllm")
    assert cfg.trainer.eval.max_new_tokens == cfg.rollout.sampling.max_new_tokens


def test_the_eval_scores_with_the_graphs_own_verifier():
    """eval_scorer reads the graph: its reward.rule stage's verifier and settings (format_score
    would shape eval/reward_mean, never accuracy); the GSM8K views come only with the gsm8k verifier."""
    from flowrl.compiler.plan import compile_plan
    from flowrl.config import REPO_ROOT
    from flowrl.graph import Graph
    from flowrl.runtime.step.evaluate import eval_scorer

    run = {"algorithm": {"recompute_old_logprobs": True, "kl_coef": 0.0}}
    graph = Graph.load(REPO_ROOT / "graphs/grpo.yaml")
    s = eval_scorer(compile_plan(graph, run))
    assert s.name == "reward.rule gsm8k (stage 'reward')"
    # no format bonus, and the last number answers when there is no #### line (RuleRewardConfig)
    assert s.score(["#### 4", "#### 5", "4", "x"], [{"ground_truth": "4"}] * 4,
                   [0, 1, 2, 3]) == [1.0, 0.0, 1.0, 0.0]
    assert s.lenient is not None and s.answer_format is not None
    with pytest.raises(ValueError, match="gsm8k ground_truth must hold a number, got 'forty'"):
        s.check_ground_truth("forty")
    graph["reward"].params["verifier"] = "math_verify"
    s = eval_scorer(compile_plan(graph, run))
    assert s.name == "reward.rule math_verify (stage 'reward')" and s.lenient is None
    assert s.score([r"so \boxed{4}"], [{"ground_truth": "4"}], [0]) == [1.0]


def test_eval_line_says_how_many_answers_could_not_be_scored():
    from flowrl.runtime.step.evaluate import eval_line

    base = {"eval/accuracy": 0.0, "eval/n": 8.0}
    assert eval_line({**base, "eval/unscorable_frac": 0.0}) == "accuracy 0.000 on 8"
    assert eval_line(base) == "accuracy 0.000 on 8"
    assert eval_line({**base, "eval/unscorable_frac": 0.375}) == (
        "accuracy 0.000 on 8; 3 of 8 answers could not be scored (the reward function raised "
        "or timed out: counted as wrong)")
    assert eval_line({"eval/accuracy": float("nan"), "eval/n": 8.0, "eval/unscorable_frac": 1.0}) \
        == ("no accuracy on 8: none of the 8 answers could be scored (the reward function "
            "raised or timed out on every one; the run's warnings say why)")


def test_an_eval_with_no_scorable_answer_has_no_accuracy(tok):
    """A reward function that raised on every answer: eval/accuracy was 0.000, read as a model
    that learned nothing; now NaN (the unscorable share says why)."""
    import math

    from flowrl.runtime.step.evaluate import EvalScorer

    engine = ScriptedRollout(tok, ["#### 1", "#### 2", "#### 3"])
    src = PromptSource(DataConfig(), tok)
    raising = EvalScorer("reward.function f", lambda texts, fields, rows: [math.nan] * len(texts))
    out = evaluate_greedy(engine, src, tok, raising, split="test", limit=3, batch_size=3,
                          max_new_tokens=4)
    assert math.isnan(out["eval/accuracy"]) and math.isnan(out["eval/accuracy_strict"])
    assert out["eval/unscorable_frac"] == 1.0 and math.isnan(out["eval/reward_mean"])
    half = EvalScorer("reward.function f", lambda texts, fields, rows: [1.0, math.nan, 0.0])
    engine = ScriptedRollout(tok, ["#### 1", "#### 2", "#### 3"])
    out = evaluate_greedy(engine, src, tok, half, split="test", limit=3, batch_size=3,
                          max_new_tokens=4)
    assert out["eval/accuracy"] == pytest.approx(1 / 3)  # the unscorable one counts as wrong
