"""Static validation of a Graph against the op registry, with networkx for the DAG checks.

Every problem names the stage and the field. Nothing here loads a model or calls an op.
"""
from __future__ import annotations

import difflib
import warnings
from typing import Iterable

import networkx as nx

from flowrl.graph.graph import Graph, GraphError, parse_ref
from flowrl.graph.roles import ROLES
from flowrl.ops.registry import OPS, load_builtin_ops


class UnusedOutputWarning(UserWarning):
    """A stage output that no other stage consumes (it is freed right after it is produced)."""


def _hint(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def build_dag(graph: Graph) -> nx.DiGraph:
    """Producer → consumer DiGraph over stage names; edge attribute ``refs`` lists (arg, output)."""
    g = nx.DiGraph()
    g.add_nodes_from(graph.stage_names)
    for s in graph.stages:
        for arg, src, out in s.input_refs():
            if src in g:
                g.add_edge(src, s.name)
                g.edges[src, s.name].setdefault("refs", []).append((arg, out))
    return g


def validate_graph(graph: Graph, *, check_params: bool = True) -> list[str]:
    """Check a graph; return warnings (also emitted as UnusedOutputWarning).

    Args:
        check_params: also build each op's Config from ``params``; params that are still
            unresolved interpolations (``${...}``) are left for the compiler.

    Raises:
        GraphError: listing every (stage, field, message): duplicate names, unknown op or role,
            role not allowed for the op, misspelled/missing/malformed inputs, references to unknown
            stages or outputs, bad params, cycles, bad weight-sync edges.
    """
    load_builtin_ops()
    problems: list[tuple[str, str, str]] = []
    names = graph.stage_names
    seen: set[str] = set()
    for n in names:
        if n in seen:
            problems.append((n, "name", "duplicate stage name"))
        if "." in n:
            problems.append((n, "name", "stage names may not contain '.'"))
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
        for arg in s.inputs:
            if arg not in spec.all_inputs:
                problems.append((s.name, f"inputs.{arg}", f"op '{s.op}' has no input '{arg}'"
                                 f"{_hint(arg, spec.all_inputs)}; inputs: {list(spec.all_inputs)}"))
        for arg in spec.inputs:
            if arg not in s.inputs:
                problems.append((s.name, f"inputs.{arg}", f"required input of op '{s.op}' is not bound"))
        for arg, ref in s.inputs.items():
            try:
                src, out = parse_ref(ref)
            except ValueError as e:
                problems.append((s.name, f"inputs.{arg}", str(e)))
                continue
            if src not in by_name:
                problems.append((s.name, f"inputs.{arg}", f"unknown stage '{src}'{_hint(src, names)}"))
                continue
            if src == s.name:
                problems.append((s.name, f"inputs.{arg}", "a stage cannot consume its own output"))
                continue
            src_spec = OPS.get(by_name[src].op)
            if src_spec is not None and out not in src_spec.outputs:
                problems.append((s.name, f"inputs.{arg}", f"stage '{src}' (op '{src_spec.name}') has "
                                 f"no output '{out}'{_hint(out, src_spec.outputs)}; "
                                 f"outputs: {list(src_spec.outputs)}"))
            elif src_spec is not None and out in src_spec.multi_turn_outputs and \
                    arg in spec.single_turn_inputs:
                problems.append((s.name, f"inputs.{arg}", f"op '{s.op}' cannot take multi-turn "
                                 f"responses: '{ref}' (op '{src_spec.name}') holds environment "
                                 "tokens between policy turns; score the trajectory with "
                                 "reward.rule / reward.function or the environment's rewards"))
        if check_params and not _has_interpolation(s.params):
            try:
                spec.make_config(s.params, stage=s.name)
            except ValueError as e:
                problems.append((s.name, "params", str(e).replace(f"stage '{s.name}': params: ", "")))

    for i, w in enumerate(graph.weight_sync):
        for fld, st in (("from", w.src), ("to", w.dst)):
            if st not in by_name:
                problems.append((f"weight_sync[{i}]", fld, f"unknown stage '{st}'{_hint(st, names)}"))
        if not isinstance(w.staleness, int) or w.staleness < 0:
            problems.append((f"weight_sync[{i}]", "staleness", f"must be an int >= 0, got {w.staleness!r}"))

    dag = build_dag(graph)
    try:
        cycle = nx.find_cycle(dag)
        path = " -> ".join([e[0] for e in cycle] + [cycle[-1][1]])
        problems.append((cycle[0][0], "inputs", f"cycle: {path} (the graph must be acyclic within "
                                                "an iteration; use weight_sync for the loop)"))
    except nx.NetworkXNoCycle:
        pass

    if problems:
        raise GraphError(problems)

    found = []
    consumed = {(src, out) for s in graph.stages for _, src, out in s.input_refs()}
    for s in graph.stages:
        for out in OPS[s.op].outputs:
            if (s.name, out) not in consumed and out not in OPS[s.op].info_outputs:
                msg = f"stage '{s.name}': output '{out}' is consumed by no stage"
                found.append(msg)
                warnings.warn(msg, UnusedOutputWarning, stacklevel=2)
    return found


def _has_interpolation(x) -> bool:
    if isinstance(x, str):
        return "${" in x
    if isinstance(x, dict):
        return any(_has_interpolation(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_interpolation(v) for v in x)
    return False
