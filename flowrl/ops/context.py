"""What an op may touch while it runs: its role's engine, the run's shared resources, metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DistInfo:
    """Rank/world of the pool the stage runs in (world size 1 for the single-process runtime)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup, or None when not initialised


@dataclass
class StageContext:
    """Handed to every op call. Ops never reach into the TensorStore or other stages.

    Attributes:
        stage: name of the stage being run.
        step: 1-based training step.
        engine: the engine of the stage's role (RolloutEngine for ``rollout``, TrainEngine for
            ``actor``/``ref``/``critic``), or None for role-less ops.
        resources: run-wide shared objects by name: ``tokenizer``, ``prompts`` (the stateful prompt
            source), ``algorithm`` (AlgorithmConfig), ``sampling`` (SamplingConfig).
        dist: rank/world of the stage's pool.
        generator: torch RNG for this stage run (seeded from the run seed and step; checkpointed).
        metrics: scalars the op reports; the executor prefixes nothing, so use ``group/name``.
    """

    stage: str
    step: int
    engine: Any = None
    resources: dict[str, Any] = field(default_factory=dict)
    dist: DistInfo = field(default_factory=DistInfo)
    generator: torch.Generator | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def log(self, **values: float) -> None:
        """Record scalar metrics (``ctx.log(**{"reward/mean": 0.3})``)."""
        for k, v in values.items():
            self.metrics[k] = float(v.item() if isinstance(v, torch.Tensor) else v)

    def resource(self, name: str) -> Any:
        if name not in self.resources:
            raise KeyError(f"stage '{self.stage}': run has no resource '{name}' "
                           f"(has: {sorted(self.resources)})")
        return self.resources[name]
