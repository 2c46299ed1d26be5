"""Op registry: every graph stage names an op registered here.

An op is a plain function ``fn(ctx, cfg, **inputs) -> dict[str, Any]`` declared with
:func:`register_op`. The declaration (inputs, optional inputs, outputs, config dataclass, roles it
may run under) is what the graph validator and the compiler read; neither ever calls the function.

An op that keeps state across steps (an adaptive KL coefficient, ...) declares it with
``state=OpStateSpec(key, make)``: the executor builds the state once per run into the run
resources under ``key`` (where the op reads it), and the job checkpoints every declared state
under one key of the checkpoint's trainer state and restores it on resume, the same way in
every placement (``runtime/job.py``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol


class OpState(Protocol):
    """State an op carries from one step to the next; JSON-able through its state dict (it goes
    into the checkpoint's ``trainer_state.json``, never pickled)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True)
class OpStateSpec:
    """An op's cross-step state.

    Attributes:
        key: the run resource holding it (``ctx.resources[key]``) and its name in the checkpoint;
            one state per run, shared by every stage of the op.
        make: ``make(resources) -> OpState``: the initial state from the run resources (e.g. the
            ``AlgorithmConfig`` under ``algorithm``).
    """

    key: str
    make: Callable[[Mapping[str, Any]], OpState]


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
        state: the op's cross-step state (:class:`OpStateSpec`), None for a stateless op.
    """

    name: str
    fn: Callable[..., Mapping[str, Any]]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_cls: type = NoConfig
    roles: tuple[str, ...] = ()
    doc: str = ""
    state: Optional[OpStateSpec] = None

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
    state: Optional[OpStateSpec] = None,
) -> Callable[[Callable], Callable]:
    """Register ``fn`` as op ``name`` (``state``: its cross-step state, :class:`OpStateSpec`).
    Raises ValueError on a duplicate name."""

    def deco(fn: Callable) -> Callable:
        if name in OPS:
            raise ValueError(f"op '{name}' is already registered")
        OPS[name] = OpSpec(
            name=name, fn=fn, inputs=tuple(inputs), outputs=tuple(outputs),
            optional_inputs=tuple(optional_inputs), config_cls=config, roles=tuple(roles),
            doc=(fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "",
            state=state,
        )
        return fn

    return deco


def init_op_states(op_names: Iterable[str], resources: dict[str, Any]) -> dict[str, OpState]:
    """The cross-step state of every op in ``op_names`` that declares one, created in
    ``resources`` under its key unless already there (a state handed in is kept). Returns
    key → state."""
    out: dict[str, OpState] = {}
    for name in op_names:
        spec = OPS[name].state
        if spec is not None:
            if spec.key not in resources:
                resources[spec.key] = spec.make(resources)
            out[spec.key] = resources[spec.key]
    return out


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
