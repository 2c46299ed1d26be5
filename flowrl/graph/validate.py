"""Static validation of a Graph against the op registry, with networkx for the DAG checks.

Every problem names the stage and the field. Nothing here loads a model or calls an op.
``flowrl graph validate FILE...`` is :func:`graph_main` (needs no run config).
"""
from __future__ import annotations

import difflib
import warnings
from pathlib import Path
from typing import Callable, Iterable, Optional

import networkx as nx

from flowrl.graph.graph import DUPLICATE, Graph, GraphError, build_dag, damaged_problem, parse_ref
from flowrl.graph.roles import ROLES
from flowrl.graph.rules import (
    conditional_input_warnings,
    has_interpolation,
    kind_problems,
    pruning_problems,
    refill_problems,
    refill_stages,
    statically_disabled,
    suggest_output,
    update_problems,
    weight_sync_problems,
)
from flowrl.ops.registry import OPS
from flowrl.ops.spec import ParamError


class GraphWarning(UserWarning):
    """Something a graph check found that does not stop a run."""


class UnusedOutputWarning(GraphWarning):
    """A stage output that no other stage consumes (it is freed right after it is produced)."""


class ConditionalInputWarning(GraphWarning):
    """A required input reads a stage whose ``when`` can disable it (a run config that makes
    the condition false is refused)."""


def _hint(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _stage_hint(src: str, out: str, reader: str, names: list[str], by_name: dict) -> str:
    """The fix for a reference ``src.out`` to no stage: an existing ``stage.output`` close to it
    (a stage with that output first: ``nostage.ground_truth`` suggested 'advantage.ground_truth',
    an output advantage does not have), else the stage names."""
    def outputs(n: str) -> list[str]:
        spec = OPS.get(by_name[n].op)
        return list(spec.outputs) if spec is not None else []

    others = [n for n in names if n != reader]
    close = difflib.get_close_matches(src, [n for n in others if out in outputs(n)], n=1)
    if close:
        return f"did you mean '{close[0]}.{out}'?"
    refs = [f"{n}.{o}" for n in others for o in outputs(n)]
    near = difflib.get_close_matches(f"{src}.{out}", refs, n=1)
    return f"did you mean '{near[0]}'?" if near else f"stages: {names}"


def validate_graph(graph: Graph, *, check_params: bool = True, require_update: bool = True) -> list[str]:
    """Check a graph; return warnings (also emitted as GraphWarning: UnusedOutputWarning,
    ConditionalInputWarning).

    Args:
        check_params: also build each op's Config from ``params`` (names and value types
            checked against its fields: ``OpSpec.make_config``); in a stage with unresolved
            interpolations (``${...}``) only the literal values are type-checked, the Config is
            built by the compiler once they are resolved.
        require_update: the graph must have a stage that updates a model (a training graph;
            False for graph fragments built in tests).

    Raises:
        GraphError: listing every (stage, field, message), one line each: duplicate names,
            unknown op or role, role not allowed for the op, misspelled/missing/malformed
            inputs, references to unknown stages or outputs, a list wired into a tensor input,
            bad params, cycles, bad weight-sync edges, no update stage, a required input that
            a literal ``when: false`` prunes, refill rules (``graph/rules.py``).
    """
    problems, found = graph_problems(graph, check_params=check_params, require_update=require_update)
    if problems:
        raise GraphError(problems)
    for msg in found:
        cls = UnusedOutputWarning if "consumed by no stage" in msg else ConditionalInputWarning
        warnings.warn(msg, cls, stacklevel=2)
    return found


def graph_problems(graph: Graph, *, check_params: bool = True, require_update: bool = True
                   ) -> tuple[list[tuple[str, str, str]], list[str]]:
    """:func:`validate_graph` without raising: ``(problems, warnings)``."""
    problems: list[tuple[str, str, str]] = []
    names = graph.stage_names
    seen: set[str] = set()
    for n in names:
        if n in seen:
            problems.append((n, "name", f"{DUPLICATE}; rename one of them"))
        if "." in n:
            problems.append((n, "name", "stage names may not contain '.' (references are "
                                        "'stage.output')"))
        seen.add(n)
    by_name = {s.name: s for s in graph.stages}

    for s in graph.stages:
        spec = OPS.get(s.op)
        if spec is None:
            problems.append((s.name, "op", f"unknown op '{s.op}'{_hint(s.op, OPS)}"))
        if s.role is not None and s.role not in ROLES:
            problems.append((s.name, "role", f"unknown role '{s.role}'{_hint(s.role, ROLES)}; "
                                             f"known: {sorted(ROLES)}"))
        if spec is None:
            continue
        if spec.roles and s.role is None:
            problems.append((s.name, "role", f"op '{s.op}' needs a role, one of {list(spec.roles)}"))
        elif s.role is not None and s.role in ROLES and s.role not in spec.roles:
            allowed = list(spec.roles) or "none (it uses no model)"
            problems.append((s.name, "role", f"op '{s.op}' cannot run as role '{s.role}'; "
                                             f"allowed: {allowed}"))
        renamed: set[str] = set()  # required inputs an unknown argument misspells
        for arg in s.inputs:
            if arg not in spec.all_inputs:
                close = difflib.get_close_matches(arg, [a for a in spec.all_inputs
                                                        if a not in s.inputs], n=1)
                if close:
                    renamed.add(close[0])
                    problems.append((s.name, f"inputs.{arg}", f"op '{s.op}' has no input '{arg}'; "
                                     f"rename it to '{close[0]}'"))
                else:
                    problems.append((s.name, f"inputs.{arg}", f"op '{s.op}' has no input '{arg}'; "
                                     f"its inputs: {list(spec.all_inputs)}"))
        for arg in spec.inputs:
            if arg not in s.inputs and arg not in renamed:
                problems.append((s.name, f"inputs.{arg}", f"required input of op '{s.op}' is not "
                                 f"bound: add 'inputs.{arg}: <stage>.<output>'"
                                 f"{suggest_output(graph, OPS, arg, spec.kind(arg), s.name)}"))
        for arg, ref in s.inputs.items():
            try:
                src, out = parse_ref(ref)
            except ValueError as e:
                problems.append((s.name, f"inputs.{arg}", str(e)))
                continue
            if src not in by_name:
                fix = _stage_hint(src, out, s.name, names, by_name)
                problems.append((s.name, f"inputs.{arg}", f"reads '{ref}', but no stage is named "
                                 f"'{src}'; {fix}"))
                continue
            if src == s.name:
                problems.append((s.name, f"inputs.{arg}", f"a stage cannot read its own output "
                                 f"'{ref}'; bind it to an earlier stage's output"
                                 f"{suggest_output(graph, OPS, arg, spec.kind(arg), s.name)}"))
                continue
            src_spec = OPS.get(by_name[src].op)
            if src_spec is not None and out not in src_spec.outputs:
                close = difflib.get_close_matches(out, src_spec.outputs, n=1)
                fix = f"did you mean '{src}.{close[0]}'?" if close else \
                    f"its outputs: {list(src_spec.outputs)}"
                problems.append((s.name, f"inputs.{arg}", f"reads '{ref}', but stage '{src}' (op "
                                 f"'{src_spec.name}') has no output '{out}'; {fix}"))
            elif src_spec is not None and out in src_spec.multi_turn_outputs and \
                    arg in spec.single_turn_inputs:
                problems.append((s.name, f"inputs.{arg}", f"op '{s.op}' cannot take multi-turn "
                                 f"responses: '{ref}' (op '{src_spec.name}') holds environment "
                                 "tokens between policy turns; score the trajectory with "
                                 "reward.rule / reward.function or the environment's rewards"))
        declared = list(s.outputs or [])
        for out in declared:
            if out not in spec.outputs:
                close = difflib.get_close_matches(out, [o for o in spec.outputs
                                                        if o not in declared], n=1)
                fix = f"did you mean '{close[0]}'?" if close else f"its outputs: {list(spec.outputs)}"
                problems.append((s.name, "outputs", f"op '{s.op}' has no output '{out}'; {fix}"))
        if check_params:
            try:
                if has_interpolation(s.params):  # the literal ones now; the rest once resolved
                    spec.check_params({k: v for k, v in s.params.items()
                                       if not has_interpolation(v)}, stage=s.name)
                else:
                    spec.make_config(s.params, stage=s.name)
            except ParamError as e:
                problems.append((s.name, e.field, e.detail))
            except ValueError as e:
                problems.append((s.name, "params", str(e).replace(f"stage '{s.name}': params: ", "")))

    for i, w in enumerate(graph.weight_sync):
        for fld, st in (("from", w.src), ("to", w.dst)):
            if st not in by_name:
                problems.append((f"weight_sync[{i}]", fld, f"unknown stage '{st}'{_hint(st, names)}"))
        if not isinstance(w.staleness, int) or isinstance(w.staleness, bool) or w.staleness < 0:
            problems.append((f"weight_sync[{i}]", "staleness", f"must be an int >= 0 (0 = "
                             f"on-policy), got {w.staleness!r}"))

    dag = build_dag(graph)
    try:
        problems.append(_cycle_problem(graph, nx.find_cycle(dag)))
    except nx.NetworkXNoCycle:
        pass
    problems += _algorithm_problems(graph.algorithm)

    problems += kind_problems(graph, OPS)
    problems += weight_sync_problems(graph, OPS)
    if require_update:
        problems += update_problems(graph, OPS)
    problems += pruning_problems(graph, OPS, statically_disabled(graph))
    if not any(p[1] == "inputs" and "cycle" in p[2] for p in problems):  # ancestors need a DAG
        refill = refill_stages(graph, OPS)
        problems += refill_problems(graph, OPS, refill)

    found = []
    if not problems:
        consumed = {(src, out) for s in graph.stages for _, src, out in s.input_refs()}
        for s in graph.stages:
            # a stage's ``outputs`` list names what it is meant to produce: an output it leaves
            # out is dropped on purpose (distillation's rewards: logged and scored, never trained on)
            meant = OPS[s.op].outputs if s.outputs is None else s.outputs
            for out in meant:
                if (s.name, out) not in consumed and out not in OPS[s.op].info_outputs:
                    found.append(f"stage '{s.name}': output '{out}' is consumed by no stage")
        found += conditional_input_warnings(graph, OPS)
    return [_with_bundle(graph, p) for p in problems], found


def _with_bundle(graph: Graph, problem: tuple[str, str, str]) -> tuple[str, str, str]:
    """A problem of an input that a bundle bound says so: the line to fix is the bundle's."""
    stage, fld, msg = problem
    if fld.startswith("inputs."):
        bundle = graph.bundle_of(stage, fld.split(".", 1)[1])
        if bundle is not None:
            return stage, fld, f"{msg} (wired by bundle '{bundle}': fix it under bundles.{bundle})"
    return problem


def _algorithm_problems(settings: dict) -> list[tuple[str, str, str]]:
    """The graph's ``algorithm`` block: known ``AlgorithmConfig`` fields, values it accepts."""
    import dataclasses

    from flowrl.algorithms.config import AlgorithmConfig

    known = [f.name for f in dataclasses.fields(AlgorithmConfig)]
    bad = [(k, _hint(str(k), known)) for k in settings if k not in known]
    if bad:
        return [("<graph>", f"algorithm.{k}", f"unknown algorithm setting{hint}") for k, hint in bad]
    try:
        AlgorithmConfig(**settings)
    except (TypeError, ValueError) as e:
        return [("<graph>", "algorithm", str(e))]
    return []


def _cycle_problem(graph: Graph, cycle: list[tuple[str, str]]) -> tuple[str, str, str]:
    """The cycle as one problem at the edge that most likely closes it: a stage reading one
    declared after it (else the cycle's last edge)."""
    pos = {n: i for i, n in enumerate(graph.stage_names)}
    path = " -> ".join([e[0] for e in cycle] + [cycle[-1][1]])
    back = [e for e in cycle if pos[e[0]] > pos[e[1]]]
    src, dst = (back or cycle[-1:])[0]
    arg, out = next((a, o) for a, s, o in graph[dst].input_refs() if s == src)
    return (dst, f"inputs.{arg}", f"reads '{src}.{out}', which closes the cycle {path}; a stage "
            f"may only read stages that do not depend on it within a step (the update -> "
            f"rollout loop is a weight_sync, not an input): bind '{arg}' to another output")


def import_op_modules(graph: Graph, graph_dir: Path | None = None) -> list[tuple[str, str, str]]:
    """Import the graph's ``imports`` (the modules registering its own ops); the problems of
    those that fail, one per module (``<graph>``, ``imports``). A module is found in the
    directory flowrl runs from (``flowrl.cli`` puts it on ``sys.path``, as ``python -m`` does),
    then in the graph file's directory ``graph_dir`` (appended to ``sys.path``), then on the path."""
    import importlib
    import sys

    if graph.imports and graph_dir is not None and str(graph_dir.resolve()) not in sys.path:
        sys.path.append(str(graph_dir.resolve()))
    problems = []
    for module in graph.imports:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 (any error of the user's module is reported)
            where = (" (looked in the working directory, the graph file's directory and "
                     "sys.path)") if isinstance(e, ModuleNotFoundError) and e.name == module else ""
            problems.append(("<graph>", "imports", f"cannot import {module!r}: "
                             f"{type(e).__name__}: {e}{where}"))
    return problems


def graph_from_yaml(text: str, graph_dir: Path | None = None) -> Graph:
    """:meth:`Graph.from_yaml` that reports every problem of the text at once: the schema
    problems and, with them, what the graph checks find in the rest (a misspelt reference, a
    cycle), one line each, so one edit-and-retry fixes them all. ``graph_dir``: the file's
    directory, where its ``imports`` are also looked for.

    Raises:
        GraphError: every problem found.
    """
    graph, problems, damaged = Graph.parse_yaml(text)
    problems += import_op_modules(graph, graph_dir)
    if problems:
        if graph.stages:
            found, _ = graph_problems(graph, require_update=False)
            # an op of a module that failed to import is not unknown: its import is the problem
            imports_failed = any(field == "imports" for _, field, _ in problems)
            problems += [p for p in found if not damaged_problem(p, damaged) and p not in problems
                         and not (imports_failed and p[1] == "op" and p[2].startswith("unknown op"))]
        raise GraphError(problems)
    return graph


def load_graph(path: str | Path) -> Graph:
    """A graph file, every problem reported at once (:func:`graph_from_yaml`), each prefixed
    with the file.

    Raises:
        FileNotFoundError: no such file. GraphError: every problem found.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"graph file not found: {p}")
    try:
        return graph_from_yaml(p.read_text(), graph_dir=p.parent)
    except GraphError as e:
        raise e.with_source(p) from None



def graph_main(argv: list[str],
               check_interpolations: Optional[Callable[[Graph], None]] = None) -> int:
    """``flowrl graph validate FILE...``: every problem of every file, one line each (``FILE:
    stage 'x', field 'y': what to change``), exit 1 when any file is invalid; warnings (outputs
    nobody reads, inputs a ``when`` can disable) do not fail it. Needs no run config of the
    user's: ``check_interpolations`` (the entry's: ``${...}`` of ``when`` / ``params`` against
    the run config's keys) raises GraphError for one that names no key (a typo said ok here,
    then failed ``flowrl train``)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="flowrl graph")
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check graph YAML files")
    v.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    status = 0
    for f in args.files:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", GraphWarning)
                g = load_graph(f)
                problems: list[tuple[str, str, str]] = []
                # both checks, whatever the first finds: an unknown op hid a ${...} typo
                for check in (validate_graph, check_interpolations):
                    try:
                        if check is not None:
                            check(g)
                    except GraphError as e:
                        problems += e.problems + e.follow_on
                if problems:
                    raise GraphError(problems)
        except GraphError as e:
            print(str(e.with_source(f)), file=sys.stderr)
            status = 1
            continue
        except FileNotFoundError as e:
            print(f"{f}: {e}", file=sys.stderr)
            status = 1
            continue
        for w in caught:
            print(f"{f}: warning: {w.message}")
        print(f"{f}: ok")
    return status
