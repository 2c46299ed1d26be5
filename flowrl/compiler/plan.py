"""Compile a Graph into an ExecutionPlan for one colocated pool.

No engine is imported here: a plan is built and printed on a laptop with no model and no GPU.

Steps: resolve ``when``/``params`` against the run config → prune disabled stages → validate →
order stages (topological, grouping stages of the same model to cut onload/offload switches) →
insert swap points (offload/onload) and weight-sync points → lifecycle table (for every
intermediate: producer, consumers, last consumer).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import networkx as nx
from omegaconf import DictConfig, OmegaConf

from flowrl.graph.graph import Graph, GraphError, Stage, WeightSync, build_dag
from flowrl.graph.roles import ROLES
from flowrl.graph.rules import pruning_problems, refill_problems, truthy
from flowrl.graph.validate import validate_graph
from flowrl.ops.registry import OPS


@dataclass
class Action:
    """One entry of a pool's timeline. kind: run | onload | offload | sync."""

    kind: str
    stage: Optional[str] = None
    role: Optional[str] = None
    detail: str = ""
    keep_weights: bool = False  # offload: the next role serves these weights (rollout ← actor)

    @property
    def stage_name(self) -> str:
        """``stage`` of a run or sync action (both always name one).

        Raises:
            ValueError: an onload/offload action (they name a role, no stage)."""
        if self.stage is None:
            raise ValueError(f"a {self.kind} action names no stage")
        return self.stage

    @property
    def role_name(self) -> str:
        """``role`` of an onload/offload/sync action (they always name one).

        Raises:
            ValueError: a run action of a role-less stage."""
        if self.role is None:
            raise ValueError(f"a {self.kind} action names no role")
        return self.role


@dataclass
class TensorLife:
    """Lifecycle of one intermediate ``key = "stage.output"``.

    ``last_consumer`` is None for an output nobody consumes: it is released right after its
    producer runs.
    """

    key: str
    producer: str
    consumers: list[str]
    last_consumer: Optional[str]


@dataclass
class RefillSpec:
    """A refill stage of the plan (run by ``flowrl.runtime.step.refill.run_refill``): ``upstream`` =
    its ancestor stages in plan order, re-run on every attempt after the first."""

    stage: str
    upstream: list[str]
    max_attempts: int
    target_groups: int


@dataclass
class CompiledStage:
    stage: Stage
    config: Any  # the op's Config instance, params resolved


@dataclass
class ExecutionPlan:
    """The compiler's output for one pool (placement ``colocated``).

    Attributes:
        graph: the source graph.
        stages: compiled stages in execution order.
        actions: the timeline of one step, swap and sync points included; ``resident_at_end`` is
            what stays loaded going into the next step.
        lifetimes: key → TensorLife.
        release_after: stage → keys whose last consumer it is (freed right after it runs).
        pruned: stages dropped because their ``when`` was false.
        refill: refill stage (params ``refill: true``, DAPO dynamic sampling) → RefillSpec with the
            upstream stages the executor re-runs until the stage has kept enough groups.
        warnings: validator warnings (unused outputs).
    """

    graph: Graph
    stages: list[CompiledStage]
    actions: list[Action]
    lifetimes: dict[str, TensorLife]
    release_after: dict[str, list[str]]
    pruned: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    placement: str = "colocated"
    resident_at_end: list[str] = field(default_factory=list)
    refill: dict[str, "RefillSpec"] = field(default_factory=dict)
    # role -> how another role's engine serves it (LoRA: ref = the actor with adapters disabled)
    served_by: dict[str, str] = field(default_factory=dict)

    @property
    def order(self) -> list[str]:
        return [c.stage.name for c in self.stages]

    @property
    def roles(self) -> list[str]:
        """Roles with a model, in first-use order."""
        out: list[str] = []
        for c in self.stages:
            if c.stage.role and c.stage.role not in out:
                out.append(c.stage.role)
        return out

    @property
    def num_swaps(self) -> int:
        return sum(a.kind == "onload" for a in self.actions)


def resolve(graph: Graph, run_cfg: Mapping | DictConfig | None) -> Graph:
    """Resolve ``${...}`` in ``when`` and ``params`` against the run config.

    Raises:
        GraphError: an interpolation that does not resolve, naming stage and field.
    """
    root = run_cfg if isinstance(run_cfg, DictConfig) else OmegaConf.create(dict(run_cfg or {}))
    problems = []
    out = Graph(name=graph.name, weight_sync=list(graph.weight_sync), description=graph.description)
    for s in graph.stages:
        fields = {"when": s.when, "params": s.params}
        resolved: dict[str, Any] = {}
        for fld, val in fields.items():
            try:
                node = OmegaConf.create({"__root__": root, "v": val})
                resolved[fld] = _resolved_value(node)
            except Exception as e:  # omegaconf raises several types; all mean "cannot resolve"
                msg = f"cannot resolve {val!r}: {e}".split("\n")[0].replace("__root__.", "")
                near = _near_key(root, str(e))
                problems.append((s.name, fld, msg + (f" (did you mean ${{{near}}}?)" if near else "")))
                resolved[fld] = val
        out.stages.append(Stage(name=s.name, op=s.op, role=s.role, inputs=dict(s.inputs),
                                params=resolved["params"] or {}, when=resolved["when"],
                                outputs=s.outputs))
    if problems:
        raise GraphError(problems)
    return out


def _near_key(root: DictConfig, error: str) -> Optional[str]:
    """For "Interpolation key 'a.b_typo' not found": the run config's key closest to it under
    the same parent (``a.b``), or None."""
    import difflib
    import re

    m = re.search(r"Interpolation key '([^']+)' not found", error)
    if m is None:
        return None
    parent, _, leaf = m.group(1).replace("__root__.", "").rpartition(".")
    node = OmegaConf.select(root, parent) if parent else root
    if not isinstance(node, DictConfig):
        return None
    close = difflib.get_close_matches(leaf, [str(k) for k in node.keys() if k != leaf], n=1)
    return f"{parent}.{close[0]}".lstrip(".") if close else None


def _resolved_value(node: DictConfig) -> Any:
    """``node.v`` (any YAML value: a ``when`` string, a ``params`` dict, None) as plain
    containers, with every interpolation resolved against ``node.__root__``."""
    out = OmegaConf.to_container(node, resolve=True)
    if not isinstance(out, dict):  # to_container of a DictConfig is a dict
        raise TypeError(f"expected a dict from a DictConfig, got {type(out).__name__}")
    return out["v"]


def check_interpolations(graph: Graph, run_cfg: Mapping | DictConfig) -> None:
    """Every ``${...}`` of ``graph``'s ``when`` / ``params`` resolves against ``run_cfg``, as
    :func:`compile_plan` resolves them (``flowrl graph validate`` asks it of the default run
    config, whose schema holds every key a run can set).

    Raises:
        GraphError: one per field that does not resolve, with the nearest key.
    """
    resolve(_rewrite_interpolations(graph), run_cfg)


def _rewrite_interpolations(graph: Graph) -> Graph:
    """``${algorithm.x}`` → ``${__root__.algorithm.x}`` so resolution looks in the run config."""

    def fix(v):
        if isinstance(v, str):
            return v.replace("${", "${__root__.").replace("${__root__.oc.", "${oc.")
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    g = Graph(name=graph.name, weight_sync=list(graph.weight_sync), description=graph.description)
    for s in graph.stages:
        g.stages.append(Stage(name=s.name, op=s.op, role=s.role, inputs=dict(s.inputs),
                              params=fix(s.params), when=fix(s.when), outputs=s.outputs))
    return g


def prune(graph: Graph, shown_when: Optional[Mapping[str, Any]] = None) -> tuple[Graph, list[str]]:
    """Drop stages whose resolved ``when`` is false, and unbind optional inputs that referenced
    them.

    Args:
        shown_when: stage → its ``when`` as written (``${algorithm.kl_coef}``), for messages.

    Raises:
        GraphError: a *required* input read a pruned stage, or every update stage was pruned
            (``graph/rules.pruning_problems``).
    """
    dropped = [s.name for s in graph.stages if s.when is not None and not truthy(s.when)]
    if not dropped:
        return graph, []
    problems = pruning_problems(graph, OPS, dropped, shown_when)
    if problems:
        raise GraphError(problems)
    g = Graph(name=graph.name, description=graph.description,
              weight_sync=[w for w in graph.weight_sync if w.src not in dropped and w.dst not in dropped])
    for s in graph.stages:
        if s.name in dropped:
            continue
        inputs = {arg: ref for arg, ref in s.inputs.items() if ref.split(".")[0] not in dropped}
        g.stages.append(Stage(name=s.name, op=s.op, role=s.role, inputs=inputs, params=s.params,
                              when=None, outputs=s.outputs))
    return g, dropped


def order_stages(graph: Graph) -> list[str]:
    """Topological order that keeps stages of one model together.

    Among ready stages: one of the currently loaded role, else a role-less one, else the role with
    the fewest remaining stages (finishing it frees its memory for good), ties by declared order.
    """
    dag = build_dag(graph)
    role = {s.name: s.role for s in graph.stages}
    pos = {s.name: i for i, s in enumerate(graph.stages)}
    indeg = dict(dag.in_degree())
    remaining: dict[Optional[str], int] = {}
    for s in graph.stages:
        remaining[s.role] = remaining.get(s.role, 0) + 1
    current: Optional[str] = None
    order: list[str] = []
    ready = [n for n, d in indeg.items() if d == 0]
    while ready:
        def key(n: str, current: Optional[str] = current):  # this iteration's role
            r = role[n]
            if r is not None and r == current:
                rank = 0
            elif r is None:
                rank = 1
            else:
                rank = 2
            return (rank, remaining[r] if rank == 2 else 0, pos[n])

        ready.sort(key=key)
        n = ready.pop(0)
        order.append(n)
        remaining[role[n]] -= 1
        if role[n] is not None:
            current = role[n]
        for m in dag.successors(n):
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
    return order


def _swap_actions(graph: Graph, order: list[str]) -> tuple[list[Action], list[str]]:
    """Colocated policy: one model role resident at a time (its weights, grads, optimizer state).

    The step starts with what the previous step left resident (the last role used), so the first
    model stage of a step may offload it; sync points follow their source stage.
    """
    by_name = {s.name: s for s in graph.stages}
    model_stages = [n for n in order if by_name[n].role]
    resident: Optional[str] = by_name[model_stages[-1]].role if model_stages else None
    actions: list[Action] = []
    syncs: dict[str, list[WeightSync]] = {}
    for w in graph.weight_sync:
        syncs.setdefault(w.src, []).append(w)
    for n in order:
        r = by_name[n].role
        if r is not None and r != resident:
            if resident is not None:
                shares = ROLES[r].weights_from == resident
                actions.append(Action("offload", role=resident, keep_weights=shares,
                                      detail=f"before {n}" + (f"; weights stay, {r} serves them"
                                                              if shares else "")))
            actions.append(Action("onload", role=r, detail=f"for {n}"))
            resident = r
        actions.append(Action("run", stage=n, role=r))
        for w in syncs.get(n, []):
            dst_role = by_name[w.dst].role
            actions.append(Action("sync", stage=n, role=dst_role,
                                  detail=f"weights {by_name[n].role} -> {dst_role} (staleness {w.staleness})"))
    return actions, [resident] if resident else []


def lifecycle(graph: Graph, order: list[str]) -> tuple[dict[str, TensorLife], dict[str, list[str]]]:
    """For every op output: producer, consumers (in plan order) and the last consumer."""
    pos = {n: i for i, n in enumerate(order)}
    consumers: dict[str, list[str]] = {}
    for s in graph.stages:
        for _, src, out in s.input_refs():
            consumers.setdefault(f"{src}.{out}", [])
            if s.name not in consumers[f"{src}.{out}"]:
                consumers[f"{src}.{out}"].append(s.name)
    lifetimes: dict[str, TensorLife] = {}
    release: dict[str, list[str]] = {n: [] for n in order}
    for n in order:
        s = graph[n]
        for out in OPS[s.op].outputs:
            key = f"{n}.{out}"
            cons = sorted(consumers.get(key, []), key=pos.__getitem__)
            last = cons[-1] if cons else None
            lifetimes[key] = TensorLife(key, n, cons, last)
            release[last or n].append(key)
    return lifetimes, release


def refill_specs(graph: Graph, order: list[str], compiled: list[CompiledStage]) -> dict[str, RefillSpec]:
    """Find stages whose config has ``refill`` set and check they can be re-run safely.

    A refill stage's ancestors (its upstream sub-graph) are re-run as a whole, so every output of
    an upstream stage must be consumed only by upstream stages or the refill stage itself (a
    later stage reading one would see the last attempt only, out of step with the refilled
    batch); the op must output ``group_id`` and its config have ``max_attempts`` and
    ``target_groups``. At most one refill stage per graph (``graph/rules.refill_problems``).

    Raises:
        GraphError: naming the stage and input that breaks a rule.
    """
    refill = [c.stage.name for c in compiled if getattr(c.config, "refill", False)]
    problems = refill_problems(graph, OPS, refill)
    if problems:
        raise GraphError(problems)
    dag = build_dag(graph)
    by_name = {c.stage.name: c for c in compiled}
    specs = {}
    for name in refill:
        upstream = set(nx.ancestors(dag, name))
        cfg = by_name[name].config
        specs[name] = RefillSpec(name, [n for n in order if n in upstream], cfg.max_attempts,
                                 cfg.target_groups)
    return specs


def recipe_notes(graph: Graph, run_cfg: Mapping | DictConfig | None) -> list[str]:
    """One line per setting of the graph's ``algorithm`` block that the run does not use: a
    command-line override (which wins on purpose), or a file loaded with ``graph.path=`` (only
    ``graph=<name>`` applies a graph's block), so neither goes unnoticed in the plan."""
    algo = (run_cfg or {}).get("algorithm") if run_cfg is not None else None
    if not graph.algorithm or algo is None:
        return []
    notes = []
    for key, want in graph.algorithm.items():
        # a config block (dict / DictConfig), or a structured config object (a dataclass)
        have = algo.get(key) if isinstance(algo, Mapping) else getattr(algo, key, None)
        if have != want:
            notes.append(f"graph '{graph.name}' sets algorithm.{key}: {want}, this run uses {have} "
                         f"(a command-line override; a graph.path= file's algorithm block is "
                         f"applied only by graph=<name>)")
    return notes


def check_refill_reachable(specs: Mapping[str, RefillSpec], run_cfg: Mapping | DictConfig | None) -> None:
    """A refill target no attempt budget can reach: each attempt samples
    ``trainer.prompts_per_step`` groups (per sampling rank), so more than ``prompts_per_step *
    max_attempts`` kept groups is impossible, however varied the rewards.

    Raises:
        GraphError: naming the stage's ``params.target_groups``.
    """
    trainer = (run_cfg or {}).get("trainer") or {}
    per_step = trainer.get("prompts_per_step") if isinstance(trainer, Mapping) else None
    if not isinstance(per_step, int) or per_step < 1:
        return
    problems = []
    for name, spec in specs.items():
        most = per_step * spec.max_attempts
        if spec.target_groups > most:
            problems.append((name, "params.target_groups", f"{spec.target_groups} groups can never "
                             f"be kept: {spec.max_attempts} attempts of trainer.prompts_per_step="
                             f"{per_step} sample {most} at most; lower target_groups or raise "
                             "params.max_attempts (or trainer.prompts_per_step)"))
    if problems:
        raise GraphError(problems)


def compile_plan(graph: Graph, run_cfg: Mapping | DictConfig | None = None,
                 placement: str = "colocated", *, require_update: bool = True) -> ExecutionPlan:
    """Validate, resolve, prune, order and annotate a graph.

    Args:
        require_update: the graph must train something (False: graph fragments in tests).

    Raises:
        GraphError: any validation problem (before any model is loaded), one line each.
        ValueError: an unsupported placement.
    """
    if placement not in ("colocated", "partitioned", "auto"):  # pools: compiler/placement.py
        raise ValueError(f"placement.mode must be colocated, partitioned or auto, got {placement!r}")
    with warnings.catch_warnings():  # warnings are reported once, in plan.warnings (plan text)
        warnings.simplefilter("ignore")
        validate_graph(graph, check_params=False, require_update=require_update)
        g = resolve(_rewrite_interpolations(graph), run_cfg)
        g, dropped = prune(g, shown_when={s.name: s.when for s in graph.stages})
        warns = validate_graph(g, check_params=True, require_update=require_update) + \
            recipe_notes(graph, run_cfg)
    order = order_stages(g)
    compiled = [CompiledStage(g[n], OPS[g[n].op].make_config(g[n].params, stage=n)) for n in order]
    actions, resident = _swap_actions(g, order)
    lifetimes, release = lifecycle(g, order)
    refill = refill_specs(g, order, compiled)
    check_refill_reachable(refill, run_cfg)
    return ExecutionPlan(graph=g, stages=compiled, actions=actions, lifetimes=lifetimes,
                         release_after=release, pruned=dropped, warnings=warns,
                         placement=placement, resident_at_end=resident, refill=refill)
