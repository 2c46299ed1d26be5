"""What a placement's rank reports to the job while it runs a step (``runtime/control/job.py``
implements it; the placements in ``colocated.py``, ``overlap.py`` and ``partitioned.py`` call it)."""
from __future__ import annotations

from typing import Protocol


class JobEvents(Protocol):
    """What a placement reports to the job while it runs a step."""

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """The step's metrics (already reduced over the ranks that log them)."""

    def reached(self, version: int) -> None:
        """This rank holds the state after update ``version``: join its checkpoint if one is due."""


__all__ = ["JobEvents"]
