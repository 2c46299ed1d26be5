"""Colocated with ``placement.staleness=1``: the rollout of the next step runs beside this
step's update, on the same devices (one-step off-policy without a second pool).

Timeline of step ``s`` on every rank (versions count updates; the engine serves version v after
the sync of step v; the initial weights are version ``start - 1``)::

    main thread (rollout half)                   update thread (train half, its own CUDA stream)
    ──────────────────────────                   ───────────────────────────────────────────────
    batch s  (generated during step s-1 with      old_logprobs → update on batch s
    version s-2; at a run's first step: now,      (version s-1 → s)
    on-policy)  ──────────────────────────────►
    sample → rollout → reward → advantage
    of step s+1 with version s-1 (engine
    processes: the GPU work is theirs)
    ── join ──────────────────────────────────────────────────────────────────────────────────
    sync weights actor → rollout (version s; both halves idle), metrics, checkpoint s

So a step takes max(rollout half, train half) + the weight sync instead of their sum, and every
batch after the first is exactly one version behind the trainer (``placement/version_lag``). The
trainer recomputes the old logprobs with its current weights (``algorithm.recompute_old_logprobs``,
required), so PPO's ratio and clip are anchored where the update starts, as in any on-policy step;
the gap between the weights that sampled the batch and those is corrected only with
``algorithm.rollout_is=tis`` (truncated importance weights from the rollout's logprobs, logged as
``rollout/is_ratio_*``), as under ``placement=partitioned staleness=1``. ``rollout/logprob_mismatch``
then measures that gap (one update's worth), not only the engines' numerics. The halves are the ones ``placement=partitioned`` cuts
(``compiler/placement.split_plan``); each runs in an :class:`Executor` of its own over the same
engines and op states. The rollout half's store stays on the host, so nothing it does queues on
the update's device stream; its collectives (if an op makes one) use a process group of their
own, so they never interleave with the update's on the world's group.

Resume: a checkpoint of step s holds the prompt sampler as it was after batch s (the batch of
s+1 was already drawn); a resumed run draws batch s+1 again, now from version s (lag 0, as any
run's first step), so a resumed run is not bit-identical to one that was never stopped.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from flowrl.compiler.placement import ROLLOUT_POOL, TRAIN_POOL
from flowrl.runtime.control.colocated import Colocated

log = logging.getLogger("flowrl")

if TYPE_CHECKING:
    import torch

    from flowrl.compiler.placement import PlacementPlan
    from flowrl.config import TrainConfig
    from flowrl.ops.context import DistInfo
    from flowrl.runtime.control.events import JobEvents
    from flowrl.runtime.step.executor import Executor
    from flowrl.runtime.step.resources import Engines


@dataclass
class Batch:
    """A rollout half's output, waiting for the train half.

    Attributes:
        step: the training step it is for. data: ``"stage.output"`` → value (the transfers).
        metrics: the rollout half's step metrics. version: the weight version that generated it.
        prompt_state: the prompt sampler's state right after this batch was drawn (what a
            checkpoint of ``step`` saves).
    """

    step: int
    data: dict[str, Any]
    metrics: dict[str, float]
    version: int
    prompt_state: Any


def merge_halves(rollout: dict[str, float], train: dict[str, float]) -> dict[str, float]:
    """One step's metrics from the two halves' ``Executor.run_step`` metrics: every key once (the
    train half's wins where both have it: ``perf/peak_device_gib``, host RSS, ...), and each
    half's ``perf/*`` and ``store/*`` also under a ``/rollout`` or ``/train`` suffix, as a
    partitioned run logs them; ``store/peak_bytes`` is the larger half's."""
    out = {**rollout, **train}
    for metrics, pool in ((rollout, ROLLOUT_POOL), (train, TRAIN_POOL)):
        out.update({f"{k}/{pool}": v for k, v in metrics.items() if k.startswith(("perf/", "store/"))})
    out["store/peak_bytes"] = max(rollout.get("store/peak_bytes", 0.0), train.get("store/peak_bytes", 0.0))
    return out


class Overlapped(Colocated):
    """A colocated rank whose rollout half runs one step ahead, beside the train half (see the
    module docstring). ``flowrl train placement.staleness=1``."""

    overlaps = True

    def __init__(self, cfg: "TrainConfig", pp: "PlacementPlan", dinfo: "DistInfo"):
        import torch.distributed as dist

        super().__init__(pp, dinfo)
        self.pp, self.k, self.total_steps = pp, pp.staleness, cfg.trainer.total_steps
        if cfg.algorithm.rollout_is == "none" and dinfo.rank == 0:
            log.info("placement.staleness=%d with algorithm.rollout_is=none: PPO's ratio starts at "
                     "the trainer's weights; the one-update gap to the weights that sampled each "
                     "batch is not corrected (algorithm.rollout_is=tis corrects it)", self.k)
        # collective: every rank creates it, in the same order (a 1-rank world needs none)
        self.rollout_group: Any = (dist.new_group(list(range(dinfo.world_size)))
                                   if dist.is_initialized() and dinfo.world_size > 1 else None)
        self.lags: list[int] = []
        self.ahead: Optional[Batch] = None  # the next step's batch, drawn during this step
        self.rollout_state: Any = None  # the sampler state of the last batch trained
        self.version = -1  # the weight version the rollout engine serves
        self.rollout_exec: Optional["Executor"] = None
        self.train_exec: Optional["Executor"] = None
        self.worker: Optional[ThreadPoolExecutor] = None
        self.stream: Optional["torch.cuda.Stream"] = None

    def header(self, cfg: "TrainConfig", out_dir) -> str:
        return super().header(cfg, out_dir) + f" staleness={self.k} (rollout beside the update)"

    def start(self, executor: "Executor", engines: "Engines", start: int, resumed: bool) -> None:
        import torch

        from flowrl.ops.context import DistInfo
        from flowrl.runtime.step.executor import Executor

        super().start(executor, engines, start, resumed)
        self.version = start - 1
        rollout, train = self.pp.halves[ROLLOUT_POOL], self.pp.halves[TRAIN_POOL]

        def half(plan, dist, device, sends=()):
            # the job's executor created every op state in its resources: both halves share
            # them; nothing is swapped while both halves run
            return Executor(plan, engines, executor.resources, seed=executor.seed, dist=dist,
                            sends=sends, device=device, swap="none",
                            verify_sync=executor.verify_sync,
                            verify_sync_every=executor.verify_sync_every)

        self.rollout_exec = half(rollout.plan, DistInfo(self.dist.rank, self.dist.world_size,
                                                        self.rollout_group),
                                 torch.device("cpu"), rollout.sends)
        self.train_exec = half(train.plan, self.dist, executor.device)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="flowrl-update")
        if executor.device.type == "cuda":
            self.stream = torch.cuda.Stream(executor.device)

    def _rollout(self, step: int) -> Batch:
        """The rollout half of ``step`` with the weights the engine serves now (this thread)."""
        if self.rollout_exec is None:
            raise RuntimeError("Overlapped.step before Overlapped.start")
        sent: dict[str, Any] = {}
        m = self.rollout_exec.run_step(step, send=sent.update)
        return Batch(step, sent, m, self.version,
                     self.rollout_exec.resources["prompts"].state_dict())

    def _train(self, step: int, data: dict[str, Any]) -> dict[str, float]:
        """The train half of ``step`` on ``data`` (the update thread; its own CUDA stream, waited
        for before it returns, so the weight sync after it reads finished weights)."""
        import torch

        if self.train_exec is None:
            raise RuntimeError("Overlapped.step before Overlapped.start")
        if self.stream is None:
            return self.train_exec.run_step(step, received=data)
        with torch.cuda.stream(self.stream):
            m = self.train_exec.run_step(step, received=data)
        self.stream.synchronize()
        return m

    def step(self, step: int, events: JobEvents) -> None:
        from flowrl.runtime.io.distributed import reduce_metrics

        if self.worker is None or self.train_exec is None:
            raise RuntimeError("Overlapped.step before Overlapped.start")
        t0 = time.perf_counter()
        batch = self.ahead if self.ahead is not None else self._rollout(step)  # first step: now
        self.ahead = None
        if batch.step != step:  # a runtime bug, not a user error
            raise RuntimeError(f"overlap: step {step} got the batch of step {batch.step}")
        lag = (step - 1) - batch.version  # the trainer holds version step - 1
        update = self.worker.submit(self._train, step, batch.data)
        ahead_s = wait_s = 0.0
        try:
            if step < self.total_steps:  # the next batch, with the weights of update step - 1
                t1 = time.perf_counter()
                self.ahead = self._rollout(step + 1)
                ahead_s = time.perf_counter() - t1
        finally:  # the update thread is joined whatever happened here (its error wins)
            t1 = time.perf_counter()
            train_m = update.result()
            wait_s = time.perf_counter() - t1
        t1 = time.perf_counter()
        sync: dict[str, float] = {}
        for src, dst in self.pp.weight_sync:  # both halves idle: the engine takes version `step`
            sync.update(self.train_exec.sync_weights(src, dst, step))
        sync_s = time.perf_counter() - t1
        self.version = step
        self.lags.append(lag)
        self.rollout_state = batch.prompt_state
        m = merge_halves(batch.metrics, {**train_m, **sync})
        m.update({"perf/step_s": time.perf_counter() - t0, "perf/sync_s": sync_s,
                  "perf/weight_load_s": sync_s, "placement/version_lag": float(lag),
                  # the next batch's rollout half inside this step, then the wait for the update
                  "perf/overlap/rollout_ahead_s": ahead_s, "perf/overlap/update_wait_s": wait_s})
        events.record(step, reduce_metrics(m))
        events.reached(step)

    def finish(self, events: JobEvents) -> None:
        if self.worker is not None:
            self.worker.shutdown(wait=True)

    def prompt_state(self, prompts: Any) -> Any:
        # the sampler has drawn one batch past the last one trained: save that batch's state
        return self.rollout_state if self.rollout_state is not None else prompts.state_dict()

    def summary_fields(self, earlier: dict[str, Any], start: int) -> dict[str, Any]:
        # one lag per step: an earlier on-policy part (colocated) logged none, its lags were 0
        lags = list(earlier.get("version_lags", []))[:start - 1]
        return {**earlier, "staleness": self.k, "version_lags": lags + [0] * (start - 1 - len(lags))}

    def final_fields(self, summary: dict[str, Any]) -> dict[str, Any]:
        return {"version_lags": summary.get("version_lags", []) + self.lags}


__all__ = ["Batch", "Overlapped", "merge_halves"]
