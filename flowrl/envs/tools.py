"""Tools: Python functions with JSON schemas, run in worker processes with limits.

A tool is a plain function ``fn(**arguments) -> str`` (a JSON-serialisable value is sent as
JSON). The stage's ``params.tools`` lists them, each one of:

- a built-in name (:data:`BUILTIN_TOOLS`: ``calculator``);
- an import path ``"package.module:function"``; its schema is read from its signature and
  Google-style docstring by ``transformers.utils.get_json_schema``;
- a mapping ``{path: "module:function", schema: {...} | "<json>", name: "..."}`` with an explicit
  schema in the OpenAI/transformers form
  ``{"type": "function", "function": {"name", "description", "parameters": {"type": "object",
  "properties": {...}, "required": [...]}}}`` (or just its ``function`` part).

The schemas go to the chat template (``apply_chat_template(..., tools=schemas)``) so the policy
sees them. Everything is checked when the graph compiles, before any model loads
(:func:`resolve_tools`: unknown tool, import failure, a schema that does not parse).

Execution (:class:`ToolRunner`): calls run in the process pool of the reward-function contract
(``flowrl.rewards.function.RewardFunctionRunner``: spawned workers, a ``SIGALRM`` timeout per
call, a hung worker's pool killed and replaced, a dying worker's other calls retried alone); each
worker also caps its address space at ``memory_mb`` (``RLIMIT_AS``). A call that does not parse,
names an unknown tool, has arguments its schema rejects, raises, times out, kills its worker or
returns something that is not text/JSON gives a :class:`~flowrl.envs.base.ToolResult` with
``ok=False`` and a message for the policy; the run goes on.
"""
from __future__ import annotations

import copy
import difflib
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from flowrl.envs.base import ToolResult
from flowrl.envs.parsers import ParsedCall

BUILTIN_TOOLS: dict[str, str] = {"calculator": "flowrl.envs.calculator:calculator"}


def _builtin_schemas() -> dict[str, dict[str, Any]]:
    from flowrl.envs.calculator import CALCULATOR_SCHEMA

    return {"flowrl.envs.calculator:calculator": CALCULATOR_SCHEMA}


BUILTIN_SCHEMAS = _builtin_schemas()
_JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")


@dataclass(frozen=True)
class ToolSpec:
    """A resolved tool: ``name`` (what the policy calls), ``path`` (``module:function``) and
    ``schema`` (the full ``{"type": "function", "function": {...}}`` mapping, as JSON text so the
    spec is hashable and picklable)."""

    name: str
    path: str
    schema_json: str

    @property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.schema_json)

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"].get("parameters", {"type": "object", "properties": {}})


def _load(path: str, where: str) -> Callable[..., Any]:
    from flowrl.rewards.function import load_reward_function

    try:
        return load_reward_function(path)
    except ValueError as e:
        raise ValueError(f"{where}: {str(e).replace('reward function', 'tool')}") from None


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """A tool schema in the full form, checked; a bare ``function`` part is wrapped.

    Raises:
        ValueError: naming ``where``: not JSON / not a mapping, no ``name``, ``parameters`` not an
            object schema with a ``properties`` mapping of typed entries, ``required`` naming an
            unknown property.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: the schema is not valid JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where}: the schema must be a mapping, got {type(schema).__name__}")
    schema = json.loads(json.dumps(schema))  # plain dicts (an OmegaConf node becomes one)
    fn = schema.get("function", schema) if schema.get("type", "function") == "function" else None
    if not isinstance(fn, Mapping):
        raise ValueError(f"{where}: the schema must be {{'type': 'function', 'function': {{...}}}}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}: the schema has no function name ('function.name')")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping) or params.get("type") != "object" or \
            not isinstance(params.get("properties", {}), Mapping):
        raise ValueError(f"{where}: 'function.parameters' must be an object schema "
                         "{'type': 'object', 'properties': {...}}")
    for pname, p in params.get("properties", {}).items():
        kinds = p.get("type") if isinstance(p, Mapping) else None
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not all(k in _JSON_TYPES for k in kinds):
            raise ValueError(f"{where}: parameter '{pname}' has no JSON type (one of {_JSON_TYPES})")
    req = params.get("required", [])
    if not isinstance(req, list) or not set(req) <= set(params.get("properties", {})):
        raise ValueError(f"{where}: 'required' must list parameters of 'properties', got {req!r}")
    return {"type": "function", "function": dict(fn)}


def resolve_tools(entries: Sequence[Any], field: str = "params.tools") -> list[ToolSpec]:
    """The :class:`ToolSpec` of each entry of ``params.tools`` (see the module docstring).

    Raises:
        ValueError: one line naming ``field[i]``: an unknown built-in (with the close match), a
            path that does not import, a schema that does not parse, two tools of one name.
    """
    if entries is None:
        return []
    if isinstance(entries, (str, Mapping)) or not isinstance(entries, Sequence):
        raise ValueError(f"{field} must be a list of tools, got {entries!r}")
    specs: list[ToolSpec] = []
    for i, entry in enumerate(entries):
        where = f"{field}[{i}]"
        schema = name = None
        if isinstance(entry, Mapping):
            unknown = sorted(set(entry) - {"path", "schema", "name"})
            if unknown or "path" not in entry:
                raise ValueError(f"{where}: a tool mapping has keys path, schema, name "
                                 f"(path required), got {sorted(entry)}")
            path, schema, name = entry["path"], entry.get("schema"), entry.get("name")
        elif isinstance(entry, str):
            path = entry
        else:
            raise ValueError(f"{where}: a tool is a name, 'module:function' or a mapping, got {entry!r}")
        if ":" not in path:
            if path not in BUILTIN_TOOLS:
                close = difflib.get_close_matches(path, list(BUILTIN_TOOLS), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ValueError(f"{where}: unknown tool '{path}'{hint}; built-in tools: "
                                 f"{sorted(BUILTIN_TOOLS)}, or give 'module:function'")
            path = BUILTIN_TOOLS[path]
        fn = _load(path, where)
        if schema is None and path in BUILTIN_SCHEMAS:
            schema = copy.deepcopy(BUILTIN_SCHEMAS[path])
        if schema is None:
            from transformers.utils import get_json_schema

            try:
                schema = get_json_schema(fn)
            except Exception as e:  # transformers raises its own TypeError subclasses
                raise ValueError(f"{where}: no schema given and none can be read from "
                                 f"{path}'s signature and docstring: {e}") from None
            schema.get("function", {}).pop("return", None)
        full = check_schema(schema, where)
        if name is not None:
            full["function"]["name"] = str(name)
        specs.append(ToolSpec(full["function"]["name"], path, json.dumps(full, sort_keys=True)))
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{field}: two tools named {dup[0]!r}; give one of them another 'name'")
    return specs


def check_arguments(args: Mapping[str, Any], parameters: Mapping[str, Any]) -> Optional[str]:
    """Why ``args`` do not fit the schema's ``parameters`` (missing required, unknown name, a
    wrong JSON type of a top-level argument), or None when they do."""
    props = parameters.get("properties", {})
    missing = [r for r in parameters.get("required", []) if r not in args]
    if missing:
        return f"missing required argument(s) {missing}"
    unknown = [a for a in args if a not in props]
    if unknown and not parameters.get("additionalProperties", False):
        return f"unknown argument(s) {unknown}; the tool takes {sorted(props)}"
    checks = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "null": lambda v: v is None}
    for a, v in args.items():
        kinds = props.get(a, {}).get("type")
        if kinds is None:
            continue
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(checks[k](v) for k in kinds if k in checks):
            return f"argument '{a}' must be {'/'.join(kinds)}, got {type(v).__name__}"
    return None


# --------------------------------------------------------------------------- worker side
_MEMORY_SET = False


def _limit_memory(memory_mb: Optional[int]) -> None:
    """Cap this worker's address space once (RLIMIT_AS; Linux/macOS)."""
    global _MEMORY_SET
    if _MEMORY_SET or not memory_mb:
        return
    _MEMORY_SET = True
    try:
        import resource

        limit = int(memory_mb) << 20
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # no rlimits here: the timeout still applies
        pass


def dispatch(arguments_json: str, fields: dict, meta: dict) -> Any:
    """Worker entry point in the reward-function contract's shape ``fn(text, fields, meta)``:
    ``text`` = the call's arguments as JSON, ``fields`` = ``{"path": tool path, "memory_mb": cap
    or None}``. Returns the tool's output as ``("ok", text)`` or ``("bad_output", why)``."""
    _limit_memory(fields.get("memory_mb"))
    fn = _load(fields["path"], "tool")
    out = fn(**json.loads(arguments_json))
    if isinstance(out, str):
        return ("ok", out)
    try:
        return ("ok", json.dumps(out))
    except (TypeError, ValueError):
        return ("bad_output", f"the tool returned {type(out).__name__}, not text or JSON")


def _runner_class():
    from flowrl.rewards.function import Outcome, RewardFunctionRunner

    class _RawRunner(RewardFunctionRunner):
        """The reward pool, keeping each call's raw value (a reward runner wants numbers)."""

        def _outcome(self, status: str, value: Any) -> Outcome:
            if status == "ok":  # dispatch's (kind, text): "ok" or "bad_output"
                return Outcome(value[0], {}, value[1])
            return Outcome(status, {}, "" if value is None else str(value))

    return _RawRunner


class ToolRunner:
    """Executes parsed tool calls, many at once, in worker processes.

    Args:
        tools: the resolved tools.
        num_workers: worker processes (0 = in this process: no memory cap; the timeout needs the
            main thread).
        timeout_s: per-call limit (None/0 = none).
        memory_mb: address-space cap per worker (None/0 = none).
        max_output_chars: a longer output is cut to this many characters (marked ``...``).
    """

    def __init__(self, tools: Sequence[ToolSpec], num_workers: int = 2,
                 timeout_s: Optional[float] = 10.0, memory_mb: Optional[int] = 2048,
                 max_output_chars: int = 2000) -> None:
        self.tools = {t.name: t for t in tools}
        self.memory_mb = memory_mb if num_workers > 0 else None
        self.max_output_chars = max_output_chars
        self._pool = _runner_class()("flowrl.envs.tools:dispatch", num_workers, timeout_s)

    def run(self, calls: Sequence[ParsedCall]) -> list[ToolResult]:
        """One :class:`ToolResult` per call, in order; the valid calls run concurrently."""
        results: list[Optional[ToolResult]] = [None] * len(calls)
        todo: list[int] = []
        for i, c in enumerate(calls):
            if c.error is not None:
                results[i] = ToolResult(c.name, c.arguments, f"Error: {c.error}", False, "parse_error")
            elif c.name not in self.tools:
                results[i] = ToolResult(c.name, c.arguments, f"Error: unknown tool '{c.name}'; "
                                        f"available: {sorted(self.tools)}", False, "unknown_tool")
            else:
                why = check_arguments(c.arguments, self.tools[c.name].parameters)
                if why is not None:
                    results[i] = ToolResult(c.name, c.arguments, f"Error: {c.name}: {why}", False,
                                            "bad_arguments")
                else:
                    todo.append(i)
        if todo:
            t0 = time.perf_counter()
            outs = self._pool.score(
                [json.dumps(calls[i].arguments) for i in todo],
                [{"path": self.tools[calls[i].name].path, "memory_mb": self.memory_mb} for i in todo],
                [{} for _ in todo])
            dt = (time.perf_counter() - t0) / len(todo)
            for i, o in zip(todo, outs):
                c = calls[i]
                ok, status = o.status == "ok", o.status
                if o.status in ("ok", "bad_output"):
                    content = o.detail if ok else f"Error: {c.name}: {o.detail}"
                elif o.status == "timeout":
                    status, ok = "timeout", False
                    content = f"Error: {c.name} did not finish within {self._pool.timeout_s:g} s"
                else:
                    status, ok = "error", False
                    content = f"Error: {c.name} failed: {o.detail}"
                if len(content) > self.max_output_chars:
                    content = content[:self.max_output_chars] + "..."
                results[i] = ToolResult(c.name, c.arguments, content, ok, status, dt)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self._pool.close()
