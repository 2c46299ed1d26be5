"""Op registry: every graph stage names an op registered here.

``OPS`` starts with the built-in ops' declarations (``ops/builtin.py``: inputs, optional inputs,
outputs, config dataclass, roles), which is all the graph validator and the compiler read; neither
ever calls an op, so neither imports torch or op code. A built-in op's function is bound by its
module's ``@implements(name)`` when ``OpSpec.fn`` first needs it. An op of your own is declared
and bound at once with ``@register_op(name, inputs=..., outputs=..., config=..., roles=...)``.

An op is a plain function ``fn(ctx, cfg, *, <inputs>) -> dict[str, Any]``.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Callable, Mapping

from flowrl.ops.builtin import BUILTIN_OPS
from flowrl.ops.spec import LIST, TENSOR, NoConfig, OpSpec

__all__ = ["LIST", "TENSOR", "NoConfig", "OPS", "OpSpec", "get_op", "implements", "load_builtin_ops", "register_op"]

OPS: dict[str, OpSpec] = {s.name: s for s in BUILTIN_OPS}


def _check_signature(spec: OpSpec, fn: Callable) -> None:
    """The function takes ``(ctx, cfg)`` and a keyword argument per declared input (the executor
    passes every input, ``None`` for an unbound optional one), or ``**kwargs`` for the rest.

    Raises:
        TypeError: naming the op and the arguments that disagree with its declaration.
    """
    params = list(inspect.signature(fn).parameters.values())[2:]
    named = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    extra = sorted(named - set(spec.all_inputs))
    missing = [] if var_kw else sorted(set(spec.all_inputs) - named)
    if extra or missing:
        raise TypeError(f"op '{spec.name}': {fn.__module__}.{fn.__name__} does not match its "
                        f"declaration (inputs {list(spec.inputs)}, optional "
                        f"{list(spec.optional_inputs)}): undeclared {extra}, missing {missing}")


def implements(name: str) -> Callable[[Callable], Callable]:
    """Bind ``fn`` to the declared op ``name`` (``ops/builtin.py``).

    Raises:
        KeyError: ``name`` is not declared. ValueError: already bound to another function.
        TypeError: the function's keyword arguments disagree with the declared inputs.
    """
    def deco(fn: Callable) -> Callable:
        if name not in OPS:
            raise KeyError(f"op '{name}' is not declared in flowrl/ops/builtin.py")
        spec = OPS[name]
        if spec.bound is not None and spec.bound is not fn:
            raise ValueError(f"op '{name}' is already implemented by {spec.bound.__module__}")
        _check_signature(spec, fn)
        spec.bound = fn
        return fn

    return deco



def register_op(
    name: str,
    *,
    inputs: tuple[str, ...] = (),
    outputs: tuple[str, ...] = (),
    optional_inputs: tuple[str, ...] = (),
    config: type = NoConfig,
    roles: tuple[str, ...] = (),
    kinds: Mapping[str, str] | None = None,
    trains: bool = False,
    multi_turn_outputs: tuple[str, ...] = (),
    single_turn_inputs: tuple[str, ...] = (),
    info_outputs: tuple[str, ...] = (),
) -> Callable[[Callable], Callable]:
    """Declare op ``name`` and register ``fn`` as its function (ops of your own; built-in ops are
    declared in ``ops/builtin.py`` and bound with :func:`implements`). ``kinds``, ``trains``,
    ``multi_turn_outputs``, ``single_turn_inputs``, ``info_outputs``: see :class:`OpSpec`.

    Raises:
        ValueError: a duplicate name, or ``kinds`` naming something the op neither takes nor
            produces, or a kind other than ``"tensor"`` / ``"list"``. TypeError: see
            :func:`implements`.
    """
    kinds = dict(kinds or {})
    for key, kind in kinds.items():
        if key not in (*inputs, *optional_inputs, *outputs) or kind not in (TENSOR, LIST):
            raise ValueError(f"op '{name}': kinds[{key!r}] = {kind!r}: the key must be one of its "
                             f"inputs/outputs and the kind '{TENSOR}' or '{LIST}'")

    def deco(fn: Callable) -> Callable:
        if name in OPS:
            raise ValueError(f"op '{name}' is already registered")
        spec = OpSpec(name=name, inputs=tuple(inputs), outputs=tuple(outputs),
                      optional_inputs=tuple(optional_inputs), config_cls=config,
                      roles=tuple(roles),
                      doc=(fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "",
                      kinds=kinds, trains=trains, multi_turn_outputs=tuple(multi_turn_outputs),
                      single_turn_inputs=tuple(single_turn_inputs),
                      info_outputs=tuple(info_outputs))
        _check_signature(spec, fn)
        spec.bound = fn
        OPS[name] = spec
        return fn

    return deco


def get_op(name: str) -> OpSpec:
    """Look up an op. Raises KeyError listing the registered names."""
    if name not in OPS:
        raise KeyError(f"unknown op '{name}'; registered ops: {sorted(OPS)}")
    return OPS[name]


def load_builtin_ops() -> None:
    """Import every built-in op's implementing module, binding all functions (idempotent; imports
    torch). Validation and compilation never need it; a run binds each op on first call."""
    for module in sorted({s.module for s in BUILTIN_OPS}):
        importlib.import_module(module)
