"""Op registry: every graph stage names an op registered here.

Each op is declared where it is written: its module puts ``@register_op(name, inputs=...,
outputs=..., config=..., roles=..., check=...)`` on the function (built-in ops and ops of your
own alike). The built-in op modules (``ops/builtin.py`` ``MODULES``) are imported when this
module is; they import torch inside their functions only, so the graph validator and the
compiler read every declaration without torch (``tests/unit/test_import_contract.py``).

An op is a plain function ``fn(ctx, cfg, *, <inputs>) -> <outputs>``; its return annotation, a
``TypedDict`` (``ops/fields.py`` has the shared ones: ``Rewards``, ``Rollout``, ...), is its
output contract: ``register_op`` takes the op's ``outputs`` from its keys (or, where both are
given, refuses a declaration that disagrees with it), so the names a graph wires and the keys
mypy checks in the function's ``return`` are one list (every built-in op has one; an op made
per registration, such as one per advantage estimator, picks its function's return type when it
is made). An op of your own may still return a plain ``dict[str, ...]`` and declare
``outputs=``; the executor checks the keys of every call.
"""
from __future__ import annotations

import inspect
import typing
from typing import Any, Callable, Mapping, Optional

from flowrl.ops.fields import LIST, TENSOR, Field
from flowrl.ops.spec import NoConfig, OpSpec

__all__ = ["LIST", "TENSOR", "NoConfig", "OPS", "OpSpec", "get_op", "load_builtin_ops",
           "output_type", "register_op", "run_op_checks"]

OPS: dict[str, OpSpec] = {}


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


def output_type(fn: Callable) -> Optional[type]:
    """The ``TypedDict`` that ``fn``'s return annotation names, else None (no annotation, a
    plain ``dict``, or a name that does not resolve in ``fn``'s module when it is registered:
    the class must be defined or imported above the function)."""
    ann = inspect.signature(fn).return_annotation
    if isinstance(ann, str):  # ``from __future__ import annotations``
        try:
            ann = eval(ann, fn.__globals__)  # the function's own annotation, in its module
        except Exception:  # a name imported only under TYPE_CHECKING, a subscripted dict, ...
            return None
    return ann if isinstance(ann, type) and typing.is_typeddict(ann) else None


def _check_fields(name: str, names: tuple[str, ...], fields: Mapping[str, Field] | None,
                  kinds: Mapping[str, str]) -> None:
    """``fields`` and ``kinds`` name only the op's inputs/outputs ``names``, with a known kind.

    Raises:
        ValueError: naming the op and the entry."""
    unknown = sorted(set(fields or {}) - set(names))
    if unknown:
        raise ValueError(f"op '{name}': fields {unknown} are none of its inputs/outputs")
    for key, kind in kinds.items():
        if key not in names or kind not in (TENSOR, LIST):
            raise ValueError(f"op '{name}': kinds[{key!r}] = {kind!r}: the key must be one of its "
                             f"inputs/outputs and the kind '{TENSOR}' or '{LIST}'")


def register_op(
    name: str,
    *,
    inputs: tuple[str, ...] = (),
    outputs: Optional[tuple[str, ...]] = None,
    optional_inputs: tuple[str, ...] = (),
    config: type = NoConfig,
    roles: tuple[str, ...] = (),
    kinds: Mapping[str, str] | None = None,
    trains: bool = False,
    multi_turn_outputs: tuple[str, ...] = (),
    single_turn_inputs: tuple[str, ...] = (),
    info_outputs: tuple[str, ...] = (),
    fields: Mapping[str, Field] | None = None,
    check: Callable[[Any, Any], None] | None = None,
    doc: str = "",
) -> Callable[[Callable], Callable]:
    """Declare op ``name`` and register ``fn`` as its function. ``outputs``: the names it
    returns; default: the keys of its return annotation's ``TypedDict`` (:func:`output_type`),
    in their order (none without one). ``fields``, ``kinds``,
    ``trains``, ``multi_turn_outputs``, ``single_turn_inputs``, ``info_outputs``, ``check``: see
    :class:`OpSpec`; ``doc``: one line (default: the first line of the function's docstring).

    Raises:
        ValueError: a duplicate name, or ``fields`` / ``kinds`` naming something the op neither
            takes nor produces, or a kind other than ``"tensor"`` / ``"list"``. TypeError: the
            function's arguments disagree with ``inputs`` (:func:`_check_signature`), or
            ``outputs`` with its return ``TypedDict``'s keys.
    """
    kinds = dict(kinds or {})
    if outputs is not None:  # at the call, as the declaration is read
        _check_fields(name, (*inputs, *optional_inputs, *outputs), fields, kinds)

    def deco(fn: Callable) -> Callable:
        if name in OPS:
            raise ValueError(f"op '{name}' is already registered")
        typed = output_type(fn)
        keys = tuple(typed.__annotations__) if typed is not None else ()
        if outputs is not None and typed is not None and set(outputs) != set(keys):
            raise TypeError(f"op '{name}': {fn.__module__}.{fn.__name__} returns "
                            f"{typed.__name__} with keys {list(keys)}, but declares outputs "
                            f"{list(outputs)}: declare one (drop outputs=)")
        outs = tuple(outputs if outputs is not None else keys)
        if outputs is None:  # the outputs are known only now
            _check_fields(name, (*inputs, *optional_inputs, *outs), fields, kinds)
        first = (fn.__doc__ or "").strip().splitlines()
        spec = OpSpec(name=name, inputs=tuple(inputs), outputs=outs, output_type=typed,
                      optional_inputs=tuple(optional_inputs), config_cls=config,
                      roles=tuple(roles), doc=doc or (first[0] if first else ""),
                      fields=dict(fields or {}), kinds=kinds, trains=trains,
                      multi_turn_outputs=tuple(multi_turn_outputs),
                      single_turn_inputs=tuple(single_turn_inputs),
                      info_outputs=tuple(info_outputs), check=check)
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
    """Import every built-in op module (idempotent; done when this module is imported)."""
    from flowrl.ops import builtin

    builtin.load()


def run_op_checks(plan: Any, cfg: Any) -> None:
    """Each op's pre-run check (``OpSpec.check``), once per op of the compiled ``plan``, against
    the run config ``cfg`` (``flowrl.config.TrainConfig``); the pre-flight calls it before any
    model loads. Raises what a check raises (ValueError naming the stage)."""
    for name in sorted({c.stage.op for c in plan.stages}):
        check = get_op(name).check
        if check is not None:
            check(plan, cfg)


# last: the op modules register through this module's register_op
load_builtin_ops()
