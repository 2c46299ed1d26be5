"""The roles a stage may name, and what the compiler needs to know about each."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RoleSpec:
    """kind: ``train`` (has an optimizer), ``frozen`` (inference only) or ``generate``.
    weights_from: role whose weights this one serves (rollout serves the actor's weights)."""

    kind: str
    weights_from: Optional[str] = None


ROLES: dict[str, RoleSpec] = {
    "actor": RoleSpec("train"),
    "critic": RoleSpec("train"),
    "ref": RoleSpec("frozen"),
    # on-policy distillation: its own frozen model (teacher.path), never synced
    "teacher": RoleSpec("frozen"),
    # SFT on teacher samples: a generation engine on the teacher's model (teacher.path), frozen,
    # never synced (no weights_from: no training role serves it)
    "teacher_rollout": RoleSpec("generate"),
    "rollout": RoleSpec("generate", weights_from="actor"),
    "reward_model": RoleSpec("frozen"),
    "genrm": RoleSpec("generate"),
}
