"""Graph rules beyond the per-stage checks of ``validate.py``: what a runnable training graph
must satisfy, checked statically (no run config, no model) wherever the graph says enough:

- value kinds: a list output (``ground_truth``) never feeds a tensor input, nor the reverse
  (``OpSpec.kinds``);
- a training graph has a stage that updates a model (``OpSpec.trains``), also after ``when``
  pruning;
- weight syncs go from a stage that trains to a stage whose role serves those weights;
- ``when`` pruning: a required input may not read a stage that its ``when`` disables (a literal
  ``false`` here; an interpolation once the compiler resolved it);
- refill stages (DAPO dynamic sampling): at most one, and no other stage reads inside its
  sub-graph, which it re-runs.

Each rule returns ``(stage, field, message)`` problems (``GraphError.problems``) whose message
says what to change; the compiler reuses :func:`pruning_problems` and :func:`refill_problems` on
the resolved graph, so ``flowrl graph validate`` and ``flowrl train`` apply one rule set.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from flowrl.graph.graph import Graph, Stage, build_dag
from flowrl.graph.roles import ROLES

if TYPE_CHECKING:
    from flowrl.ops.registry import OpSpec

Problem = tuple[str, str, str]

_KIND_WORDS = {"tensor": "tensor (batch dimension first)", "list": "list (one Python value per sample)"}


def truthy(v: Any) -> bool:
    """A resolved ``when`` value: false for ``false``/``0``/``0.0``/``""``/``none``/``off``/``no``."""
    if isinstance(v, str):
        return v.strip().lower() not in ("", "0", "0.0", "false", "no", "off", "none", "null")
    return bool(v)


def has_interpolation(x: Any) -> bool:
    """A value still holding ``${...}`` (resolved only against the run config)."""
    if isinstance(x, str):
        return "${" in x
    if isinstance(x, dict):
        return any(has_interpolation(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(has_interpolation(v) for v in x)
    return False


def when_text(v: Any) -> str:
    """A ``when`` value as written in YAML (``false``, ``0``, ``${algorithm.kl_coef}``)."""
    return str(v).lower() if isinstance(v, bool) or v is None else str(v)


def _outputs_named(graph: Graph, ops: Mapping[str, "OpSpec"], name: str, kind: Optional[str] = None,
                   exclude: str = "") -> list[str]:
    """``stage.output`` references of the stages producing an output called ``name``."""
    found = []
    for s in graph.stages:
        spec = ops.get(s.op)
        if s.name != exclude and spec is not None and name in spec.outputs and \
                (kind is None or spec.kind(name) == kind):
            found.append(f"{s.name}.{name}")
    return found


def suggest_output(graph: Graph, ops: Mapping[str, "OpSpec"], arg: str, kind: Optional[str] = None,
                   exclude: str = "") -> str:
    """`` (e.g. 'reward.rewards')`` when some stage outputs a value named like the argument."""
    found = _outputs_named(graph, ops, arg, kind, exclude)
    return f" (e.g. '{found[0]}')" if found else ""


# ---------------------------------------------------------------------------------- value kinds
def kind_problems(graph: Graph, ops: Mapping[str, "OpSpec"]) -> list[Problem]:
    """A list output bound to a tensor input or the reverse (``OpSpec.kinds``): the op would
    fail on its first call, after every model has loaded."""
    by_name = {s.name: s for s in graph.stages}
    problems = []
    for s in graph.stages:
        spec = ops.get(s.op)
        if spec is None:
            continue
        for arg, src, out in s.input_refs():
            src_spec = ops.get(by_name[src].op) if src in by_name else None
            if src_spec is None or out not in src_spec.outputs or arg not in spec.all_inputs:
                continue  # reported by the reference checks
            want, got = spec.kind(arg), src_spec.kind(out)
            if want != got:
                problems.append((s.name, f"inputs.{arg}", f"'{src}.{out}' is a {_KIND_WORDS[got]} "
                                 f"but input '{arg}' of op '{s.op}' takes a {_KIND_WORDS[want]}; "
                                 f"bind a {want} output"
                                 f"{suggest_output(graph, ops, arg, want, exclude=s.name)}"))
    return problems


# ------------------------------------------------------------------------------ update stage
def update_problems(graph: Graph, ops: Mapping[str, "OpSpec"]) -> list[Problem]:
    """A graph with no stage that trains (``OpSpec.trains``): a run would finish having
    trained nothing."""
    if any(ops[s.op].trains for s in graph.stages if s.op in ops):
        return []
    if any(s.op not in ops for s in graph.stages):
        return []  # an unknown op is reported already; it may be the misspelt update
    trainers = sorted(n for n, spec in ops.items() if spec.trains)
    return [("<graph>", "stages", f"no stage updates a model, so a run would train nothing: add "
             f"an update stage (op {' or '.join(trainers)}; graphs/grpo.yaml's 'update' stage "
             "reads prompt/response ids and masks and the advantages)")]


# ------------------------------------------------------------------------------ weight syncs
def weight_sync_problems(graph: Graph, ops: Mapping[str, "OpSpec"]) -> list[Problem]:
    """A weight sync must go from a stage that trains (role of kind ``train``) to a stage whose
    role serves that role's weights (``RoleSpec.weights_from``: rollout ← actor)."""
    by_name = {s.name: s for s in graph.stages}
    trainers = [s.name for s in graph.stages if s.op in ops and ops[s.op].trains]
    problems = []
    for i, w in enumerate(graph.weight_sync):
        src, dst = by_name.get(w.src), by_name.get(w.dst)
        if src is None or dst is None:
            continue  # unknown stage: reported by validate
        if any((s.role is not None and s.role not in ROLES) or
               (s.role is None and s.op in ops and ops[s.op].roles) for s in (src, dst)):
            continue  # a misspelt role, or none where the op needs one: reported by validate
            # (with the names to use); what the sync needs of that stage follows once it is set
        hint_src = f" (e.g. '{trainers[0]}')" if trainers else ""
        if src.role is None:
            problems.append((f"weight_sync[{i}]", "from", f"stage '{w.src}' has no role (it runs "
                             "no model), so it has no weights to send; sync from the stage that "
                             f"updates them{hint_src}"))
            continue
        if ROLES[src.role].kind != "train":
            problems.append((f"weight_sync[{i}]", "from", f"stage '{w.src}' (role {src.role}) "
                             "trains no weights; sync from the stage that updates them"
                             f"{hint_src}"))
            continue
        servers = [s.name for s in graph.stages
                   if s.role in ROLES and ROLES[s.role].weights_from == src.role]
        hint_dst = f" (e.g. '{servers[0]}')" if servers else ""
        if dst.role is None:
            problems.append((f"weight_sync[{i}]", "to", f"stage '{w.dst}' has no role (it runs no "
                             "model), so nothing would load the weights; sync into the stage "
                             f"that generates with role {src.role}'s weights{hint_dst}"))
        elif ROLES[dst.role].weights_from != src.role:
            problems.append((f"weight_sync[{i}]", "to", f"stage '{w.dst}' (role {dst.role}) does "
                             f"not serve role {src.role}'s weights; sync into a stage whose role "
                             f"does{hint_dst}"))
    return problems


# ------------------------------------------------------------------------------ when pruning
def statically_disabled(graph: Graph) -> list[str]:
    """Stages whose ``when`` is a literal false value (no interpolation to resolve)."""
    return [s.name for s in graph.stages
            if s.when is not None and not has_interpolation(s.when) and not truthy(s.when)]


def pruning_problems(graph: Graph, ops: Mapping[str, "OpSpec"], dropped: Sequence[str],
                     shown_when: Optional[Mapping[str, Any]] = None) -> list[Problem]:
    """What pruning ``dropped`` would break: a kept stage's *required* input reading a dropped
    stage (optional inputs are unbound instead), or every update stage gone.

    ``shown_when``: stage → its ``when`` as written (the interpolation), for the message."""
    gone = set(dropped)
    if not gone:
        return []
    shown = dict(shown_when or {})
    problems = []
    for s in graph.stages:
        if s.name in gone:
            continue
        spec = ops.get(s.op)
        for arg, src, _ in s.input_refs():
            if src in gone and spec is not None and arg in spec.inputs:
                when = when_text(shown.get(src, graph[src].when))
                problems.append((s.name, f"inputs.{arg}", f"required input reads stage '{src}', "
                                 f"which its 'when: {when}' disables; change that 'when', or "
                                 f"give stage '{s.name}' the same 'when'"))
    trainers = [s.name for s in graph.stages if s.op in ops and ops[s.op].trains]
    if trainers and all(t in gone for t in trainers):
        t = trainers[0]
        problems.append((t, "when", f"'when: {when_text(shown.get(t, graph[t].when))}' disables "
                         f"{'every update stage' if len(trainers) > 1 else 'the only update stage'}"
                         ", so a run would train nothing; remove that 'when' or make it true"))
    return problems


def conditional_input_warnings(graph: Graph, ops: Mapping[str, "OpSpec"]) -> list[str]:
    """Required inputs that read a stage with an interpolated ``when`` (the consumer does not
    share it): the run fails whenever the run config makes that condition false."""
    by_name = {s.name: s for s in graph.stages}
    found = []
    for s in graph.stages:
        spec = ops.get(s.op)
        for arg, src, _out in s.input_refs():
            src_stage = by_name.get(src)
            if spec is None or src_stage is None or arg not in spec.inputs:
                continue
            if has_interpolation(src_stage.when) and s.when != src_stage.when:
                found.append(f"stage '{s.name}': required input '{arg}' reads stage '{src}', which "
                             f"'when: {src_stage.when}' can disable; a run where it is false is "
                             f"refused (give '{s.name}' the same 'when', or drop it from '{src}')")
    return found


# ---------------------------------------------------------------------------------- refill
def static_refill(stage: Stage, spec: "OpSpec") -> Optional[bool]:
    """Does the stage refill? Its ``params.refill``, else its op config's default; None while
    the value is an unresolved interpolation (decided by the compiler)."""
    fields = {f.name: f for f in dataclasses.fields(spec.config_cls)}
    if "refill" not in fields:
        return False
    if "refill" in stage.params:
        value = stage.params["refill"]
        return None if has_interpolation(value) else truthy(value)
    f = fields["refill"]
    if f.default is not dataclasses.MISSING:
        return truthy(f.default)
    return None


def refill_stages(graph: Graph, ops: Mapping[str, "OpSpec"]) -> list[str]:
    """Stages known to refill from the graph alone (declared order)."""
    return [s.name for s in graph.stages if s.op in ops and static_refill(s, ops[s.op])]


def refill_problems(graph: Graph, ops: Mapping[str, "OpSpec"], refill: Sequence[str]) -> list[Problem]:
    """The refill rules: one refill stage per graph; its op supports refill (``group_id`` in and
    out, ``max_attempts`` and ``target_groups`` in its config); no stage outside the refill
    stage's upstream sub-graph (which every attempt re-runs) reads an output inside it — it
    would see the last attempt only, out of step with the refilled batch."""
    import networkx as nx


    if len(refill) > 1:
        return [(refill[1], "params.refill", f"a second refill stage: '{refill[0]}' already "
                 "re-runs the sampling sub-graph and a graph has one refill loop; set "
                 f"'refill: false' on one of {list(refill)}")]
    problems: list[Problem] = []
    dag = build_dag(graph)
    for name in refill:
        stage = graph[name]
        spec = ops[stage.op]
        fields = {f.name for f in dataclasses.fields(spec.config_cls)}
        if not {"max_attempts", "target_groups"} <= fields or "group_id" not in spec.outputs:
            problems.append((name, "params.refill", f"op '{stage.op}' does not support refill "
                             "(needs group_id in and out, max_attempts, target_groups)"))
            continue
        if "group_id" not in stage.inputs:
            problems.append((name, "inputs.group_id", "a refill stage needs its group_id bound "
                             "(e.g. 'sample.group_id'): attempts are counted in groups"))
            continue
        upstream = set(nx.ancestors(dag, name))
        for s in graph.stages:
            if s.name in upstream or s.name == name:
                continue
            for arg, src, out in s.input_refs():
                if src in upstream:
                    instead = (f"bind '{name}.{out}' instead" if out in spec.outputs else
                               f"read an output of '{name}' instead")
                    problems.append((s.name, f"inputs.{arg}", f"reads '{src}.{out}' from inside the "
                                     f"refill sub-graph of '{name}', which re-runs it until "
                                     f"enough groups are kept; {instead}"))
    return problems
