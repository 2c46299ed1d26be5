"""The compiled plan of graphs/grpo.yaml: order, swaps, pruning and the last-consumer table."""
from pathlib import Path

import pytest

from flowrl.compiler.plan import compile_plan
from flowrl.compiler.render import format_plan
from flowrl.graph import Graph, GraphError

GRPO = Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml"


def plan(kl_coef=0.0):
    return compile_plan(Graph.load(GRPO), {"algorithm": {"kl_coef": kl_coef,
                                                         "recompute_old_logprobs": True}})


def test_ref_stage_pruned_without_kl():
    p = plan(0.0)
    assert p.pruned == ["ref_logprobs"]
    assert "ref_logprobs" not in p.graph["update"].inputs
    assert p.order == ["sample", "rollout", "reward", "advantage", "old_logprobs", "update"]


def test_order_groups_model_stages_with_kl():
    p = plan(0.01)
    # advantage (no model) runs while the rollout is still resident; ref is finished before the
    # actor's two stages so the actor is loaded once
    assert p.order == ["sample", "rollout", "reward", "advantage", "ref_logprobs", "old_logprobs",
                       "update"]
    swaps = [(a.kind, a.role) for a in p.actions if a.kind in ("onload", "offload")]
    assert swaps == [("offload", "actor"), ("onload", "rollout"), ("offload", "rollout"),
                     ("onload", "ref"), ("offload", "ref"), ("onload", "actor")]
    assert p.num_swaps == 3
    syncs = [a for a in p.actions if a.kind == "sync"]
    assert len(syncs) == 1 and syncs[0].stage == "update" and syncs[0].role == "rollout"


def test_last_consumer_table():
    p = plan(0.01)
    last = {k: t.last_consumer for k, t in p.lifetimes.items()}
    assert last == {
        "sample.prompt_ids": "update", "sample.prompt_mask": "update",
        "sample.group_id": "advantage", "sample.ground_truth": "reward",
        "rollout.response_ids": "update", "rollout.response_mask": "update",
        "rollout.rollout_logprobs": "update", "rollout.truncated": "update",
        "reward.rewards": "advantage", "advantage.advantages": "update",
        "ref_logprobs.logprobs": "update", "old_logprobs.logprobs": "update",
    }
    assert p.lifetimes["rollout.response_mask"].consumers == [
        "reward", "advantage", "ref_logprobs", "old_logprobs", "update"]
    assert sorted(p.release_after["advantage"]) == ["reward.rewards", "sample.group_id"]


def test_old_logprobs_stage_pruned_for_a_single_on_policy_update():
    p = compile_plan(Graph.load(GRPO), {"algorithm": {"kl_coef": 0.0,
                                                      "recompute_old_logprobs": False}})
    assert p.order == ["sample", "rollout", "reward", "advantage", "update"]
    assert "old_logprobs" not in p.graph["update"].inputs
    assert p.lifetimes["rollout.rollout_logprobs"].last_consumer == "update"


def test_plan_text_lists_everything():
    text = format_plan(plan(0.01))
    for needle in ("old_logprobs", "role=actor", "onload  ref", "sync    weights actor -> rollout",
                   "rollout.rollout_logprobs", "model switches per step: 3"):
        assert needle in text, needle


def test_required_input_on_pruned_stage_is_an_error():
    g = Graph.load(GRPO)
    g["advantage"].when = "${algorithm.kl_coef}"
    with pytest.raises(GraphError) as ei:
        compile_plan(g, {"algorithm": {"kl_coef": 0.0, "recompute_old_logprobs": True}})
    assert ("update", "inputs.advantages") in [(s, f) for s, f, _ in ei.value.problems]


def test_unresolvable_interpolation_names_stage():
    with pytest.raises(GraphError) as ei:
        compile_plan(Graph.load(GRPO), {"algorithm": {}})
    assert [p[:2] for p in ei.value.problems] == [("old_logprobs", "when"), ("ref_logprobs", "when")]


def test_unsupported_placement():
    with pytest.raises(ValueError, match="placement.mode must be"):
        compile_plan(Graph.load(GRPO), {"algorithm": {"kl_coef": 0, "recompute_old_logprobs": True}},
                     placement="spread")


@pytest.mark.parametrize("wrap", ["dict", "dictconfig", "dataclass"])
def test_recipe_notes_name_each_algorithm_setting_the_run_overrides(wrap):
    from dataclasses import make_dataclass

    from omegaconf import OmegaConf

    from flowrl.compiler.plan import recipe_notes

    g = Graph.load(GRPO)
    g.algorithm = {"kl_coef": 0.1, "n": 4}
    algo = {"kl_coef": 0.0, "n": 4}
    run = {"dict": lambda: {"algorithm": algo},
           "dictconfig": lambda: OmegaConf.create({"algorithm": algo}),
           "dataclass": lambda: {"algorithm": make_dataclass("A", ["kl_coef", "n"])(**algo)}}[wrap]()
    notes = recipe_notes(g, run)
    assert len(notes) == 1 and "algorithm.kl_coef: 0.1, this run uses 0.0" in notes[0]


def test_plan_text_columns_fit_a_long_stage_name():
    from flowrl.compiler.render import format_plan

    # graphs/grpo.yaml with its advantage stage renamed to a 35-character name: the old fixed
    # 14-character stage column pushed that row's op= and role= right of every other row's
    long = "group_normalised_advantage_estimate"
    text = GRPO.read_text().replace("- name: advantage\n", f"- name: {long}\n").replace(
        "advantage.advantages", f"{long}.advantages")
    g = Graph.from_yaml(text)
    out = format_plan(compile_plan(g, {"algorithm": {"kl_coef": 0.0,
                                                     "recompute_old_logprobs": True}}))
    runs = [line for line in out.splitlines() if ". run " in line]
    assert len(runs) == 6 and len({line.index(" op=") for line in runs}) == 1
    assert len({line.index(" role=") for line in runs}) == 1
    assert runs[1] == f"   2. run     {'rollout':<{len(long)}} op=rollout.generate   role=rollout"
    swaps = [line for line in out.splitlines() if line.startswith("      o")]  # offload / onload
    assert {line.index(" (") for line in swaps} == {runs[0].index(" op=")}
    rows = out[out.index("  tensor "):].splitlines()
    assert rows[3].split() == ["sample.group_id", "sample", long, long]
    last = rows[0].index("last consumer")
    assert rows[3].index(long) == last
    assert {r.index(" update ") + 1 for r in rows if r.split()[2:3] == ["update"]} == {last}


@pytest.mark.parametrize("when, near", [("${algorithm.kl_cof}", " (did you mean ${algorithm.kl_coef}?)"),
                                        ("${algorithm.zzz}", ""), ("${nosuch.kl_coef}", "")])
def test_an_unresolvable_when_suggests_the_nearest_key(when, near):
    """A typo in a stage's ${...} names the run config's key it likely meant (fresh-user report)."""
    g = Graph.load(GRPO)
    g["ref_logprobs"].when = when
    with pytest.raises(GraphError) as e:
        compile_plan(g, {"algorithm": {"kl_coef": 0.1, "recompute_old_logprobs": True}})
    key = when[2:-1]
    assert str(e.value).endswith(f"stage 'ref_logprobs', field 'when': cannot resolve {when!r}: "
                                 f"Interpolation key '{key}' not found{near}")
