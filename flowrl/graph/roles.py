"""The roles a stage may name, and what the compiler needs to know about each: the role table's
declarations (no torch, no engine: ``flowrl plan`` reads them on a laptop).

The runtime half of each entry — the builder of the role's engine — is bound to the same name
in ``flowrl/runtime/step/resources.py`` (``ENGINE_BUILDERS``); ``tests/unit/test_roles.py`` fails
when a role of a graph file, of this table, of the builders or of ``runtime.step.resources.Engines``
is missing from another. Adding a role: an entry here, its builder there, and its typed field
on ``Engines``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

Kind = Literal["train", "frozen", "generate"]
Pool = Literal["train", "rollout"]


@dataclass(frozen=True)
class RoleSpec:
    """One role of the table.

    Attributes:
        kind: ``train`` (has an optimizer: its state is checkpointed), ``frozen`` (inference
            only) or ``generate`` (samples tokens).
        protocol: the ``flowrl/engines/base.py`` Protocol its engine implements (the type of
            its ``runtime.step.resources.Engines`` field).
        pool: its pool under ``placement=partitioned`` unless ``placement.roles`` moves it.
        weights_from: the role whose weights this one serves (rollout serves the actor's,
            synced after each update); None: its own weights (trained, or frozen: never synced).
    """

    kind: Kind
    protocol: str
    pool: Pool
    weights_from: Optional[str] = None

    @property
    def synced(self) -> bool:
        """A weight sink: it receives ``weights_from``'s weights at every weight sync."""
        return self.weights_from is not None


# the order is the engine set's (``Engines.by_role``: what closes first on the way out)
ROLES: dict[str, RoleSpec] = {
    # the policy: trained, the source of every weight sync
    "actor": RoleSpec("train", "TrainEngine", "train"),
    # the reference policy of the KL term: the initial weights, frozen
    "ref": RoleSpec("frozen", "LogprobEngine", "train"),
    # on-policy distillation: its own frozen model (teacher.path), never synced
    "teacher": RoleSpec("frozen", "LogprobEngine", "train"),
    # PPO's value model: trained, its own weights (a value head on the initial policy)
    "critic": RoleSpec("train", "ValueEngine", "train"),
    # the sampler: serves the actor's weights, synced after each update
    "rollout": RoleSpec("generate", "RolloutEngine", "rollout", weights_from="actor"),
    # a sequence-classification reward model, frozen
    "reward_model": RoleSpec("frozen", "RewardScorer", "rollout"),
    # a generative judge: its own frozen model copy, never synced
    "genrm": RoleSpec("generate", "RolloutEngine", "rollout"),
    # SFT on teacher samples: a generation engine on the teacher's model (teacher.path), frozen,
    # never synced (no weights_from: no training role serves it)
    "teacher_rollout": RoleSpec("generate", "RolloutEngine", "rollout"),
}

TRAINED_ROLES = tuple(r for r, s in ROLES.items() if s.kind == "train")  # checkpointed state
