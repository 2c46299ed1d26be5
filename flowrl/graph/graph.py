"""Graph and Stage: the declared "what" of one RL iteration, with YAML round-trip and a builder.

A stage input is a reference ``"<stage>.<output>"``; edges are derived from those references and
never written twice. The one loop-carried dependency (update → next rollout) is a ``WeightSync``.

YAML form (``graphs/*.yaml``)::

    # <description lines: what it runs and the command that runs it>
    name: dapo
    algorithm:                      # optional: the run's algorithm settings this recipe changes
      clip_ratio_high: 0.28
    bundles:                        # optional: named groups of wires several stages bind
      rollout:
        prompt_ids: sample.prompt_ids
        response_ids: rollout.response_ids
    stages:
    - name: rollout
      op: rollout.generate
      role: rollout
      inputs:
        prompt_ids: sample.prompt_ids
    - name: update
      op: update.policy
      role: actor
      batch: rollout                # = every wire of bundle 'rollout' written under inputs
      inputs:
        advantages: advantage.advantages
    weight_sync:
    - from: update
      to: rollout
      staleness: 0

``imports`` (optional) lists Python modules imported before the stages are checked: where a graph's
own ops are declared with ``@register_op`` (importable from where flowrl runs, e.g. ``my_ops`` for
``./my_ops.py``), so ``graph validate``, ``plan`` and ``train`` all know them.
``algorithm`` holds the values of the run's ``algorithm`` section (``AlgorithmConfig`` fields)
that differ from their defaults for this recipe; ``graph=<name>`` applies them (the command line
still wins: ``flowrl/config.py`` registers one Hydra option per file of ``graphs/``).
``bundles`` names groups of wires (``op argument: stage.output``, as under a stage's ``inputs``)
that several stages read, e.g. the rollout batch (prompt and response tokens and masks); a stage's
``batch`` (one bundle name or a list) binds every wire of those bundles, as if written under its
``inputs``. The loader expands them (:meth:`Graph._parse`) before any check, so ``Stage.inputs``
always holds the full wiring and a problem still names the stage and the input
(``stage 'update', field 'inputs.prompt_ids'``); an argument bound twice (by two bundles, or by
a bundle and ``inputs``) is refused, so a bundle never silently overrides a line.
``Graph.from_yaml(text).to_yaml() == text`` for files written in this canonical form.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml


class GraphError(ValueError):
    """A malformed graph. ``problems`` lists every ``(stage, field, message)`` found; the message
    is one line per problem (:func:`problem_line`), each prefixed with ``source`` (the graph
    file) when it is known."""

    def __init__(self, problems: list[tuple[str, str, str]], source: Optional[str] = None):
        # the root problems first (a cycle before the lines it causes); what follows from one
        # of them is folded into a count on the first line (``follow_on`` keeps it)
        self.problems, self.follow_on = fold_problems(problems)
        self.source = source
        super().__init__(self._text())

    def _text(self) -> str:
        head = f"{self.source}: " if self.source else ""
        lines = [head + problem_line(*p) for p in self.problems]
        if self.follow_on and lines:
            n = len(self.follow_on)
            lines[0] += f" (+{n} follow-on problem{'s' if n > 1 else ''})"
        return "\n".join(lines)

    def with_source(self, source: str | Path) -> "GraphError":
        """The same problems, each line prefixed with ``source``."""
        return GraphError(self.problems + self.follow_on, str(source))


# message fragments of validate.py's problems that the folding below recognises
CYCLE = "which closes the cycle"
UNBOUND = "is not bound: add 'inputs."
UNKNOWN_FIELD = "unknown stage field"
DUPLICATE = "duplicate stage name"


def fold_problems(problems: list[tuple[str, str, str]]
                  ) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """``(roots, follow_on)``: every problem once, the roots ordered so that the first line is
    the one to fix first, the follow-on problems (those that fixing a root removes) set apart.

    Order (stable within a rank): a file that does not parse; a duplicate stage name; a cycle;
    a misspelt name (a "did you mean" or "rename it to"); the rest. Follow-on: with a duplicate
    stage name, every input wiring problem and cycle (references to the name reach the wrong
    stage: a renamed copy of ``reward`` called ``sample`` showed first as a cycle through
    ``sample``); a required input "not bound" in a stage whose ``inputs`` is misspelt or
    malformed (an unknown stage field, a non-mapping) or whose ``batch`` has a problem (an
    unknown bundle); another problem of the field that closes a cycle; the same problem repeated
    in later stages (for an input a bundle wires, the same field of the same bundle, whichever
    op the stage runs).
    """
    unique = list(dict.fromkeys(problems))
    duplicate = any(DUPLICATE in msg for _, _, msg in unique)
    lost_inputs = {st for st, fld, msg in unique
                   if (UNKNOWN_FIELD in msg and not fld.startswith("inputs")) or
                   (fld == "inputs" and msg.startswith("must be a mapping")) or fld == "batch"}
    cycle_fields = {(st, fld) for st, fld, msg in unique if CYCLE in msg}
    roots, follow_on, seen = [], [], set()
    for st, fld, msg in unique:
        # one bundle's wrong key is a problem of every stage that takes the bundle, each
        # message naming its own op: the bundle's line once
        bundle = re.search(r"\(wired by bundle '([^']+)'", msg)
        key = ("bundle", bundle[1], fld) if bundle else (fld, msg)
        repeat = key in seen and not st.startswith("<")
        seen.add(key)
        if (UNBOUND in msg and st in lost_inputs) or \
                ((st, fld) in cycle_fields and CYCLE not in msg) or repeat or \
                (duplicate and (fld.startswith("inputs") or CYCLE in msg)):
            follow_on.append((st, fld, msg))
        else:
            roots.append((st, fld, msg))

    def rank(p: tuple[str, str, str]) -> int:
        if p[1] in ("<yaml>", "<root>"):
            return 0
        if DUPLICATE in p[2]:
            return 1
        if CYCLE in p[2]:
            return 2
        return 3 if ("did you mean" in p[2] or "rename it to" in p[2]) else 4
    return sorted(roots, key=rank), follow_on


def problem_line(stage: str, fld: str, message: str) -> str:
    """One problem as one line that names where it is: ``stage 'x', field 'inputs.y': ...``;
    graph-level problems (stage ``<graph>``) name only the field, ``weight_sync[i]`` entries
    their index."""
    message = " ".join(message.split())  # never more than one line
    if stage == "<graph>":
        return message if fld.startswith("<") else f"field '{fld}': {message}"
    if stage.startswith("weight_sync["):
        return f"{stage}: {message}" if fld.startswith("<") else f"{stage}.{fld}: {message}"
    return f"stage '{stage}', field '{fld}': {message}"


def parse_ref(ref: str) -> tuple[str, str]:
    """Split ``"stage.output"``. Raises ValueError on any other shape."""
    if not isinstance(ref, str) or ref.count(".") != 1 or ref.startswith(".") or ref.endswith("."):
        raise ValueError(f"reference {ref!r} must look like 'stage.output'")
    stage, out = ref.split(".")
    return stage, out


@dataclass
class Stage:
    """One node of the graph.

    Attributes:
        name: unique, no dots.
        op: key in the op registry.
        role: model the stage uses (actor, rollout, ref, teacher, critic, reward_model, genrm) or None.
        inputs: op argument → ``"stage.output"``.
        params: overrides of the op's Config fields; values may be OmegaConf interpolations into
            the run config (``${algorithm.n}``), resolved when the plan is compiled.
        when: optional condition (usually an interpolation such as ``${algorithm.kl_coef}``); a
            falsy value prunes the stage from the plan.
        outputs: optional list of the op outputs the stage is meant to produce: the op names
            its outputs, so this documents them, and the validator checks each name (a
            misspelt one gets a "did you mean"). An op output the list leaves out is dropped on
            purpose: no UnusedOutputWarning when no stage reads it (``[]``: a stage run for its
            metrics, e.g. distillation's reward, which only the eval and the logs read).
        batch: names of the graph's ``bundles`` this stage binds; their wires are already in
            ``inputs`` (the loader expands them), this list only records where they came from
            (for the file form and for naming the bundle in a problem).
    """

    name: str
    op: str
    role: Optional[str] = None
    inputs: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    when: Any = None
    outputs: Optional[list[str]] = None
    batch: list[str] = field(default_factory=list)

    def out(self, output: str) -> str:
        """Reference to one of this stage's outputs, for another stage's ``inputs``."""
        return f"{self.name}.{output}"

    __getitem__ = out

    def input_refs(self) -> Iterator[tuple[str, str, str]]:
        """Yield ``(argument, producer stage, output)`` for every well-formed input reference."""
        for arg, ref in self.inputs.items():
            try:
                src, out = parse_ref(ref)
            except ValueError:
                continue
            yield arg, src, out

    def to_dict(self, bundles: Optional[dict[str, dict[str, str]]] = None) -> dict[str, Any]:
        """The graph file's form; ``bundles`` (the graph's) leaves the wires of ``batch`` out
        of ``inputs``."""
        d: dict[str, Any] = {"name": self.name, "op": self.op}
        if self.role is not None:
            d["role"] = self.role
        if self.when is not None:
            d["when"] = self.when
        if self.outputs is not None:
            d["outputs"] = list(self.outputs)
        if self.batch:
            d["batch"] = self.batch[0] if len(self.batch) == 1 else _FlowList(self.batch)
        bundled = {arg for b in self.batch for arg in (bundles or {}).get(b, {})}
        inputs = {k: v for k, v in self.inputs.items() if k not in bundled}
        if inputs:
            d["inputs"] = inputs
        if self.params:
            d["params"] = dict(self.params)
        return d


class _FlowList(list):
    """A list the graph file writes on one line (``batch: [rollout, images]``)."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(
    _FlowList, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data,
                                                             flow_style=True))

_STAGE_KEYS = {"name", "op", "role", "batch", "inputs", "params", "when", "outputs"}
_GRAPH_KEYS = ("name", "imports", "algorithm", "data", "bundles", "stages", "weight_sync")


@dataclass
class WeightSync:
    """Loop-carried edge: weights written by stage ``src`` are read by stage ``dst`` next step.

    ``staleness`` is the allowed version lag (0 = on-policy: the next rollout waits for them).
    """

    src: str
    dst: str
    staleness: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The graph file's form; ``staleness`` only where it differs from the default (0), as
        a graph file states it (tests/unit/test_config_defaults.py)."""
        d: dict[str, Any] = {"from": self.src, "to": self.dst}
        if self.staleness != WeightSync.staleness:
            d["staleness"] = self.staleness
        return d


@dataclass
class Graph:
    """A named DAG of stages plus its weight-sync edges. See module docstring for the YAML form."""

    name: str
    stages: list[Stage] = field(default_factory=list)
    weight_sync: list[WeightSync] = field(default_factory=list)
    description: str = ""
    algorithm: dict[str, Any] = field(default_factory=dict)
    # the run's data settings this recipe changes (``DataConfig`` fields: a prompt budget for
    # tool schemas, an instruction); applied like ``algorithm`` by ``graph=<name>``
    data: dict[str, Any] = field(default_factory=dict)
    # modules that register this graph's own ops (``@register_op``), imported before any check
    imports: list[str] = field(default_factory=list)
    # named groups of wires (op argument -> "stage.output") that stages bind with ``batch``
    bundles: dict[str, dict[str, str]] = field(default_factory=dict)

    # ---- builder -------------------------------------------------------------------------
    def stage(self, name: str, op: str, *, role: Optional[str] = None,
              inputs: Optional[dict[str, str]] = None, params: Optional[dict[str, Any]] = None,
              when: Any = None) -> Stage:
        """Append a stage and return it (use ``stage.out("x")`` / ``stage["x"]`` as a reference)."""
        s = Stage(name=name, op=op, role=role, inputs=dict(inputs or {}),
                  params=dict(params or {}), when=when)
        self.stages.append(s)
        return s

    def sync(self, src: Stage | str, dst: Stage | str, staleness: int = 0) -> WeightSync:
        w = WeightSync(src.name if isinstance(src, Stage) else src,
                       dst.name if isinstance(dst, Stage) else dst, staleness)
        self.weight_sync.append(w)
        return w

    def __getitem__(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"graph '{self.name}' has no stage '{name}'")

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    def bundle_of(self, stage: str, arg: str) -> Optional[str]:
        """The bundle that bound input ``arg`` of stage ``stage`` (None: its own ``inputs``)."""
        for s in self.stages:
            if s.name == stage:
                return next((b for b in s.batch if arg in self.bundles.get(b, {})), None)
        return None

    # ---- (de)serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name}
        if self.imports:
            d["imports"] = list(self.imports)
        if self.algorithm:
            d["algorithm"] = dict(self.algorithm)
        if self.data:
            d["data"] = dict(self.data)
        if self.bundles:
            d["bundles"] = {k: dict(v) for k, v in self.bundles.items()}
        d["stages"] = [s.to_dict(self.bundles) for s in self.stages]
        if self.weight_sync:
            d["weight_sync"] = [w.to_dict() for w in self.weight_sync]
        return d

    def to_yaml(self) -> str:
        body = yaml.dump(self.to_dict(), Dumper=_Dumper, sort_keys=False,
                         default_flow_style=False, width=100, allow_unicode=True)
        head = "".join(f"# {line}".rstrip() + "\n" for line in self.description.splitlines())
        return head + body

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    @classmethod
    def from_dict(cls, d: Any, *, description: str = "") -> "Graph":
        """Build from parsed YAML.

        Raises:
            GraphError: the malformed entries, one line each (naming stage and field). The graph
                checks on the rest (a misspelt reference, a cycle) come with them from
                :func:`flowrl.graph.validate.load_graph` / ``graph_from_yaml``, which the CLI and
                the run use.
        """
        graph, problems, _ = cls._parse(d, description=description)
        if problems:
            raise GraphError(problems)
        return graph

    @classmethod
    def _parse(cls, d: Any, *, description: str = ""
               ) -> tuple["Graph", list[tuple[str, str, str]], dict[str, set[str]]]:
        """Best-effort graph, the schema problems, and stage -> fields that were missing or
        malformed (left empty in the graph, so checks on them would only repeat the problem)."""
        problems: list[tuple[str, str, str]] = []
        damaged: dict[str, set[str]] = {}
        if not isinstance(d, dict):
            got = "an empty file" if d is None else f"a {type(d).__name__}"  # YAML's empty: None
            raise GraphError([("<graph>", "<root>", "a graph file is a mapping with keys "
                               f"{', '.join(_GRAPH_KEYS)}; got {got}")])
        unknown = sorted(set(d) - set(_GRAPH_KEYS))
        if unknown:
            problems.append(("<graph>", unknown[0], f"unknown top-level key(s) {unknown}"
                             f"{_close(unknown[0], _GRAPH_KEYS)}; a graph has "
                             f"{', '.join(_GRAPH_KEYS)}"))
        imports = d.get("imports") or []
        if not isinstance(imports, list) or not all(isinstance(m, str) and m for m in imports):
            problems.append(("<graph>", "imports", "must be a list of module names (e.g. "
                             f"[my_ops]), got {imports!r}"))
            imports = []
        name = d.get("name")
        if not isinstance(name, str) or not name:
            problems.append(("<graph>", "name", "missing or not a string"))
            name = str(name or "graph")
        bundles = _parse_bundles(d.get("bundles"), problems)
        stages: list[Stage] = []
        raw_stages = d.get("stages")
        if not isinstance(raw_stages, list) or not raw_stages:
            problems.append(("<graph>", "stages", "must be a non-empty list of stages "
                             "(mappings with name, op, role, inputs, params, when)"))
            raw_stages = []
        for i, rs in enumerate(raw_stages):
            label = str(rs.get("name", f"#{i}")) if isinstance(rs, dict) else f"#{i}"
            if not isinstance(rs, dict):
                problems.append((label, "<stage>", "must be a mapping with name, op and "
                                 f"optionally role, inputs, params, when; got a {type(rs).__name__}"))
                continue
            bad = damaged.setdefault(label, set())
            for k in sorted(set(rs) - _STAGE_KEYS):
                problems.append((label, k, f"unknown stage field{_close(k, _STAGE_KEYS)}; "
                                 f"known: {sorted(_STAGE_KEYS)}"))
            for k in ("name", "op"):
                if not isinstance(rs.get(k), str) or not rs.get(k):
                    problems.append((label, k, "missing or not a string"))
                    bad.add(k)
            shapes = {"inputs": "op argument: stage.output", "params": "config field: value"}
            for k in ("inputs", "params"):
                if rs.get(k) is not None and not isinstance(rs.get(k), dict):
                    problems.append((label, k, f"must be a mapping ({shapes[k]} lines), got "
                                               f"a {type(rs.get(k)).__name__}"))
                    rs = {**rs, k: {}}
                    bad.add(k)
            if rs.get("role") is not None and not isinstance(rs.get("role"), str):
                problems.append((label, "role", "must be a string"))
                rs = {**rs, "role": None}
                bad.add("role")
            outputs = rs.get("outputs")
            if outputs is not None and not (isinstance(outputs, list) and
                                            all(isinstance(o, str) for o in outputs)):
                problems.append((label, "outputs", "must be a list of the op's output names, got "
                                 f"{outputs!r}"))
                outputs = None
                bad.add("outputs")
            batch, inputs = _expand_batch(label, rs.get("batch"), dict(rs.get("inputs") or {}),
                                          bundles, problems)
            batch = batch or []
            stages.append(Stage(name=str(rs.get("name", label)), op=str(rs.get("op", "")),
                                role=rs.get("role"), inputs=inputs,
                                params=dict(rs.get("params") or {}), when=rs.get("when"),
                                outputs=outputs, batch=batch))
        used = {b for s in stages for b in s.batch}
        for b in bundles:
            if b not in used:
                problems.append(("<graph>", f"bundles.{b}", "is bound by no stage: add "
                                 f"'batch: {b}' to the stages that read it, or remove it"))
        syncs: list[WeightSync] = []
        raw_syncs = d.get("weight_sync") or []
        if not isinstance(raw_syncs, list):
            problems.append(("<graph>", "weight_sync", "must be a list of {from, to, staleness} "
                                                       f"mappings, got a {type(raw_syncs).__name__}"))
            raw_syncs = []
        for i, w in enumerate(raw_syncs):
            if not isinstance(w, dict) or set(w) - {"from", "to", "staleness"} or not {"from", "to"} <= set(w):
                problems.append((f"weight_sync[{i}]", "<entry>",
                                 "must be a mapping with keys from, to and optional staleness"))
                continue
            syncs.append(WeightSync(str(w["from"]), str(w["to"]),
                                    w.get("staleness", WeightSync.staleness)))
        algorithm = d.get("algorithm") or {}
        if not isinstance(algorithm, dict):
            problems.append(("<graph>", "algorithm", "must be a mapping of algorithm settings "
                                                     f"(field: value), got a {type(algorithm).__name__}"))
            algorithm = {}
        data = d.get("data") or {}
        if not isinstance(data, dict):
            problems.append(("<graph>", "data", "must be a mapping of data settings (field: value), "
                                                f"got a {type(data).__name__}"))
            data = {}
        return cls(name=name, stages=stages, weight_sync=syncs, description=description,
                   algorithm=dict(algorithm), data=dict(data), imports=list(imports),
                   bundles=bundles), problems, damaged

    @classmethod
    def parse_yaml(cls, text: str) -> tuple["Graph", list[tuple[str, str, str]], dict[str, set[str]]]:
        """Parse YAML text (the leading ``#`` comment block becomes ``description``) into a
        best-effort graph, its schema problems and the damaged fields (see ``_parse``).

        Raises:
            GraphError: the text is not YAML (one line: where and what).
        """
        desc_lines = []
        for line in text.splitlines():
            if line.startswith("#"):
                desc_lines.append(line[2:] if line.startswith("# ") else line[1:])
            else:
                break
        try:
            d = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader that refuses repeated keys
        except DuplicateKeyError as e:
            raise GraphError([("<graph>", "<yaml>", str(e))]) from e
        except yaml.YAMLError as e:
            raise GraphError([("<graph>", "<yaml>", yaml_problem(e))]) from e
        return cls._parse(d, description="\n".join(desc_lines))

    @classmethod
    def from_yaml(cls, text: str) -> "Graph":
        """Parse YAML text; the leading ``#`` comment block becomes ``description``.

        Raises:
            GraphError: not YAML, or its schema problems (``from_dict``)."""
        graph, problems, _ = cls.parse_yaml(text)
        if problems:
            raise GraphError(problems)
        return graph

    @classmethod
    def load(cls, path: str | Path) -> "Graph":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"graph file not found: {p}")
        try:
            return cls.from_yaml(p.read_text())
        except GraphError as e:
            raise e.with_source(p) from None


def _parse_bundles(raw: Any, problems: list[tuple[str, str, str]]) -> dict[str, dict[str, str]]:
    """The graph's ``bundles`` block (name -> {op argument: "stage.output"}); its malformed
    entries are appended to ``problems`` and left out. A reference's own shape and target are
    checked in each stage that binds it (``validate.py``), where the problem names the stage."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(("<graph>", "bundles", "must be a mapping of bundle name -> wires "
                         f"(op argument: stage.output lines), got a {type(raw).__name__}"))
        return {}
    out: dict[str, dict[str, str]] = {}
    for name, wires in raw.items():
        if not isinstance(name, str) or not name:
            problems.append(("<graph>", "bundles", f"bundle name {name!r} must be a string"))
        elif not isinstance(wires, dict) or not wires or \
                not all(isinstance(k, str) and isinstance(v, str) for k, v in wires.items()):
            problems.append(("<graph>", f"bundles.{name}", "must be a non-empty mapping of "
                             f"op argument: stage.output lines, got {wires!r}"))
        else:
            out[name] = dict(wires)
    return out


def _expand_batch(label: str, raw: Any, inputs: dict[str, str], bundles: dict[str, dict[str, str]],
                  problems: list[tuple[str, str, str]]) -> tuple[Optional[list[str]], dict[str, str]]:
    """``(bundle names, full wiring)`` of a stage: the wires of the bundles its ``batch``
    names, in bundle order, then its own ``inputs``. A malformed ``batch`` gives ``None`` (and
    the stage's own inputs only); an unknown bundle, or an argument bound twice, a problem."""
    if raw is None:
        return [], inputs
    names = [raw] if isinstance(raw, str) else raw
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        problems.append((label, "batch", "must be a bundle name or a list of them (the graph's "
                         f"top-level bundles), got {raw!r}"))
        return None, inputs
    wired: dict[str, str] = {}
    origin: dict[str, str] = {}
    for b in names:
        if b not in bundles:
            known = f"; the graph's bundles: {sorted(bundles)}" if bundles else \
                "; the graph has no top-level 'bundles'"
            problems.append((label, "batch", f"unknown bundle '{b}'{_close(b, bundles)}{known}"))
            continue
        for arg, ref in bundles[b].items():
            if arg in origin:
                problems.append((label, "batch", f"bundles '{origin[arg]}' and '{b}' both bind "
                                 f"'{arg}': bind it once (drop it from one bundle)"))
                continue
            origin[arg] = b
            wired[arg] = ref
    for arg, ref in inputs.items():
        if arg in origin:
            problems.append((label, f"inputs.{arg}", f"is also bound by bundle '{origin[arg]}' "
                             f"(batch: {origin[arg]}): bind it once (drop this line, or write "
                             "the stage's inputs without the bundle)"))
            continue
        wired[arg] = ref
    return names, wired


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping of a graph file: PyYAML keeps the last silently, so a
    stage's second ``response_mask:`` wire (or a second stage of one name) would quietly replace
    the first."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with a repeated key (:class:`DuplicateKeyError`,
    naming both lines)."""

    def construct_mapping(self, node: "yaml.MappingNode", deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(
                    f"duplicate key {key!r} at line {line} (first at line {seen[key]}): YAML "
                    "would keep only the last one; remove or rename one of them")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def yaml_problem(e: "yaml.YAMLError") -> str:
    """A YAML syntax error as one line: where (line, column, 1-based) and what the parser
    expected, e.g. ``not valid YAML at line 9, column 9: mapping values are not allowed here``."""
    if not isinstance(e, yaml.MarkedYAMLError):
        return f"not valid YAML: {' '.join(str(e).split())}"
    mark = e.problem_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = " ".join(str(e.problem or "syntax error").split())
    if e.context:
        what += f" ({' '.join(str(e.context).split())})"
    return (f"not valid YAML{where}: {what}; check the indentation and quoting there (a value "
            "holding ': ', '#', '[' or '{' needs quotes)")


def _close(word: str, choices) -> str:
    import difflib

    close = difflib.get_close_matches(word, sorted(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def damaged_problem(problem: tuple[str, str, str], damaged: dict[str, set[str]]) -> bool:
    """A graph-check problem about a field that was already reported as missing/malformed."""
    stage, fld, _ = problem
    bad = damaged.get(stage, set())
    root = fld.split(".")[0]
    return root in bad or ("op" in bad and root in ("op", "role", "inputs", "params"))


def build_dag(graph: Graph):
    """Producer → consumer ``networkx.DiGraph`` over stage names; edge attribute ``refs`` lists
    (arg, output). A stage reading its own output adds no edge (it is reported as its own
    problem)."""
    import networkx as nx  # here, not at the top: parsing a graph needs no networkx

    g = nx.DiGraph()
    g.add_nodes_from(graph.stage_names)
    for s in graph.stages:
        for arg, src, out in s.input_refs():
            if src in g and src != s.name:
                g.add_edge(src, s.name)
                g.edges[src, s.name].setdefault("refs", []).append((arg, out))
    return g
