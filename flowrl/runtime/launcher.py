"""``launcher``: how the job's processes start (``flowrl/launch.py`` re-executes under torchrun)
and how long its ranks wait for each other in a collective (``runtime/distributed.py``).

No torch here: the run config imports it before anything heavy loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class LauncherConfig:
    """How ``flowrl train`` starts its processes (all but ``collective_timeout_s`` are ignored
    once running under torchrun) and how long its ranks wait for each other.

    Attributes:
        nproc: processes (GPUs) per node; > 1 (or nnodes > 1) re-executes under torchrun.
        nnodes: nodes taking part (torchrun ``--nnodes``; ``"MIN:MAX"`` elastic ranges are not used).
        rdzv_endpoint: ``host:port`` of the c10d rendezvous (multi-node; any node's address).
        rdzv_id: job id shared by all nodes of one run.
        rdzv_backend: torchrun rendezvous backend (``c10d``).
        max_restarts: torchrun worker-group restarts on failure (resume picks up the newest
            complete checkpoint when ``trainer.resume=true``).
        node_rank: fixed node rank (static rendezvous); None = assigned by the rendezvous.
        collective_timeout_s: seconds a rank waits in a collective (the process group's
            timeout) before the job fails with an error. 600 (10 minutes): ranks legitimately
            wait for the slowest rank's generation and reward calls, rank 0's eval and
            checkpoint writes, which take minutes at most; a frozen or hung rank then stops
            the job within 10 minutes instead of torch's default 30 (a rank that stops
            heartbeating is named in the log after min(60, timeout / 2) s,
            ``runtime/distributed.PeerMonitor``). Raise it for a long rank-0-only phase, e.g. an
            eval of the whole test split on the HF backend (``trainer.eval.limit=null``).
    """

    nproc: int = 1
    nnodes: int = 1
    rdzv_endpoint: str = "localhost:29500"
    rdzv_id: str = "flowrl"
    rdzv_backend: str = "c10d"
    max_restarts: int = 0
    node_rank: Optional[int] = None
    collective_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.collective_timeout_s > 0:
            raise ValueError(f"launcher.collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.nproc < 1:
            raise ValueError(f"launcher.nproc must be >= 1, got {self.nproc}")
        if self.nnodes < 1:
            raise ValueError(f"launcher.nnodes must be >= 1, got {self.nnodes}")
        if self.max_restarts < 0:
            raise ValueError(f"launcher.max_restarts must be >= 0, got {self.max_restarts}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"launcher.node_rank must be in [0, {self.nnodes}), got {self.node_rank}")

    @property
    def distributed(self) -> bool:
        return self.nproc > 1 or self.nnodes > 1
