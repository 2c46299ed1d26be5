"""Graph and Stage: the declared "what" of one RL iteration, with YAML round-trip and a builder.

A stage input is a reference ``"<stage>.<output>"``; edges are derived from those references and
never written twice. The one loop-carried dependency (update → next rollout) is a ``WeightSync``.

YAML form (``graphs/*.yaml``)::

    # <description lines: what it runs and the command that runs it>
    name: dapo
    algorithm:                      # optional: the run's algorithm settings this recipe changes
      clip_ratio_high: 0.28
    stages:
    - name: rollout
      op: rollout.generate
      role: rollout
      inputs:
        prompt_ids: sample.prompt_ids
    weight_sync:
    - from: update
      to: rollout
      staleness: 0

``algorithm`` holds the values of the run's ``algorithm`` section (``AlgorithmConfig`` fields)
that differ from their defaults for this recipe; ``graph=<name>`` applies them (the command line
still wins: ``flowrl/config.py`` registers one Hydra option per file of ``graphs/``).
``Graph.from_yaml(text).to_yaml() == text`` for files written in this canonical form.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml


class GraphError(ValueError):
    """A malformed graph. ``problems`` lists every ``(stage, field, message)`` found."""

    def __init__(self, problems: list[tuple[str, str, str]]):
        self.problems = problems
        lines = [f"  stage '{s}', field '{f}': {m}" for s, f, m in problems]
        super().__init__(f"invalid graph ({len(problems)} problem(s)):\n" + "\n".join(lines))


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
        role: model the stage uses (actor, rollout, ref, critic, reward_model, genrm) or None.
        inputs: op argument → ``"stage.output"``.
        params: overrides of the op's Config fields; values may be OmegaConf interpolations into
            the run config (``${algorithm.n}``), resolved when the plan is compiled.
        when: optional condition (usually an interpolation such as ``${algorithm.kl_coef}``); a
            falsy value prunes the stage from the plan.
    """

    name: str
    op: str
    role: Optional[str] = None
    inputs: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    when: Any = None

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

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "op": self.op}
        if self.role is not None:
            d["role"] = self.role
        if self.when is not None:
            d["when"] = self.when
        if self.inputs:
            d["inputs"] = dict(self.inputs)
        if self.params:
            d["params"] = dict(self.params)
        return d


_STAGE_KEYS = {"name", "op", "role", "inputs", "params", "when"}


@dataclass
class WeightSync:
    """Loop-carried edge: weights written by stage ``src`` are read by stage ``dst`` next step.

    ``staleness`` is the allowed version lag (0 = on-policy: the next rollout waits for them).
    """

    src: str
    dst: str
    staleness: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"from": self.src, "to": self.dst, "staleness": self.staleness}


@dataclass
class Graph:
    """A named DAG of stages plus its weight-sync edges. See module docstring for the YAML form."""

    name: str
    stages: list[Stage] = field(default_factory=list)
    weight_sync: list[WeightSync] = field(default_factory=list)
    description: str = ""
    algorithm: dict[str, Any] = field(default_factory=dict)

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
        w = WeightSync(getattr(src, "name", src), getattr(dst, "name", dst), staleness)
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

    # ---- (de)serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name}
        if self.algorithm:
            d["algorithm"] = dict(self.algorithm)
        d["stages"] = [s.to_dict() for s in self.stages]
        if self.weight_sync:
            d["weight_sync"] = [w.to_dict() for w in self.weight_sync]
        return d

    def to_yaml(self) -> str:
        body = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False,
                              width=100, allow_unicode=True)
        head = "".join(f"# {line}".rstrip() + "\n" for line in self.description.splitlines())
        return head + body

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    @classmethod
    def from_dict(cls, d: Any, *, description: str = "") -> "Graph":
        """Build from parsed YAML. Raises GraphError naming the stage and field of bad entries."""
        problems: list[tuple[str, str, str]] = []
        if not isinstance(d, dict):
            raise GraphError([("<graph>", "<root>", f"expected a mapping, got {type(d).__name__}")])
        unknown = sorted(set(d) - {"name", "algorithm", "stages", "weight_sync"})
        if unknown:
            problems.append(("<graph>", unknown[0], f"unknown top-level key(s) {unknown}"))
        name = d.get("name")
        if not isinstance(name, str) or not name:
            problems.append(("<graph>", "name", "missing or not a string"))
        stages: list[Stage] = []
        raw_stages = d.get("stages")
        if not isinstance(raw_stages, list) or not raw_stages:
            problems.append(("<graph>", "stages", "must be a non-empty list"))
            raw_stages = []
        for i, rs in enumerate(raw_stages):
            label = rs.get("name", f"#{i}") if isinstance(rs, dict) else f"#{i}"
            if not isinstance(rs, dict):
                problems.append((str(label), "<stage>", "must be a mapping"))
                continue
            for k in sorted(set(rs) - _STAGE_KEYS):
                problems.append((str(label), k, f"unknown stage field; known: {sorted(_STAGE_KEYS)}"))
            for k in ("name", "op"):
                if not isinstance(rs.get(k), str) or not rs.get(k):
                    problems.append((str(label), k, "missing or not a string"))
            shapes = {"inputs": "op argument: stage.output", "params": "config field: value"}
            for k in ("inputs", "params"):
                if rs.get(k) is not None and not isinstance(rs.get(k), dict):
                    problems.append((str(label), k, f"must be a mapping ({shapes[k]} lines), got "
                                                    f"a {type(rs.get(k)).__name__}"))
                    rs = {**rs, k: {}}
            if rs.get("role") is not None and not isinstance(rs.get("role"), str):
                problems.append((str(label), "role", "must be a string"))
            stages.append(Stage(name=str(rs.get("name", label)), op=str(rs.get("op", "")),
                                role=rs.get("role"), inputs=dict(rs.get("inputs") or {}),
                                params=dict(rs.get("params") or {}), when=rs.get("when")))
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
            syncs.append(WeightSync(str(w["from"]), str(w["to"]), w.get("staleness", 0)))
        algorithm = d.get("algorithm") or {}
        if not isinstance(algorithm, dict):
            problems.append(("<graph>", "algorithm", "must be a mapping of algorithm settings "
                                                     f"(field: value), got a {type(algorithm).__name__}"))
            algorithm = {}
        if problems:
            raise GraphError(problems)
        return cls(name=name, stages=stages, weight_sync=syncs, description=description,
                   algorithm=dict(algorithm))

    @classmethod
    def from_yaml(cls, text: str) -> "Graph":
        """Parse YAML text; the leading ``#`` comment block becomes ``description``."""
        desc_lines = []
        for line in text.splitlines():
            if line.startswith("#"):
                desc_lines.append(line[2:] if line.startswith("# ") else line[1:])
            else:
                break
        try:
            d = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise GraphError([("<graph>", "<yaml>", f"not valid YAML: {e}")]) from e
        return cls.from_dict(d, description="\n".join(desc_lines))

    @classmethod
    def load(cls, path: str | Path) -> "Graph":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"graph file not found: {p}")
        return cls.from_yaml(p.read_text())
