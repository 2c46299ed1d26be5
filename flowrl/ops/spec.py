"""What an op is, as the graph validator and the compiler see it: :class:`OpSpec`.

No torch and no op code here: a spec names the module that implements the op
(``OpSpec.module``), imported only when the function is needed (``OpSpec.fn``), so validating a
graph or printing a plan imports no torch.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

TENSOR, LIST = "tensor", "list"  # OpSpec.kinds values


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
        module: module whose import binds the function (``registry.implements``); empty for an
            op registered with its function (``registry.register_op``).
        kinds: what an input or output holds where it is not a tensor with a leading batch
            dimension: ``"list"`` = a Python list, one entry per sample (``ground_truth``). The
            validator refuses a list wired into a tensor input, and the reverse, before any
            model loads.
        trains: the op updates a model's weights (``update.policy``, ``update.critic``); a
            training graph needs at least one such stage.
        multi_turn_outputs: outputs whose rows hold several policy turns with environment tokens
            between them (mask False there: ``rollout.multi_turn``).
        single_turn_inputs: inputs that cannot take such rows (the graph validator refuses a
            multi-turn output bound to one, naming stage and field).
        info_outputs: per-row metadata a graph may leave unconsumed (no unused-output warning).
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_cls: type = NoConfig
    roles: tuple[str, ...] = ()
    doc: str = ""
    module: str = ""
    kinds: Mapping[str, str] = field(default_factory=dict)
    trains: bool = False
    multi_turn_outputs: tuple[str, ...] = ()
    single_turn_inputs: tuple[str, ...] = ()
    info_outputs: tuple[str, ...] = ()
    bound: Callable[..., Mapping[str, Any]] | None = field(default=None, repr=False, compare=False)

    @property
    def all_inputs(self) -> tuple[str, ...]:
        return self.inputs + self.optional_inputs

    def kind(self, name: str) -> str:
        """``"tensor"`` or ``"list"``: what input or output ``name`` holds (see ``kinds``)."""
        return self.kinds.get(name, TENSOR)

    @property
    def fn(self) -> Callable[..., Mapping[str, Any]]:
        """``fn(ctx: StageContext, cfg: config_cls, **inputs) -> dict[str, Any]`` (keys exactly
        ``outputs``), importing :attr:`module` on first use.

        Raises:
            LookupError: the module registered no function under this name.
        """
        if self.bound is None and self.module:
            importlib.import_module(self.module)  # its @implements(name) binds the function
        if self.bound is None:
            raise LookupError(f"op '{self.name}' has no function: {self.module or 'no module'} "
                              f"registered none with @implements({self.name!r})")
        return self.bound

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
