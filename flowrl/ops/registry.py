"""Op registry: every graph stage names an op registered here.

An op is a plain function ``fn(ctx, cfg, **inputs) -> dict[str, Any]`` declared with
:func:`register_op`. The declaration (inputs, optional inputs, outputs, config dataclass, roles it
may run under) is what the graph validator and the compiler read; neither ever calls the function.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass
class NoConfig:
    """Config of an op that takes no parameters."""


@dataclass(frozen=True)
class OpSpec:
    """Declaration of one op.

    Attributes:
        name: registry key used in graph files (``op: advantage.grpo``).
        fn: ``fn(ctx: StageContext, cfg: config_cls, **inputs) -> dict[str, Any]``; the dict's keys
            must be exactly ``outputs``.
        inputs: required keyword arguments, each bound by the stage to ``"stage.output"``.
        optional_inputs: keyword arguments that may be left unbound (the op receives ``None``).
        outputs: names the op produces; referenced by consumers as ``"<stage name>.<output>"``.
        config_cls: dataclass holding the op's parameters and their defaults; graph ``params``
            override its fields.
        roles: roles the stage may declare (``()`` = the op uses no model and takes no role).
        multi_turn_outputs: outputs whose rows hold several policy turns with environment tokens
            between them (mask False there: ``rollout.multi_turn``).
        single_turn_inputs: inputs that cannot take such rows (the graph validator refuses a
            multi-turn output bound to one, naming stage and field).
        info_outputs: per-row metadata a graph may leave unconsumed (no unused-output warning).
    """

    name: str
    fn: Callable[..., Mapping[str, Any]]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_cls: type = NoConfig
    roles: tuple[str, ...] = ()
    doc: str = ""
    multi_turn_outputs: tuple[str, ...] = ()
    single_turn_inputs: tuple[str, ...] = ()
    info_outputs: tuple[str, ...] = ()

    @property
    def all_inputs(self) -> tuple[str, ...]:
        return self.inputs + self.optional_inputs

    def make_config(self, params: Mapping[str, Any] | None, *, stage: str) -> Any:
        """Build the op's config from graph ``params``.

        Raises:
            ValueError: an unknown field or a value the config's ``__post_init__`` rejects; the
                message names the stage and the field.
        """
        params = dict(params or {})
        known = {f.name for f in dataclasses.fields(self.config_cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(
                f"stage '{stage}': unknown param(s) {unknown} for op '{self.name}'; "
                f"known: {sorted(known)}"
            )
        try:
            return self.config_cls(**params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"stage '{stage}': params: {e}") from e


OPS: dict[str, OpSpec] = {}


def register_op(
    name: str,
    *,
    inputs: tuple[str, ...] = (),
    outputs: tuple[str, ...] = (),
    optional_inputs: tuple[str, ...] = (),
    config: type = NoConfig,
    roles: tuple[str, ...] = (),
    multi_turn_outputs: tuple[str, ...] = (),
    single_turn_inputs: tuple[str, ...] = (),
    info_outputs: tuple[str, ...] = (),
) -> Callable[[Callable], Callable]:
    """Register ``fn`` as op ``name`` (arguments: the :class:`OpSpec` fields). Raises ValueError
    on a duplicate name."""

    def deco(fn: Callable) -> Callable:
        if name in OPS:
            raise ValueError(f"op '{name}' is already registered")
        OPS[name] = OpSpec(
            name=name, fn=fn, inputs=tuple(inputs), outputs=tuple(outputs),
            optional_inputs=tuple(optional_inputs), config_cls=config, roles=tuple(roles),
            doc=(fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "",
            multi_turn_outputs=tuple(multi_turn_outputs),
            single_turn_inputs=tuple(single_turn_inputs), info_outputs=tuple(info_outputs),
        )
        return fn

    return deco


def get_op(name: str) -> OpSpec:
    """Look up an op. Raises KeyError listing the registered names."""
    load_builtin_ops()
    if name not in OPS:
        raise KeyError(f"unknown op '{name}'; registered ops: {sorted(OPS)}")
    return OPS[name]


def load_builtin_ops() -> None:
    """Import flowrl's op modules so their ``register_op`` calls run (idempotent)."""
    import importlib

    for mod in ("sample", "rollout", "reward", "genrm", "filter", "token_rewards", "logprobs",
                "critic", "advantage", "update", "multi_turn"):
        importlib.import_module(f"flowrl.ops.{mod}")
