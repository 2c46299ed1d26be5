"""Graph declaration, YAML round-trip and validation (one test per kind of error)."""
import warnings
from pathlib import Path

import pytest

from flowrl.graph import Graph, GraphError, UnusedOutputWarning, validate_graph

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "graphs" / "grpo.yaml"


def test_grpo_yaml_round_trips_identically():
    text = GRPO.read_text()
    assert Graph.from_yaml(text).to_yaml() == text


def test_python_api_example_builds_a_valid_graph_that_is_no_builtin_copy():
    from python_api import overlong_grpo_graph

    g = overlong_grpo_graph()
    text = g.to_yaml()
    assert Graph.from_yaml(text).to_yaml() == text
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedOutputWarning)
        assert validate_graph(g) == []
    assert [s.op for s in g.stages][2:5] == ["reward.rule", "reward.overlong", "reward.mix"]
    builtins = {p.read_text().split("\nname: ", 1)[1] for p in (REPO / "graphs").glob("*.yaml")}
    assert text.split("\nname: ", 1)[1] not in builtins  # an example, not a second source


def test_yaml_opens_with_run_command():
    first = GRPO.read_text().splitlines()[:4]
    assert all(line.startswith("#") for line in first)
    assert any("flowrl train graph=grpo" in line for line in first)


def test_grpo_graph_valid_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedOutputWarning)
        assert validate_graph(Graph.load(GRPO)) == []


def _tiny(**overrides):
    g = Graph("t")
    s = g.stage("sample", "data.sample")
    g.stage("rollout", "rollout.generate", role="rollout",
            inputs={"prompt_ids": s["prompt_ids"], "prompt_mask": s["prompt_mask"]})
    for name, fields in overrides.items():
        for k, v in fields.items():
            setattr(g[name], k, v)
    return g


def _problem(g):
    with pytest.raises(GraphError) as ei:
        validate_graph(g, require_update=False)  # fragments: sample -> rollout, no update
    return ei.value.problems


def test_unknown_op_names_stage_and_suggests():
    (stage, field, msg), = _problem(_tiny(rollout={"op": "rollout.generat"}))
    assert (stage, field) == ("rollout", "op") and "did you mean 'rollout.generate'" in msg


def test_unknown_role():
    probs = _problem(_tiny(rollout={"role": "rolout"}))
    assert ("rollout", "role") in [(s, f) for s, f, _ in probs]
    assert "did you mean 'rollout'" in probs[0][2]


def test_role_not_allowed_for_op():
    (stage, field, msg), = _problem(_tiny(rollout={"role": "ref"}))
    assert (stage, field) == ("rollout", "role") and "cannot run as role 'ref'" in msg


def test_misspelled_input_argument_is_one_problem_naming_the_fix():
    g = _tiny()
    g["rollout"].inputs = {"prompt_idz": "sample.prompt_ids", "prompt_mask": "sample.prompt_mask"}
    assert _problem(g) == [("rollout", "inputs.prompt_idz", "op 'rollout.generate' has no input "
                            "'prompt_idz'; rename it to 'prompt_ids'")]


def test_unbound_required_input_names_an_output_to_bind():
    g = _tiny()
    del g["rollout"].inputs["prompt_mask"]
    assert _problem(g) == [("rollout", "inputs.prompt_mask", "required input of op "
                            "'rollout.generate' is not bound: add 'inputs.prompt_mask: "
                            "<stage>.<output>' (e.g. 'sample.prompt_mask')")]


def test_misspelled_output_reference():
    g = _tiny()
    g["rollout"].inputs["prompt_ids"] = "sample.prompt_id"
    (stage, field, msg), = _problem(g)
    assert (stage, field) == ("rollout", "inputs.prompt_ids")
    assert msg == "reads 'sample.prompt_id', but stage 'sample' (op 'data.sample') has no " \
                  "output 'prompt_id'; did you mean 'sample.prompt_ids'?"


def test_unknown_stage_reference():
    g = _tiny()
    g["rollout"].inputs["prompt_mask"] = "sampel.prompt_mask"
    (stage, field, msg), = _problem(g)
    assert field == "inputs.prompt_mask"
    assert msg == "reads 'sampel.prompt_mask', but no stage is named 'sampel'; did you mean " \
                  "'sample.prompt_mask'?"


def test_malformed_reference():
    g = _tiny()
    g["rollout"].inputs["prompt_mask"] = "prompt_mask"
    (stage, field, msg), = _problem(g)
    assert field == "inputs.prompt_mask" and "stage.output" in msg


def test_duplicate_stage_names():
    g = _tiny()
    g.stage("sample", "data.sample")
    assert ("sample", "name", "duplicate stage name; rename one of them") in _problem(g)


def test_cycle_is_reported_with_its_path():
    g = Graph("cyc")
    g.stage("a", "logprobs", role="actor", inputs={
        "prompt_ids": "b.logprobs", "prompt_mask": "b.logprobs",
        "response_ids": "b.logprobs", "response_mask": "b.logprobs"})
    g.stage("b", "logprobs", role="ref", inputs={
        "prompt_ids": "a.logprobs", "prompt_mask": "a.logprobs",
        "response_ids": "a.logprobs", "response_mask": "a.logprobs"})
    (stage, field, msg), = _problem(g)  # one problem, at the reference declared backwards
    assert (stage, field) == ("a", "inputs.prompt_ids")
    assert msg.startswith("reads 'b.logprobs', which closes the cycle ")
    assert "a -> b -> a" in msg or "b -> a -> b" in msg


def test_bad_param_names_the_field():
    g = Graph.load(GRPO)
    g["reward"].params = {"verifer": "gsm8k"}
    (stage, field, msg), = _problem(g)
    assert (stage, field) == ("reward", "params") and "verifer" in msg


def test_bad_weight_sync():
    g = Graph.load(GRPO)
    g.weight_sync[0].dst = "rolout"
    g.weight_sync[0].staleness = -1
    fields = {(s, f) for s, f, _ in _problem(g)}
    assert fields == {("weight_sync[0]", "to"), ("weight_sync[0]", "staleness")}


def test_unused_output_warns():
    g = _tiny()
    with pytest.warns(UnusedOutputWarning, match="output 'group_id' is consumed by no stage"):
        found = validate_graph(g, require_update=False)
    assert any("rollout" in m and "rollout_logprobs" in m for m in found)


def test_malformed_yaml_fields_name_stage():
    with pytest.raises(GraphError) as ei:
        Graph.from_yaml("name: x\nstages:\n- name: a\n  op: data.sample\n  input: {}\n")
    assert ("a", "input") == ei.value.problems[0][:2]


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        Graph.load(REPO / "graphs" / "nope.yaml")
