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
        kinds: what an input or output holds where it is not a tensor with a leading batch
            dimension: ``"list"`` = a Python list, one entry per sample (``ground_truth``). The
            validator refuses a list wired into a tensor input, and the reverse, before any
            model loads.
        trains: the op updates a model's weights (``update.policy``, ``update.critic``); a
            training graph needs at least one such stage.
    """

    name: str
    fn: Callable[..., Mapping[str, Any]]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_cls: type = NoConfig
    roles: tuple[str, ...] = ()
    doc: str = ""
    kinds: Mapping[str, str] = field(default_factory=dict)
    trains: bool = False

    @property
    def all_inputs(self) -> tuple[str, ...]:
        return self.inputs + self.optional_inputs

    def kind(self, name: str) -> str:
        """``"tensor"`` or ``"list"``: what input or output ``name`` holds (see ``kinds``)."""
        return self.kinds.get(name, TENSOR)

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

TENSOR, LIST = "tensor", "list"  # OpSpec.kinds values


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
) -> Callable[[Callable], Callable]:
    """Register ``fn`` as op ``name`` (``kinds``, ``trains``: see :class:`OpSpec`).

    Raises:
        ValueError: a duplicate name, or ``kinds`` naming something the op neither takes nor
            produces, or a kind other than ``"tensor"`` / ``"list"``.
    """
    kinds = dict(kinds or {})
    for key, kind in kinds.items():
        if key not in (*inputs, *optional_inputs, *outputs) or kind not in (TENSOR, LIST):
            raise ValueError(f"op '{name}': kinds[{key!r}] = {kind!r}: the key must be one of its "
                             f"inputs/outputs and the kind '{TENSOR}' or '{LIST}'")

    def deco(fn: Callable) -> Callable:
        if name in OPS:
            raise ValueError(f"op '{name}' is already registered")
        OPS[name] = OpSpec(
            name=name, fn=fn, inputs=tuple(inputs), outputs=tuple(outputs),
            optional_inputs=tuple(optional_inputs), config_cls=config, roles=tuple(roles),
            doc=(fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "",
            kinds=kinds, trains=trains,
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
                "critic", "advantage", "update"):
        importlib.import_module(f"flowrl.ops.{mod}")
