"""Op state that lives across steps, declared through the op registry.

Most ops are pure functions of their inputs. One that carries something from a step to the next
(the adaptive KL coefficient β of ``reward.token_rewards``, ...) declares it here, by op name,
with :func:`declare_state`: an :class:`OpStateSpec` naming the run resource that holds the state
(``ctx.resources[key]``, where the op reads and updates it) and how to build its initial value.

The executor builds the state of every op in its plan (:func:`init_op_states`); the job saves
every state's ``state_dict()`` under one key of the checkpoint's ``trainer_state.json``
(``op_state``: key → state dict, JSON, never pickled) and loads it back on resume, the same way in
every placement (``runtime/control/job.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol


class OpState(Protocol):
    """State an op carries from one step to the next; its state dict is JSON-able."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True)
class OpStateSpec:
    """An op's cross-step state.

    Attributes:
        key: the run resource holding it and its name in the checkpoint; one state per run,
            shared by every stage of the op.
        make: ``make(resources) -> OpState``: the initial state from the run resources (e.g. the
            ``AlgorithmConfig`` under ``algorithm``).
    """

    key: str
    make: Callable[[Mapping[str, Any]], OpState]


OP_STATES: dict[str, OpStateSpec] = {}  # op name → its state


def declare_state(op_name: str, spec: OpStateSpec) -> OpStateSpec:
    """Declare that op ``op_name`` keeps ``spec``'s state across steps (in the op's module, next
    to its function). Raises ValueError when the op already declared another one."""
    if op_name in OP_STATES and OP_STATES[op_name].key != spec.key:
        raise ValueError(f"op '{op_name}' already declares state {OP_STATES[op_name].key!r}")
    OP_STATES[op_name] = spec
    return spec


def init_op_states(op_names: Iterable[str], resources: dict[str, Any]) -> dict[str, OpState]:
    """The state of every op in ``op_names`` that declares one, created in ``resources`` under
    its key unless already there (a state handed in is kept). Returns key → state.

    An op's module declares its state when it is imported: the op's function is looked up
    first (``OpSpec.fn``), which imports it."""
    from flowrl.ops.registry import get_op

    out: dict[str, OpState] = {}
    for name in op_names:
        get_op(name).fn  # noqa: B018  (the implementing module declares the state on import)
        spec = OP_STATES.get(name)
        if spec is not None:
            if spec.key not in resources:
                resources[spec.key] = spec.make(resources)
            out[spec.key] = resources[spec.key]
    return out


__all__ = ["OP_STATES", "OpState", "OpStateSpec", "declare_state", "init_op_states"]
