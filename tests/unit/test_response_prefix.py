"""data.response_prefix (issue 15, item 11): a pre-filled response start such as ``<think>\\n``
sits on the prompt side of the batch (prompt ids end with its ids, no response token or mask
covers it), and rule rewards, reward functions and the evaluation score prefix + response."""
from __future__ import annotations

import json

import pytest
import torch

from flowrl.data import DataConfig, PromptSource
from flowrl.engines.base import RolloutBatch, SamplingConfig
from flowrl.models import ModelConfig, load_tokenizer
from flowrl.ops.context import StageContext
from flowrl.ops.reward import RuleRewardConfig, rule_reward

PREFIX = "<think>\n"
# a thinking template: its generation prompt opens the block itself
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
                     "{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())  # SmolLM2's bundled tokenizer (what model=tiny uses)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_prompt_ids_end_with_the_prefix_ids_and_nothing_else_changes(tok):
    plain = PromptSource(DataConfig(limit=4, shuffle=False), tok).sample(2, 3)
    pre = PromptSource(DataConfig(limit=4, shuffle=False, response_prefix=PREFIX), tok).sample(2, 3)
    k = len(_ids(tok, PREFIX))
    assert _ids(tok, PREFIX) == [44, 17400, 46, 198]  # '<', 'think', '>', '\n'
    assert pre.prompt_ids.shape == (6, plain.prompt_ids.shape[1] + k)
    for row in range(6):
        real = pre.prompt_ids[row][pre.prompt_mask[row]].tolist()
        assert real == plain.prompt_ids[row][plain.prompt_mask[row]].tolist() + _ids(tok, PREFIX)
        assert pre.prompt_text[row] == plain.prompt_text[row] + PREFIX
        assert pre.prompt_text[row].endswith("<|im_start|>assistant\n<think>\n")
    assert pre.group_id.tolist() == plain.group_id.tolist()


def test_a_template_that_opens_the_block_itself_gets_nothing_appended(tok):
    import copy

    thinking = copy.deepcopy(tok)
    thinking.chat_template = THINKING_TEMPLATE
    without = PromptSource(DataConfig(limit=2, shuffle=False), thinking).sample(2, 1)
    with_prefix = PromptSource(DataConfig(limit=2, shuffle=False, response_prefix=PREFIX),
                               thinking).sample(2, 1)
    assert torch.equal(with_prefix.prompt_ids, without.prompt_ids)  # no second <think>
    assert with_prefix.prompt_text == without.prompt_text
    assert all(t.endswith("assistant\n<think>\n") for t in without.prompt_text)


def test_no_response_token_or_mask_covers_the_prefix(tok):
    """The rollout engine continues after the prefix: it returns only the sampled tokens, so with
    max_new_tokens=2 (fewer than the prefix's 4 ids) response_mask is (B, 2) and the prefix
    stays in prompt_ids, where no loss reads."""
    from flowrl.engines.config import HFRolloutConfig
    from flowrl.engines.rollout.hf import HFRolloutEngine
    from flowrl.models import load_model, tiny_model_config

    batch = PromptSource(DataConfig(limit=2, shuffle=False, response_prefix=PREFIX), tok).sample(2, 1)
    torch.manual_seed(0)
    engine = HFRolloutEngine(load_model(ModelConfig(tiny=tiny_model_config("llama"))), tok,
                             HFRolloutConfig())
    out = engine.generate(batch.prompt_ids, batch.prompt_mask,
                          SamplingConfig(max_new_tokens=2, temperature=1.0))
    assert out.response_ids.shape == out.response_mask.shape == (2, 2)
    assert out.response_mask.sum().item() <= 4
    assert batch.prompt_ids[:, -4:].tolist() == [_ids(tok, PREFIX)] * 2


def _score(tok, texts: list[str], source, verifier: str = "format_think") -> list[float]:
    ids = [_ids(tok, t) for t in texts]
    width = max(len(i) for i in ids)
    response_ids = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros(len(ids), width, dtype=torch.bool)
    for r, row in enumerate(ids):
        response_ids[r, :len(row)], mask[r, :len(row)] = torch.tensor(row), True
    resources = {"tokenizer": tok} | ({"prompts": source} if source is not None else {})
    ctx = StageContext(stage="reward", step=1, resources=resources)
    out = rule_reward(ctx, RuleRewardConfig(verifier=verifier), response_ids=response_ids,
                      response_mask=mask, ground_truth=["4"] * len(ids))
    return out["rewards"].tolist()


def test_format_reward_scores_the_prefix_plus_the_response(tok):
    """format_think needs '<think>...</think>' then an answer: a response that only closes the
    block the prefix opened scores 1 with the prefix, 0 without (what the issue found)."""
    texts = ["2 + 2 = 4</think>\n#### 4", "no block at all", "4</think>",  # no answer after it
             "<think>opened again</think>\n#### 4"]
    with_prefix = PromptSource(DataConfig(limit=2, response_prefix=PREFIX), tok)
    without = PromptSource(DataConfig(limit=2), tok)
    assert _score(tok, texts, with_prefix) == [1.0, 0.0, 0.0, 1.0]
    assert _score(tok, texts, without) == [0.0, 0.0, 0.0, 1.0]
    assert _score(tok, texts, None) == [0.0, 0.0, 0.0, 1.0]  # no prompt source: no prefix


def test_reward_functions_get_prefix_plus_response(tok, tmp_path, monkeypatch):
    from flowrl.ops.reward import FunctionRewardConfig, function_reward

    (tmp_path / "seen_reward.py").write_text(
        "def reward(response_text, fields, metadata):\n"
        "    return float(response_text == '<think>\\n2</think> 4')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ids = torch.tensor([_ids(tok, "2</think> 4")])
    ctx = StageContext(stage="fn", step=1, resources={
        "tokenizer": tok, "prompts": PromptSource(DataConfig(limit=2, response_prefix=PREFIX), tok)})
    out = function_reward(ctx, FunctionRewardConfig(path="seen_reward:reward"), response_ids=ids,
                          response_mask=torch.ones_like(ids, dtype=torch.bool),
                          ground_truth=["4"], group_id=torch.tensor([0]))
    assert out["rewards"].tolist() == [1.0]


class _Scripted:
    """A rollout engine answering fixed texts (the greedy eval's contract)."""

    def __init__(self, tok, text: str):
        self.tok, self.text = tok, text

    def generate(self, prompt_ids, prompt_mask, params) -> RolloutBatch:
        row = _ids(self.tok, self.text)
        b = prompt_ids.shape[0]
        ids = torch.tensor([row] * b)
        return RolloutBatch(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros(ids.shape),
                            torch.zeros(b, dtype=torch.bool))


def test_the_evaluation_scores_prefix_plus_response(tok, tmp_path):
    from flowrl.ops.reward import RuleRewardConfig
    from flowrl.runtime.step.evaluate import evaluate_greedy, rule_eval_scorer

    src = PromptSource(DataConfig(response_prefix=PREFIX), tok)
    out = evaluate_greedy(_Scripted(tok, "4 it is</think>\n#### 4"), src, tok,
                          rule_eval_scorer(RuleRewardConfig("format_think", fallback_last_number=False)), split="test", limit=3, batch_size=2,
                          max_new_tokens=8, stop_token_ids=(), samples_path=tmp_path / "s.jsonl")
    assert out["eval/accuracy"] == 1.0 and out["eval/n"] == 3.0
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["response"] for r in rows] == ["<think>\n4 it is</think>\n#### 4"] * 3
    assert [r["length"] for r in rows] == [len(_ids(tok, "4 it is</think>\n#### 4"))] * 3


def test_a_non_string_prefix_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"data.response_prefix must be a string"):
        DataConfig(response_prefix=["<think>"])


def test_the_command_lines_escaped_newline_is_a_newline():
    """`"data.response_prefix='<think>\\n'"` reaches the config as backslash + n (Hydra keeps it):
    the prefix holds a real newline, as the README's command writes it."""
    from flowrl.config import compose, to_train_config

    node = compose(["model=tiny", "data.response_prefix='<think>\\n'", "trainer.output_dir=/tmp/x"])
    assert node.data.response_prefix == "<think>\\n"  # what Hydra hands over: backslash + n
    assert to_train_config(node).data.response_prefix == "<think>\n"
