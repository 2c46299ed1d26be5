"""What a run is, decided once before anything loads: :class:`RunSpec`.

``flowrl.train.prepare`` builds it (config composed, fields validated, the machine's ``auto``
settings resolved, graph compiled, every pre-flight check, the placement) and
``runtime/control/job.run_job`` runs it; nothing between the two composes, checks or places again.
Under torchrun every rank builds its own from the same command line (the same pure function of
the same overrides; a multi-node job has no parent process common to its ranks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from flowrl.compiler.placement import PlacementPlan
    from flowrl.compiler.plan import ExecutionPlan
    from flowrl.config import TrainConfig


@dataclass(frozen=True)
class Resolved:
    """One ``auto`` setting and what it became, with the reason (printed at the start of a run;
    ``flowrl/machine.py`` decides them)."""

    field: str
    value: object
    why: str

    def __str__(self) -> str:
        return f"{self.field}={self.value} ({self.why})"


@dataclass(frozen=True)
class RunSpec:
    """One pre-flighted run (``flowrl.train.prepare``); loads no model.

    Attributes:
        raw: the composed config (a DictConfig; with Hydra's ``hydra`` section when composed from
            overrides, which the Hydra job that runs it reads: run dir, logging, ``.hydra/``).
        config: the validated config, every ``auto`` setting resolved for this machine.
        plan: the graph compiled against ``raw``.
        placement: ``plan`` placed on the job's world (``placement.mode``; ``auto``: the cost
            model's choice, which a multi-rank ``auto`` job refines after profiling).
        resolved: the ``auto`` settings and why they became what they are.
        overrides: the invocation's command-line overrides (None: not known, a config composed
            in-process), repeated by the resume commands a run prints.
        startup: (part, seconds) of the start-up before ``prepare`` returned, in order: the
            process before ``prepare`` began (interpreter, imports, the CLI), then ``prepare``'s
            own parts (``flowrl.train.prepare``); logged once by the job, so a slow start says
            where its seconds went.
        startup_began_s: seconds from the command's start to this run's start-up: 0 for the
            first run of a process (``startup`` counts the process's own start), the earlier
            jobs' time for a later job of a sweep (not booked as this job's start-up).
        early_warnings: flowrl's warnings from before the job's logging existed (``prepare``'s
            checks: ``trainer.engine.lr=0``, ...): said on the console then, and written into
            the run's ``train.log`` when the job starts.
    """

    raw: Any
    config: "TrainConfig"
    plan: "ExecutionPlan"
    placement: "PlacementPlan"
    resolved: tuple[Resolved, ...] = ()
    overrides: Optional[tuple[str, ...]] = None
    startup: tuple[tuple[str, float], ...] = ()
    startup_began_s: float = 0.0
    early_warnings: tuple[logging.LogRecord, ...] = ()

    def startup_line(self, more: "tuple[tuple[str, float], ...]" = ()) -> str:
        """``startup`` (then ``more``: the job's own parts) as one console line:
        ``"python and imports 3.1 s, compose 0.4 s, ..."``."""
        return ", ".join(f"{part} {sec:.1f} s" for part, sec in (*self.startup, *more))
