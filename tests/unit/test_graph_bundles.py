"""Bundles: a graph file's named groups of wires (``bundles:``), bound by a stage's ``batch``.

The loader expands them before any check, so every graph compiles to the wiring it had when
each stage wrote its inputs out (``plan_snapshots/graph_wiring.json``: the wiring of graphs/*.yaml
before the files used bundles, stage by stage), and a problem still names the stage and field."""
import json
from pathlib import Path

import pytest

from flowrl.graph import Graph
from flowrl.graph.graph import GraphError, build_dag
from flowrl.graph.validate import graph_from_yaml, load_graph, validate_graph

REPO = Path(__file__).resolve().parents[2]
WIRING = json.loads((REPO / "tests/unit/plan_snapshots/graph_wiring.json").read_text())
GRAPH_FILES = sorted((REPO / "graphs").glob("*.yaml"))


def wiring(graph: Graph) -> dict:
    """The snapshot's form of a loaded graph (what the compiler reads; no bundles)."""
    return {"stages": [{"name": s.name, "op": s.op, "role": s.role, "when": s.when,
                        "outputs": s.outputs, "inputs": dict(sorted(s.inputs.items())),
                        "params": s.params} for s in graph.stages],
            "weight_sync": [[w.src, w.dst, w.staleness] for w in graph.weight_sync]}


def test_every_graph_file_has_a_snapshot():
    assert sorted(WIRING) == [p.stem for p in GRAPH_FILES]


@pytest.mark.parametrize("path", GRAPH_FILES, ids=lambda p: p.name)
def test_graph_file_compiles_to_the_snapshot_wiring(path):
    graph = load_graph(path)
    assert wiring(graph) == WIRING[path.stem]
    # the DAG's edges, with the (argument, output) each carries, as the snapshot's inputs give them
    expected = {}
    for s in WIRING[path.stem]["stages"]:
        for arg, ref in s["inputs"].items():
            src, out = ref.split(".")
            expected.setdefault((src, s["name"]), set()).add((arg, out))
    dag = build_dag(graph)
    assert {e: set(dag.edges[e]["refs"]) for e in dag.edges} == expected


@pytest.mark.parametrize("path", GRAPH_FILES, ids=lambda p: p.name)
def test_no_stage_writes_out_a_bundle_of_its_graph(path):
    """A stage whose own inputs hold every wire of one of the graph's bundles binds it instead."""
    graph = load_graph(path)
    for s in graph.stages:
        own = {k: v for k, v in s.inputs.items() if graph.bundle_of(s.name, k) is None}
        for name, wires in graph.bundles.items():
            assert not wires.items() <= own.items(), f"{path.name}: stage '{s.name}' writes out " \
                                                    f"bundle '{name}'; bind it with 'batch: {name}'"


def test_the_model_stages_bind_the_rollout_batch_once():
    graph = load_graph(REPO / "graphs/grpo.yaml")
    assert graph.bundles == {"rollout": {"prompt_ids": "sample.prompt_ids",
                                         "prompt_mask": "sample.prompt_mask",
                                         "response_ids": "rollout.response_ids",
                                         "response_mask": "rollout.response_mask"}}
    assert {s.name: s.batch for s in graph.stages if s.batch} == {
        "old_logprobs": ["rollout"], "ref_logprobs": ["rollout"], "update": ["rollout"]}
    assert graph.bundle_of("update", "prompt_ids") == "rollout"
    assert graph.bundle_of("update", "advantages") is None


BASE = """\
name: g
bundles:
  tokens:
    prompt_ids: sample.prompt_ids
    prompt_mask: sample.prompt_mask
    response_ids: rollout.response_ids
    response_mask: rollout.response_mask
  extra:
    rollout_logprobs: rollout.rollout_logprobs
stages:
- name: sample
  op: data.sample
- name: rollout
  op: rollout.generate
  role: rollout
  inputs:
    prompt_ids: sample.prompt_ids
    prompt_mask: sample.prompt_mask
- name: reward
  op: reward.rule
  inputs:
    response_ids: rollout.response_ids
    response_mask: rollout.response_mask
    ground_truth: sample.ground_truth
- name: old_logprobs
  op: logprobs
  role: actor
  batch: [tokens, extra]
- name: advantage
  op: advantage.grpo
  inputs:
    rewards: reward.rewards
    group_id: sample.group_id
    response_mask: rollout.response_mask
- name: update
  op: update.policy
  role: actor
  batch: tokens
  inputs:
    old_logprobs: old_logprobs.logprobs
    advantages: advantage.advantages
weight_sync:
- from: update
  to: rollout
"""


def test_batch_binds_the_bundles_wires_and_round_trips():
    graph = graph_from_yaml(BASE)
    assert graph["old_logprobs"].inputs == {
        "prompt_ids": "sample.prompt_ids", "prompt_mask": "sample.prompt_mask",
        "response_ids": "rollout.response_ids", "response_mask": "rollout.response_mask",
        "rollout_logprobs": "rollout.rollout_logprobs"}
    assert graph["update"].inputs == {
        "prompt_ids": "sample.prompt_ids", "prompt_mask": "sample.prompt_mask",
        "response_ids": "rollout.response_ids", "response_mask": "rollout.response_mask",
        "old_logprobs": "old_logprobs.logprobs", "advantages": "advantage.advantages"}
    assert graph.to_yaml() == BASE


def problems_of(text: str) -> str:
    with pytest.raises(GraphError) as e:
        validate_graph(graph_from_yaml(text))
    return str(e.value)


def test_an_unknown_bundle_is_one_line_naming_the_stage_and_batch():
    text = BASE.replace("  batch: tokens\n", "  batch: token\n")
    assert problems_of(text) == (
        "stage 'update', field 'batch': unknown bundle 'token' (did you mean 'tokens'?); "
        "the graph's bundles: ['extra', 'tokens'] (+4 follow-on problems)")


def test_an_argument_bound_by_a_bundle_and_inputs_is_refused():
    text = BASE.replace("    old_logprobs: old_logprobs.logprobs\n",
                        "    old_logprobs: old_logprobs.logprobs\n    prompt_ids: sample.prompt_ids\n")
    assert problems_of(text) == (
        "stage 'update', field 'inputs.prompt_ids': is also bound by bundle 'tokens' (batch: "
        "tokens): bind it once (drop this line, or write the stage's inputs without the bundle)")


def test_two_bundles_binding_one_argument_are_refused():
    text = BASE.replace("    rollout_logprobs: rollout.rollout_logprobs\nstages",
                        "    rollout_logprobs: rollout.rollout_logprobs\n"
                        "    response_mask: rollout.response_mask\nstages")
    assert problems_of(text) == ("stage 'old_logprobs', field 'batch': bundles 'tokens' and "
                                 "'extra' both bind 'response_mask': bind it once (drop it from "
                                 "one bundle)")


def test_a_misspelt_reference_in_a_bundle_names_the_stage_the_input_and_the_bundle():
    text = BASE.replace("    response_ids: rollout.response_ids\n    response_mask: rollout."
                        "response_mask\n  extra", "    response_ids: rollout.respons_ids\n"
                        "    response_mask: rollout.response_mask\n  extra")
    assert problems_of(text) == (
        "stage 'old_logprobs', field 'inputs.response_ids': reads 'rollout.respons_ids', but "
        "stage 'rollout' (op 'rollout.generate') has no output 'respons_ids'; did you mean "
        "'rollout.response_ids'? (wired by bundle 'tokens': fix it under bundles.tokens) "
        "(+1 follow-on problem)")


def test_an_unused_or_malformed_bundle_is_refused():
    unused = BASE.replace("  batch: [tokens, extra]\n", "  batch: tokens\n  inputs:\n"
                          "    rollout_logprobs: rollout.rollout_logprobs\n")
    assert problems_of(unused) == ("field 'bundles.extra': is bound by no stage: add "
                                   "'batch: extra' to the stages that read it, or remove it")
    bad = BASE.replace("  extra:\n    rollout_logprobs: rollout.rollout_logprobs\n",
                       "  extra: rollout.rollout_logprobs\n")
    assert problems_of(bad).splitlines()[0] == (
        "field 'bundles.extra': must be a non-empty mapping of op argument: stage.output "
        "lines, got 'rollout.rollout_logprobs'")
    assert problems_of(BASE.replace("  batch: tokens\n", "  batch: {a: 1}\n")).startswith(
        "stage 'update', field 'batch': must be a bundle name or a list of them")


def test_a_wrong_key_in_a_bundle_is_one_line_whichever_ops_take_it():
    """A misspelt key under bundles.tokens is a problem of each stage that takes the bundle, and
    each stage runs another op (so the messages differ): one line, the rest a count."""
    text = BASE.replace("  tokens:\n    prompt_ids:", "  tokens:\n    prompt_idz:", 1)
    assert text != BASE
    line = problems_of(text)
    assert "\n" not in line, line
    assert line.startswith("stage 'old_logprobs', field 'inputs.prompt_idz': op 'logprobs' has no "
                           "input 'prompt_idz'; rename it to 'prompt_ids' (wired by bundle "
                           "'tokens': fix it under bundles.tokens) (+"), line
