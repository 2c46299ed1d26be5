"""Multi-turn rollouts (flowrl/envs, op rollout.multi_turn): a scripted policy and scripted
environments give exact response ids, masks, logprobs and turn metadata; tools (calculator,
a hanging, a raising, a garbage and a memory-hungry one) in the worker pool; token in, token out
and rollout == trainer logprobs with the real HF engine; config errors before any model loads."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import transformers

from flowrl.data.chat import (
    HERMES_TOOL_PROMPT,
    ObservationRenderer,
    apply_chat_template_with_tools,
    template_reads_tools,
)
from flowrl.engines.base import RolloutBatch, SamplingConfig
from flowrl.envs.base import EnvRow, StepResult
from flowrl.envs.calculator import CalculatorError, calculator, evaluate
from flowrl.envs.config import MultiTurnConfig
from flowrl.envs.library import GymnasiumEnvironment, ToolEnvironment, env_factory
from flowrl.envs.parsers import ParsedCall, parse_hermes
from flowrl.envs.rollout import MultiTurnSession, run_multi_turn
from flowrl.envs.tools import ToolRunner, check_schema, resolve_tools

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "flowrl/models/assets/smollm2-tokenizer"
EOS = PAD = 2
MOD = "mt_tools"  # tests/unit/mt_tools.py: importable by the spawned tool workers


@pytest.fixture(scope="module")
def tok():
    t = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    assert t.eos_token_id == EOS and t.pad_token_id == PAD
    return t


class ScriptedPolicy:
    """A RolloutEngine stand-in: row r's k-th turn is ``script[r][k] = (tokens, stopped)``; a
    row is recognised by its prompt. Logprob of the j-th token of turn k of row r:
    -(r + 1) - 0.1 * k - 0.01 * j. Honours ``max_new_tokens`` (a longer turn is cut and
    reported truncated) and records every call's contexts."""

    device = torch.device("cpu")
    shared = False

    def __init__(self, prompts, script):
        self.last_prefix_cache = {"prompt_tokens": 0, "cached_tokens": 0}
        self.prompts, self.script = [list(p) for p in prompts], script
        self.turn = defaultdict(int)
        self.calls = []  # (contexts without padding, max_new_tokens)

    def generate(self, ids, mask, params, generator=None):
        ctxs = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
        self.calls.append((ctxs, params.max_new_tokens))
        rows = []
        for c in ctxs:
            r = next(r for r, p in enumerate(self.prompts) if c[:len(p)] == p)
            k = self.turn[r]
            self.turn[r] += 1
            toks, stopped = self.script[r][k]
            if len(toks) > params.max_new_tokens:
                toks, stopped = toks[:params.max_new_tokens], False
            rows.append((toks, stopped, [-(r + 1) - 0.1 * k - 0.01 * j for j in range(len(toks))]))
        R = max(len(t) for t, _, _ in rows)
        out_ids = torch.full((len(rows), R), PAD, dtype=torch.long)
        out_mask = torch.zeros((len(rows), R), dtype=torch.bool)
        out_lps = torch.zeros((len(rows), R))
        for i, (t, _, lp) in enumerate(rows):
            out_ids[i, :len(t)] = torch.tensor(t)
            out_mask[i, :len(t)] = True
            out_lps[i, :len(t)] = torch.tensor(lp)
        return RolloutBatch(out_ids, out_mask, out_lps, torch.tensor([not s for _, s, _ in rows]))


class ScriptedEnv:
    """Step k of a row returns ``steps[row][k]`` (a StepResult); records the actions."""

    def __init__(self, steps):
        self.steps, self.actions = steps, []

    def reset(self, row):
        self.row = row

    def step(self, action):
        self.actions.append(action)
        return self.steps[self.row.index][action.turn]


PROMPTS = [[5, 6, 7], [8, 9]]


def prompt_batch(prompts=PROMPTS):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = True
    return ids, mask


def run(tok, script, steps, prompts=PROMPTS, tools_runner=None, **cfg):
    cfg = MultiTurnConfig(**cfg)
    policy = ScriptedPolicy(prompts, script)
    ids, mask = prompt_batch(prompts)
    rows = [EnvRow(index=i, prompt_ids=list(p)) for i, p in enumerate(prompts)]
    envs = [ScriptedEnv(steps) for _ in prompts]
    out = run_multi_turn(policy, ids, mask, rows, envs, SamplingConfig(max_new_tokens=8), cfg, tok,
                         render=ObservationRenderer(tok).render, run_tools=tools_runner)
    return out, policy, envs


# --------------------------------------------------------------------------- the turn loop
def test_two_turns_exact_ids_mask_logprobs_and_metadata(tok):
    script = {0: [([10, 11, EOS], True), ([12, EOS], True)], 1: [([13, EOS], True)]}
    steps = {0: [StepResult(token_ids=[100, 101], reward=0.25), StepResult(reward=1.0, done=True)],
             1: [StepResult(reward=0.5, done=True)]}
    out, policy, envs = run(tok, script, steps)
    assert out.response_ids.tolist() == [[10, 11, EOS, 100, 101, 12, EOS],
                                         [13, EOS, PAD, PAD, PAD, PAD, PAD]]
    assert out.response_mask.int().tolist() == [[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0]]
    lp = out.rollout_logprobs
    torch.testing.assert_close(lp[0], torch.tensor([-1.0, -1.01, -1.02, 0, 0, -1.1, -1.11]))
    torch.testing.assert_close(lp[1], torch.tensor([-2.0, -2.01, 0, 0, 0, 0, 0]))
    assert out.num_turns.tolist() == [2, 1] and out.finish_reason == ["answered", "answered"]
    assert out.rewards.tolist() == [1.25, 0.5] and out.truncated.tolist() == [False, False]
    assert out.turn_spans == [[(0, 3), (5, 7)], [(0, 2)]] and out.rounds == 2
    # token in, token out: round 2's context is the prompt + turn 1 + observation, id for id
    (ctx1, _), (ctx2, _) = policy.calls
    assert ctx1 == [[5, 6, 7], [8, 9]]
    assert ctx2 == [[5, 6, 7, 10, 11, EOS, 100, 101]]  # only the unfinished trajectory
    # the environment saw each turn's text and ids
    assert [a.token_ids for a in envs[0].actions] == [[10, 11, EOS], [12, EOS]]
    assert envs[0].actions[0].text == tok.decode([10, 11, EOS], skip_special_tokens=True)


def test_max_turns_drops_the_last_observation(tok):
    script = {0: [([10, EOS], True)] * 3, 1: [([13, EOS], True)] * 3}
    steps = {r: [StepResult(token_ids=[100 + k]) for k in range(3)] for r in (0, 1)}
    out, _, _ = run(tok, script, steps, max_turns=2)
    assert out.response_ids.tolist() == [[10, EOS, 100, 10, EOS], [13, EOS, 100, 13, EOS]]
    assert out.response_mask.int().tolist() == [[1, 1, 0, 1, 1]] * 2
    assert out.finish_reason == ["max_turns"] * 2 and out.num_turns.tolist() == [2, 2]


def test_token_budgets(tok):
    """max_total_tokens=6: row 0's second turn is cut to what is left (truncated, max_tokens);
    row 1's observation would fill the budget (dropped, max_tokens); per-turn limit 3."""
    script = {0: [([10, 11, EOS], True), ([12, 13, 14, EOS], True)],
              1: [([20, EOS], True)]}
    steps = {0: [StepResult(token_ids=[100]), StepResult(done=True)],
             1: [StepResult(token_ids=[100, 101, 102, 103])]}
    out, policy, _ = run(tok, script, steps, max_total_tokens=6, max_new_tokens_per_turn=3)
    assert out.response_ids.tolist() == [[10, 11, EOS, 100, 12, 13], [20, EOS, PAD, PAD, PAD, PAD]]
    assert out.response_mask.int().tolist() == [[1, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert out.finish_reason == ["max_tokens", "max_tokens"]
    assert out.truncated.tolist() == [True, True]  # both ran out of room before the end
    assert [m for _, m in policy.calls] == [3, 2]  # min(per turn, the most any row has left)


def test_engine_truncation_ends_the_trajectory(tok):
    script = {0: [([10, 11, 12, 13, 14, 15, 16, 17, 18], True)], 1: [([13, EOS], True)]}
    steps = {0: [StepResult(token_ids=[1])], 1: [StepResult(done=True)]}
    out, _, envs = run(tok, script, steps)  # sampling.max_new_tokens = 8
    assert out.response_mask.sum(-1).tolist() == [8, 2]
    assert out.finish_reason == ["max_tokens", "answered"] and out.truncated.tolist() == [True, False]
    assert envs[0].actions[0].truncated  # the environment still scored the cut-off turn


def test_continue_cut_turns(tok):
    """continue_cut_turns: a turn cut by the per-turn limit is stepped (the environment's
    observation follows it); the total budget still ends the trajectory as max_tokens."""
    script = {0: [([10, 11, 12, 13], True), ([14, 15, 16], True)], 1: [([20, EOS], True)]}
    steps = {0: [StepResult(token_ids=[100]), StepResult(done=True)], 1: [StepResult(done=True)]}
    out, _, envs = run(tok, script, steps, max_new_tokens_per_turn=3, continue_cut_turns=True,
                       max_total_tokens=6)
    assert out.response_ids.tolist() == [[10, 11, 12, 100, 14, 15], [20, EOS, PAD, PAD, PAD, PAD]]
    assert out.response_mask.int().tolist() == [[1, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert not envs[0].actions[0].truncated and envs[0].actions[1].truncated
    assert out.finish_reason == ["max_tokens", "answered"]


def test_observation_messages_are_rendered_by_the_chat_template(tok):
    script = {0: [([10, EOS], True), ([12, EOS], True)], 1: [([13, EOS], True)]}
    msg = [{"role": "tool", "content": "42"}]
    steps = {0: [StepResult(messages=msg), StepResult(done=True)], 1: [StepResult(done=True)]}
    out, _, _ = run(tok, script, steps)
    obs = tok("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n",
              add_special_tokens=False)["input_ids"]
    assert ObservationRenderer(tok).render(msg) == obs
    assert out.response_ids[0].tolist() == [10, EOS, *obs, 12, EOS]
    assert out.response_mask[0].tolist() == [True, True] + [False] * len(obs) + [True, True]


def test_bad_finish_reason_is_refused(tok):
    script = {0: [([10, EOS], True)], 1: [([13, EOS], True)]}
    steps = {r: [StepResult(done=True, finish_reason="bored")] for r in (0, 1)}
    with pytest.raises(ValueError, match="finish reason 'bored'"):
        run(tok, script, steps)


# --------------------------------------------------------------------------- tools
def call(name, **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def text_turn(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [EOS]


def test_hermes_parser():
    text = ('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
            '<tool_call>{"name": 5}</tool_call><tool_call>not json</tool_call><tool_call>{"name"')
    calls = parse_hermes(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("add", {"a": 1, "b": 2}),
                                                         ("add", {"a": 3, "b": 4})]
    assert [c.error is None for c in calls] == [True, True, False, False, False]
    assert "JSON object" in calls[2].error and "not valid JSON" in calls[3].error
    assert parse_hermes("no calls here") == []


def test_calculator_is_arithmetic_only():
    assert calculator("(48 / 2) * 3") == "72" and calculator("7 // 2 + 2 ** 3") == "11"
    assert calculator("1/3") == "0.3333333333" and calculator("-(2.5)") == "-2.5"
    assert evaluate("10 % 4") == 2
    for bad, why in [("__import__('os').system('true')", "Call"), ("x + 1", "Name"),
                     ("2 ** 100", "exponent"), ("1 / 0", "division by zero"),
                     ("[1, 2]", "List"), ("9" * 201, "longer"), ("10.0 ** 40", "out of range"),
                     ("1 +", "not an arithmetic"), ("True + 1", "Constant"), ("1j", "Constant")]:
        with pytest.raises(CalculatorError, match=why):
            calculator(bad)


def test_tool_schemas_resolve_and_are_checked():
    (calc,) = resolve_tools(["calculator"])
    assert calc.name == "calculator" and calc.path == "flowrl.envs.calculator:calculator"
    assert calc.parameters == {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": calc.parameters["properties"]
                       ["expression"]["description"]}}}
    (add,) = resolve_tools([f"{MOD}:add"])
    assert add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"]["type"] == "integer"
    schema = {"name": "plus", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    (plus,) = resolve_tools([{"path": f"{MOD}:add", "schema": json.dumps(schema)}])
    assert plus.name == "plus" and plus.schema["type"] == "function"
    with pytest.raises(ValueError, match=r"params.tools\[0\]: unknown tool 'calculater' \(did you mean 'calculator'\?\)"):
        resolve_tools(["calculater"])
    with pytest.raises(ValueError, match=r"params.tools\[1\]: the schema is not valid JSON"):
        resolve_tools(["calculator", {"path": f"{MOD}:add", "schema": "{'name': 1"}])
    with pytest.raises(ValueError, match=r"parameter 'a' has no JSON type"):
        check_schema({"name": "f", "parameters": {"type": "object", "properties": {"a": {}}}}, "t")
    with pytest.raises(ValueError, match=r"'required' must list"):
        check_schema({"name": "f", "parameters": {"type": "object", "properties": {},
                                                  "required": ["b"]}}, "t")
    with pytest.raises(ValueError, match=r"params.tools\[0\]: tool 'no_such_mod:f': cannot import 'no_such_mod'"):
        resolve_tools(["no_such_mod:f"])
    with pytest.raises(ValueError, match="two tools named 'calculator'"):
        resolve_tools(["calculator", "calculator"])


@pytest.fixture(scope="module")
def runner():
    tools = resolve_tools(["calculator", f"{MOD}:add", f"{MOD}:hangs", f"{MOD}:raises",
                           f"{MOD}:garbage", f"{MOD}:allocates"])
    r = ToolRunner(tools, num_workers=2, timeout_s=1.0, memory_mb=1024)
    yield r
    r.close()


def test_tool_failures_become_error_observations(runner):
    calls = [ParsedCall("calculator", {"expression": "6 * 7"}), ParsedCall("hangs", {"seconds": 30}),
             ParsedCall("raises", {"message": "boom"}), ParsedCall("garbage", {"n": 1}),
             ParsedCall("add", {"a": 1}), ParsedCall("nope", {}), ParsedCall(error="bad json"),
             ParsedCall("allocates", {"megabytes": 4096}), ParsedCall("add", {"a": 2, "b": 3})]
    res = runner.run(calls)
    assert [r.status for r in res] == ["ok", "timeout", "error", "bad_output", "bad_arguments",
                                       "unknown_tool", "parse_error", "error", "ok"]
    assert [r.ok for r in res] == [True] + [False] * 7 + [True]
    assert res[0].content == "42" and res[8].content == "5"
    assert res[1].content == "Error: hangs did not finish within 1 s"
    assert res[2].content == "Error: raises failed: RuntimeError('boom')"
    assert "MemoryError" in res[7].content  # the worker's address-space cap
    assert res[4].content == "Error: add: missing required argument(s) ['b']"
    # the pool goes on after the hang
    assert [r.content for r in runner.run([ParsedCall("add", {"a": 40, "b": 2})])] == ["42"]


def test_tool_env_trajectory_with_a_hanging_and_a_raising_tool(tok, runner):
    """Turn 1 calls the calculator, a hanging and a raising tool: three tool messages (two
    errors) come back, the trajectory goes on, turn 2 answers."""
    t1 = text_turn(tok, call("calculator", expression="2 + 3") + call("hangs", seconds=30)
                   + call("raises", message="boom"))
    t2 = text_turn(tok, "#### 5")
    prompts = [[5, 6, 7]]
    cfg = MultiTurnConfig(tools=["calculator", f"{MOD}:hangs", f"{MOD}:raises"], tool_workers=0)
    policy = ScriptedPolicy(prompts, {0: [(t1, True), (t2, True)]})
    ids, mask = prompt_batch(prompts)
    out = run_multi_turn(policy, ids, mask, [EnvRow(0, [5, 6, 7])], [ToolEnvironment()],
                         SamplingConfig(max_new_tokens=200), cfg, tok,
                         render=ObservationRenderer(tok).render, run_tools=runner.run)
    obs = ObservationRenderer(tok).render([
        {"role": "tool", "name": "calculator", "content": "5"},
        {"role": "tool", "name": "hangs", "content": "Error: hangs did not finish within 1 s"},
        {"role": "tool", "name": "raises", "content": "Error: raises failed: RuntimeError('boom')"}])
    assert out.response_ids[0].tolist() == t1 + obs + t2
    assert out.response_mask[0].tolist() == [True] * len(t1) + [False] * len(obs) + [True] * len(t2)
    assert out.num_turns.tolist() == [2] and out.num_tool_calls.tolist() == [3]
    assert out.num_tool_errors.tolist() == [2] and out.finish_reason == ["answered"]
    assert out.tool_s > 0.9  # the hang ran into its 1 s timeout
    # max_tool_errors=2: the same turn now ends the trajectory
    cfg2 = MultiTurnConfig(tools=cfg.tools, tool_workers=0, max_tool_errors=2)
    policy = ScriptedPolicy(prompts, {0: [(t1, True), (t2, True)]})
    out = run_multi_turn(policy, ids, mask, [EnvRow(0, [5, 6, 7])], [ToolEnvironment()],
                         SamplingConfig(max_new_tokens=200), cfg2, tok,
                         render=ObservationRenderer(tok).render, run_tools=runner.run)
    assert out.finish_reason == ["tool_failure"] and out.response_ids[0].tolist() == t1


def test_calls_in_the_last_allowed_turn_are_counted_not_run(tok):
    t1 = text_turn(tok, call("calculator", expression="1 + 1"))
    prompts = [[5, 6, 7]]
    policy = ScriptedPolicy(prompts, {0: [(t1, True)]})
    ids, mask = prompt_batch(prompts)
    out = run_multi_turn(policy, ids, mask, [EnvRow(0, [5, 6, 7])], [ToolEnvironment()],
                         SamplingConfig(max_new_tokens=100), MultiTurnConfig(
                             tools=["calculator"], max_turns=1), tok,
                         render=ObservationRenderer(tok).render, run_tools=None)  # never called
    assert out.finish_reason == ["max_turns"] and out.num_tool_calls.tolist() == [1]
    assert out.num_tool_errors.tolist() == [0] and out.response_ids[0].tolist() == t1


def test_tools_in_the_prompt(tok):
    schemas = [t.schema for t in resolve_tools(["calculator"])]
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    assert not template_reads_tools(tok)  # SmolLM2: the Hermes instructions go in the system turn
    text = apply_chat_template_with_tools(tok, msgs, schemas)
    assert text == ("<|im_start|>system\n" + HERMES_TOOL_PROMPT.format(tools=json.dumps(schemas[0]))
                    + "<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    # a template that reads `tools` gets them through apply_chat_template(tools=)
    reads = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    reads.chat_template = ("{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}"
                           "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert apply_chat_template_with_tools(reads, msgs, schemas) == "[calculator]What is 2 + 2?"


# --------------------------------------------------------------------------- environments
class EchoGymEnv:
    """A gymnasium-API text environment: terminates when the action says 'stop'."""

    def reset(self, seed=None, options=None):
        self.seed, self.options, self.t = seed, options, 0
        return "start", {}

    def step(self, action):
        self.t += 1
        return f"heard {self.t}", float(self.t), "stop" in action, self.t >= 3, {}


@pytest.mark.parametrize("kw", [{}, {"env_id": "CartPole-v1", "entry": f"{__name__}:X"}])
def test_gymnasium_adapter_needs_exactly_one_of_env_id_and_entry(kw):
    with pytest.raises(ValueError, match="exactly one of env_params.env_id"):
        GymnasiumEnvironment(**kw)


def test_gymnasium_adapter_duck_typed():
    env = env_factory("gymnasium", {"entry": f"{__name__}:EchoGymEnv"})()
    env.reset(EnvRow(index=0, prompt_ids=[1, 2], ground_truth="7", group_id=4))
    assert env.env.options == {"prompt_ids": [1, 2], "ground_truth": "7", "fields": {}}
    from flowrl.envs.base import Action
    r = env.step(Action("go", [1], 0))
    assert (r.messages, r.reward, r.done) == ([{"role": "user", "content": "heard 1"}], 1.0, False)
    assert env.step(Action("please stop", [1], 1)).done
    env.reset(EnvRow(index=0, prompt_ids=[1]))
    env.step(Action("a", [1], 0)), env.step(Action("b", [1], 1))
    last = env.step(Action("c", [1], 2))
    assert last.done and last.finish_reason == "max_turns"  # gym truncation = its time limit


def test_gymnasium_adapter_real_library():
    gym = pytest.importorskip("gymnasium")

    class Guess(gym.Env):
        def reset(self, seed=None, options=None):
            super().reset(seed=seed)
            self.target = str(options["ground_truth"])
            return "guess", {}

        def step(self, action):
            hit = action.strip() == self.target
            return ("right" if hit else "wrong"), float(hit), hit, False, {}

    import sys
    sys.modules[__name__].Guess = Guess
    env = GymnasiumEnvironment(entry=f"{__name__}:Guess")
    env.reset(EnvRow(index=0, prompt_ids=[1], ground_truth=7))
    from flowrl.envs.base import Action
    assert env.step(Action("6", [1], 0)).messages == [{"role": "user", "content": "wrong"}]
    assert env.step(Action("7", [1], 1)).done


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"params.max_turns must be an int >= 1, got 0"):
        MultiTurnConfig(max_turns=0)
    with pytest.raises(ValueError, match=r"params.max_total_tokens must be an int >= 1"):
        MultiTurnConfig(max_total_tokens=-3)
    with pytest.raises(ValueError, match=r"params.tool_call_format must be one of \['hermes'\]"):
        MultiTurnConfig(tool_call_format="xml")
    with pytest.raises(ValueError, match=r"params.env: unknown environment 'tool' \(did you mean 'tools'\?\)"):
        MultiTurnConfig(env="tool")
    with pytest.raises(ValueError, match=r"params.env_params: environment 'tools' does not take \['colour'\]"):
        MultiTurnConfig(env_params={"colour": "red"})
    with pytest.raises(ValueError, match=r"params.tools\[0\]: unknown tool"):
        MultiTurnConfig(tools=["abacus"])


def _compose(*overrides):
    from flowrl.config import compose

    return compose([*overrides, "trainer.output_dir=/tmp/flowrl-plan-only"])


def test_grpo_tools_prepares_and_puts_the_tools_in_every_prompt(tok):
    from flowrl.data import PromptSource
    from flowrl.train import prepare

    spec = prepare(_compose("graph=grpo_tools", "model=tiny"))
    cfg, plan = spec.config, spec.plan  # no model loaded
    assert [c.stage.op for c in plan.stages][:2] == ["data.sample", "rollout.multi_turn"]
    assert cfg.data.tools == [t.schema for t in resolve_tools(["calculator"])]
    cfg.data.limit = 2
    src = PromptSource(cfg.data, tok)
    assert "<tools>" in src.render(0)[0] and '"name": "calculator"' in src.render(0)[0]
    assert src.render(0)[0].endswith("<|im_start|>assistant\n")


def test_graph_errors_before_any_model_loads(tmp_path):
    from flowrl.graph import Graph
    from flowrl.train import ConfigError, prepare

    text = (Path(__file__).resolve().parents[2] / "graphs/grpo_tools.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("    tools:\n", "    max_turns: 0\n    tools:\n"))
    with pytest.raises(ConfigError, match=r"stage 'rollout', field 'params': .*params.max_turns must be an int >= 1, got 0"):
        prepare(_compose("graph=grpo_tools", f"graph.path={bad}"))
    bad.write_text(text.replace("- calculator", "- calculater"))
    with pytest.raises(ConfigError, match=r"stage 'rollout', field 'params': .*unknown tool 'calculater'"):
        prepare(_compose("graph=grpo_tools", f"graph.path={bad}"))
    # a multi-turn response wired into the generative judge, which reads the policy's text alone
    g = Graph.load(Path(__file__).resolve().parents[2] / "graphs/genrm_grpo.yaml")
    r = g["rollout"]
    r.op, r.params = "rollout.multi_turn", {"tools": ["calculator"]}
    path = tmp_path / "judge.yaml"
    path.write_text(g.to_yaml())
    with pytest.raises(ConfigError) as e:
        prepare(_compose("graph=genrm_grpo", f"graph.path={path}"))
    msg = str(e.value)
    assert "stage 'judge', field 'inputs.response_ids': op 'reward.genrm' cannot take multi-turn " \
           "responses: 'rollout.response_ids' (op 'rollout.multi_turn')" in msg
    assert "stage 'judge', field 'inputs.response_mask'" in msg


# --------------------------------------------------------------------------- real engine
class Recording:
    """Wraps an engine and records each call's contexts (padding removed)."""

    def __init__(self, engine):
        self.engine, self.device, self.contexts = engine, engine.device, []
        self.shared = engine.shared

    @property
    def last_prefix_cache(self):
        return self.engine.last_prefix_cache

    def generate(self, ids, mask, params, generator=None):
        self.contexts.append([ids[i][mask[i]].tolist() for i in range(ids.shape[0])])
        return self.engine.generate(ids, mask, params, generator=generator)


class CountdownEnv:
    """Answers every turn with the same observation until the third turn: done."""

    def reset(self, row):
        pass

    def step(self, action):
        if action.turn >= 2:
            return StepResult(done=True, reward=1.0)
        return StepResult(messages=[{"role": "user", "content": f"Turn {action.turn} read. Go on."}])


@pytest.mark.parametrize("padding_free", ["false", "true"])
def test_hf_engine_token_in_token_out_and_trainer_logprobs_match(tok, padding_free):
    """With the real HF engine (tiny Llama): each round's context is the previous round's
    context + the sampled turn + the observation, id for id; the trainer's recomputed logprobs
    of the policy tokens equal the rollout's (the mismatch metric), packed or padded."""
    from flowrl.engines.config import TrainEngineConfig
    from flowrl.engines.rollout.hf import HFRolloutEngine
    from flowrl.engines.train.local import LocalTrainEngine
    from flowrl.models.loading import ModelConfig, load_model, tiny_model_config

    model = load_model(ModelConfig(tiny=tiny_model_config("llama"), seed=3))
    engine = Recording(HFRolloutEngine(model, tok, shared=True))
    cfg = MultiTurnConfig(env=f"{__name__}:CountdownEnv", max_turns=3, max_total_tokens=200,
                          max_new_tokens_per_turn=12)
    session = MultiTurnSession(cfg, tok)
    prompts = [tok("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                   add_special_tokens=False)["input_ids"],
               tok("<|im_start|>user\nA longer question here<|im_end|>\n<|im_start|>assistant\n",
                   add_special_tokens=False)["input_ids"]]
    ids, mask = prompt_batch(prompts)
    gen = torch.Generator().manual_seed(0)
    # a random model almost never samples EOS: one id in five stops a turn (P(12 tokens without
    # a stop) = 7%), so turns end at different lengths and trajectories at different turns
    stops = list(range(3, tok.vocab_size, 5))
    out = session.run(engine, ids, mask, SamplingConfig(temperature=1.0, max_new_tokens=12,
                                                        stop_token_ids=stops), generator=gen)
    assert out.rounds >= 2 and out.num_turns.max() >= 2
    for i in range(2):  # every later round's context extends the earlier one, id for id
        seen = [c for ctxs in engine.contexts for c in ctxs if c[:len(prompts[i])] == prompts[i]]
        for a, b in zip(seen, seen[1:]):
            assert b[:len(a)] == a
        resp = out.response_ids[i][out.response_mask[i].flip(0).cummax(0).values.flip(0)].tolist()
        for c in seen:
            assert c[len(prompts[i]):] == resp[:len(c) - len(prompts[i])]
    trainer = LocalTrainEngine(model, TrainEngineConfig(padding_free=padding_free), trainable=False)
    lp = trainer.logprobs({"prompt_ids": ids, "prompt_mask": mask, "response_ids": out.response_ids,
                           "response_mask": out.response_mask}, temperature=1.0).logprobs
    m = out.response_mask
    assert (~m).any() and m.sum() > 10  # observation tokens between policy turns
    diff = (lp - out.rollout_logprobs).abs()[m]
    assert diff.max() < 1e-4, diff.max()
    # other observation ids in the context give other numbers: the trainer did read them
    ids2 = torch.where(m, out.response_ids, PAD)
    lp_blind = trainer.logprobs({"prompt_ids": ids, "prompt_mask": mask, "response_ids": ids2,
                                 "response_mask": m}, temperature=1.0).logprobs
    assert (lp_blind - out.rollout_logprobs).abs()[m].max() > 1e-2


def test_grpo_tools_graph_file_opens_with_the_command_and_sets_its_data():
    import warnings

    from flowrl.config import compose
    from flowrl.graph import Graph, UnusedOutputWarning, validate_graph

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "graphs/grpo_tools.yaml").read_text()
    assert any("flowrl train graph=grpo_tools" in l for l in text.splitlines() if l.startswith("#"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnusedOutputWarning)
        graph = validate_graph(Graph.from_yaml(text)) is not None and Graph.from_yaml(text)
    assert [str(w.message) for w in caught] == []  # metadata outputs may stay unconsumed
    # graph=grpo_tools applies the file's data block (the tool schema needs a longer prompt)
    assert graph.data["max_prompt_tokens"] == 512
    cfg = compose(["graph=grpo_tools"])
    assert cfg.data.max_prompt_tokens == 512 and cfg.graph.path == "graphs/grpo_tools.yaml"
    assert cfg.data.instruction.startswith("Use the calculator tool")


def test_the_calculators_declared_schema_is_what_its_docstring_says():
    from transformers.utils import get_json_schema

    from flowrl.envs.calculator import CALCULATOR_SCHEMA, calculator

    read = get_json_schema(calculator)
    read["function"].pop("return", None)
    assert read == CALCULATOR_SCHEMA
