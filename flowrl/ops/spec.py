"""What an op is, as the graph validator and the compiler see it: :class:`OpSpec`.

No torch here. Each op module declares its op next to its function (``registry.register_op``)
and imports torch inside its functions only, so importing every op module to read the
declarations (validating a graph, printing a plan) imports no torch.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Optional, Union

from flowrl.ops.fields import Field, field_of


@dataclass
class NoConfig:
    """Config of an op that takes no parameters."""


@dataclass
class OpSpec:
    """Declaration of one op.

    Attributes:
        name: registry key used in graph files (``op: advantage.grpo``).
        inputs: required keyword arguments, each bound by the stage to ``"stage.output"``.
        outputs: names the op produces; referenced by consumers as ``"<stage name>.<output>"``.
        optional_inputs: keyword arguments that may be left unbound (the op receives ``None``).
        config_cls: dataclass holding the op's parameters and their defaults; graph ``params``
            override its fields.
        roles: roles the stage may declare (``()`` = the op uses no model and takes no role).
        doc: one line saying what the op does (``flowrl`` listings).
        fields: shape/dtype/kind of an input or output where it differs from the standard
            field of that name (``ops/fields.py`` ``FIELDS``); :meth:`field_type` resolves either.
        kinds: what an input or output holds, where neither ``fields`` nor the standard field
            says: ``"list"`` = a Python list, one entry per sample (``ground_truth``). The
            validator refuses a list wired into a tensor input, and the reverse, before any
            model loads.
        trains: the op updates a model's weights (``update.policy``, ``update.critic``); a
            training graph needs at least one such stage.
        multi_turn_outputs: outputs whose rows hold several policy turns with environment tokens
            between them (mask False there: ``rollout.multi_turn``).
        single_turn_inputs: inputs that cannot take such rows (the graph validator refuses a
            multi-turn output bound to one, naming stage and field).
        info_outputs: per-row metadata a graph may leave unconsumed (no unused-output warning).
        check: ``check(plan, cfg)``, the op's pre-run check of a compiled plan against the run
            config (``flowrl.config.TrainConfig``), run by the pre-flight before any model
            loads; raises ValueError naming the stage. None = nothing to check.
        output_type: the ``TypedDict`` the function returns (its keys are ``outputs``), or
            None for an op that returns a plain dict (``registry.register_op``).
        bound: the op's function (:attr:`fn`), set by ``registry.register_op``.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_cls: type = NoConfig
    roles: tuple[str, ...] = ()
    doc: str = ""
    fields: Mapping[str, Field] = field(default_factory=dict)
    kinds: Mapping[str, str] = field(default_factory=dict)
    trains: bool = False
    multi_turn_outputs: tuple[str, ...] = ()
    single_turn_inputs: tuple[str, ...] = ()
    info_outputs: tuple[str, ...] = ()
    check: Callable[[Any, Any], None] | None = field(default=None, repr=False, compare=False)
    output_type: Optional[type] = field(default=None, repr=False, compare=False)
    bound: Callable[..., Mapping[str, Any]] | None = field(default=None, repr=False, compare=False)

    @property
    def all_inputs(self) -> tuple[str, ...]:
        return self.inputs + self.optional_inputs

    def field_type(self, name: str) -> Field:
        """Shape, dtype and kind of input or output ``name``: the op's own ``fields`` entry,
        else the standard field (``ops/fields.py``), else a batch-first tensor of any shape."""
        if name in self.fields:
            return self.fields[name]
        std = field_of(name)
        return Field(std.shape, std.dtype, self.kinds[name]) if name in self.kinds else std

    def kind(self, name: str) -> str:
        """``"tensor"`` or ``"list"``: what input or output ``name`` holds (:meth:`field_type`)."""
        return self.field_type(name).kind

    @property
    def fn(self) -> Callable[..., Mapping[str, Any]]:
        """``fn(ctx: StageContext, cfg: config_cls, **inputs) -> dict[str, Any]`` (keys exactly
        ``outputs``).

        Raises:
            LookupError: a declaration without a function.
        """
        if self.bound is None:
            raise LookupError(f"op '{self.name}' has no function (declare it with "
                              f"@register_op({self.name!r}, ...) on the function)")
        return self.bound

    def make_config(self, params: Mapping[str, Any] | None, *, stage: str) -> Any:
        """Build the op's config from graph ``params`` (values as written, not converted: an
        int given to a float field stays an int).

        Raises:
            ParamError: an unknown field, or a value that does not match the field's type
                annotation (:func:`check_params`); the message names the stage and the field.
            ValueError: a value the config's ``__post_init__`` rejects (``stage '<stage>':
                params: <its message>``).
        """
        params = dict(params or {})
        self.check_params(params, stage=stage)
        try:
            return self.config_cls(**params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"stage '{stage}': params: {e}") from e

    def check_params(self, params: Mapping[str, Any], *, stage: str) -> None:
        """Check graph ``params`` against the config's fields without building it: each name is
        a field, each value matches the field's annotation (:func:`type_mismatch`). The graph
        validator calls this on the literal params of a stage whose other params are still
        ``${...}`` interpolations.

        Raises:
            ParamError: the first unknown name or mismatched value, e.g. ``stage 'reward':
                params.format_score: expected a float, got 'abc' (str)``.
        """
        known = [f.name for f in dataclasses.fields(self.config_cls) if f.init]
        unknown = sorted(set(params) - set(known))
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1) if len(unknown) == 1 else []
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ParamError(stage, "params", f"unknown param(s) {unknown} for op '{self.name}'; "
                             + (f"{hint}known: {sorted(known)}" if known else
                                "it takes no params: drop them"))
        hints = field_types(self.config_cls)
        for name, value in params.items():
            bad = type_mismatch(value, hints.get(name, Any), f"params.{name}")
            if bad is not None:
                raise ParamError(stage, *bad)


class ParamError(ValueError):
    """A stage's ``params`` that its op's config cannot take.

    ``str(e)`` is ``stage '<stage>': <field>: <detail>``; the graph validator reports
    ``(stage, field, detail)`` as one problem line.
    """

    def __init__(self, stage: str, fld: str, detail: str) -> None:
        super().__init__(f"stage '{stage}': {fld}: {detail}")
        self.stage, self.field, self.detail = stage, fld, detail


def field_types(cls: type) -> dict[str, Any]:
    """Field name → resolved type annotation of dataclass ``cls``.

    Annotations written as strings (``from __future__ import annotations``) are evaluated in the
    defining module's namespace; one that does not evaluate (a name imported only under
    ``TYPE_CHECKING``, a class local to a function) becomes ``Any``, so a config the checker
    cannot read is never refused for it.
    """
    try:
        return typing.get_type_hints(cls)
    except Exception:  # NameError, TypeError, ...: fall back field by field
        pass
    module = sys.modules.get(cls.__module__)
    ns = dict(vars(module)) if module is not None else {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = f.type
        if isinstance(tp, str):
            try:
                tp = eval(tp, ns)  # the config's own annotation, as get_type_hints evaluates it
            except Exception:
                tp = Any
        out[f.name] = tp
    return out


_NAMES = {bool: "a bool", int: "an int", float: "a float", str: "a str", type(None): "null"}
_UNION_TYPES: tuple[Any, ...] = (Union, types.UnionType)


def type_mismatch(value: Any, tp: Any, path: str) -> Optional[tuple[str, str]]:
    """Whether a YAML value fits annotation ``tp``: ``None`` if it does, else ``(path of the
    offending part, "expected <type>, got <value> (<its type>)")``.

    Understood: ``int`` (not a bool), ``float`` (an int too), ``bool``, ``str``, ``None``,
    ``Optional``/``Union``, ``Literal``, ``list``/``tuple``/``set``/``Sequence`` (a YAML list),
    ``dict``/``Mapping`` (a YAML mapping; keys and values checked, ``path.key``), nested
    dataclasses (a mapping of their fields, or an instance). Anything else (``Any``, a
    TypeVar, another class, which an op's ``__post_init__`` may convert to) accepts any value.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or isinstance(tp, typing.TypeVar):
        return None
    if tp in _NAMES:
        return None if _is(value, tp) else (path, _expected(_NAMES[tp], value))
    if origin in _UNION_TYPES:
        if any(type_mismatch(value, a, path) is None for a in args):
            return None
        simple = [a for a in args if a in _NAMES or typing.get_origin(a) is Literal]
        if len(simple) == len(args):  # all scalar: name them all
            return path, _expected(" or ".join(_describe(a) for a in args), value)
        fits = [a for a in args if _shape_fits(value, a)]  # e.g. Optional[list[str]]: ['a', 1]
        return type_mismatch(value, fits[0], path) if len(fits) == 1 else \
            (path, _expected(" or ".join(_describe(a) for a in args), value))
    if origin is Literal:
        ok = any(value == a and type(value) is type(a) for a in args)
        return None if ok else (path, _expected(_describe(tp), value))
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_mismatch(value, tp, path)
    container = origin or tp
    if not isinstance(container, type):
        return None  # e.g. a Callable[...] or NewType: not understood, accept
    if issubclass(container, (str, bytes)):
        return None  # a str subclass other than str itself: not understood
    if issubclass(container, collections.abc.Mapping):
        if not isinstance(value, collections.abc.Mapping):
            return path, _expected("a mapping", value)
        kt, vt = (args + (Any, Any))[:2] if args else (Any, Any)
        for k, v in value.items():
            bad = type_mismatch(k, kt, f"{path} key {k!r}")
            if bad is None:
                bad = type_mismatch(v, vt, f"{path}.{k}")
            if bad is not None:
                return bad
        return None
    if issubclass(container, (collections.abc.Sequence, collections.abc.Set)):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
            return path, _expected("a list", value)
        items = list(value)
        if issubclass(container, tuple) and args and args[-1] is not Ellipsis:
            if len(items) != len(args):
                return path, _expected(f"a list of {len(args)} items", value)
            elem_types = list(args)
        else:
            elem_types = [args[0] if args else Any] * len(items)
        for i, (v, t) in enumerate(zip(items, elem_types)):
            bad = type_mismatch(v, t, f"{path}[{i}]")
            if bad is not None:
                return bad
        return None
    return None  # another class: the config's __post_init__ may build it from what YAML gives


def _is(value: Any, tp: type) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:  # YAML writes 1 for 1.0; the value is kept as the int
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def _shape_fits(value: Any, tp: Any) -> bool:
    """``value`` is the kind of YAML node ``tp`` takes (a mapping, a list, a scalar)."""
    c = typing.get_origin(tp) or tp
    if dataclasses.is_dataclass(c) or (isinstance(c, type) and issubclass(c, collections.abc.Mapping)):
        return isinstance(value, collections.abc.Mapping)
    if isinstance(c, type) and issubclass(c, (list, tuple, set, collections.abc.Sequence)) and \
            not issubclass(c, (str, bytes)):
        return isinstance(value, (list, tuple, set, frozenset))
    return False


def _dataclass_mismatch(value: Any, cls: type, path: str) -> Optional[tuple[str, str]]:
    if isinstance(value, cls):
        return None
    if not isinstance(value, collections.abc.Mapping):
        return path, _expected(f"a mapping of {cls.__name__} fields", value)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - known, key=str)
    if unknown:
        return path, f"unknown field(s) {unknown} of {cls.__name__}; known: {sorted(known)}"
    hints = field_types(cls)
    for k, v in value.items():
        bad = type_mismatch(v, hints.get(k, Any), f"{path}.{k}")
        if bad is not None:
            return bad
    return None


def _describe(tp: Any) -> str:
    if tp in _NAMES:
        return _NAMES[tp]
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    c = typing.get_origin(tp) or tp
    if dataclasses.is_dataclass(c) or (isinstance(c, type) and issubclass(c, collections.abc.Mapping)):
        return "a mapping"
    if isinstance(c, type) and issubclass(c, (list, tuple, set, collections.abc.Sequence)):
        return "a list"
    return getattr(tp, "__name__", str(tp))


def _expected(what: str, value: Any) -> str:
    text = f"expected {what}, got {value!r} ({type(value).__name__})"
    if what.startswith(("a float", "an int")) and isinstance(value, str):
        m = re.fullmatch(r"\s*([-+]?\d+)([eE][-+]?\d+)\s*", value)
        if m:  # PyYAML (YAML 1.1) reads an exponent without a dot in the mantissa as a string
            text += f"; YAML reads {value} as a string: write {m[1]}.0{m[2]}"
        else:
            try:
                float(value)
                text += "; write the number without quotes"
            except ValueError:
                pass
    return text
