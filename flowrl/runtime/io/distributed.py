"""Process group set-up under ``torchrun`` and the few typed collectives the SPMD runtime needs.

World size 1 without ``torchrun`` is the plain path: no process group is created and every helper
returns its input unchanged, so single-process code never branches on "distributed or not".

Launch (one node, N processes)::

    torchrun --nproc_per_node=N -m flowrl.train model=tiny trainer=smoke
    flowrl train launcher.nproc=N model=tiny trainer=smoke        # the same (runtime/control/supervise.py)

Multi-node: the same command on every node with torchrun's c10d rendezvous
(``--nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --rdzv_id=JOB``; ``launcher.nnodes``,
``launcher.rdzv_endpoint``), or ``sbatch scripts/slurm.sbatch``.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from flowrl.ops.collectives import (
    is_initialized,
)
from flowrl.ops.context import DistInfo

log = logging.getLogger(__name__)

# a record logged with extra={EVERY_RANK: True} is shown by every rank (what differs per rank);
# the other INFO records of flowrl's loggers are shown by rank 0 only (quiet_other_ranks)
EVERY_RANK = "every_rank"
# set on a record once :class:`PoolTag` prefixed it (or its logger wrote the prefix itself)
POOL_TAGGED = "pool_tagged"


class RankZeroInfo(logging.Filter):
    """Drops flowrl's INFO-and-below records on a quiet rank (:func:`quiet_other_ranks`), unless marked
    ``extra={EVERY_RANK: True}``: a 2-rank run printed every start-up line twice. Warnings and
    errors, and other libraries' records, pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= logging.WARNING or not record.name.startswith("flowrl")
                or bool(getattr(record, EVERY_RANK, False)))


class PoolTag(logging.Filter):
    """Prefixes flowrl's records with the pool a rank speaks for (``rollout pool: ...``): a
    partitioned run's rollout-pool rank said its start-up lines on the same console and
    ``train.log`` as the train pool's, indistinguishable ("engines built in ..." twice)."""

    def __init__(self, tag: str):
        super().__init__()
        self.tag = tag

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("flowrl") and not getattr(record, POOL_TAGGED, False):
            record.msg = f"{self.tag}: {record.msg}"  # once: each handler sees the same record
            setattr(record, POOL_TAGGED, True)
        return True


def tag_rank_lines(tag: str) -> None:
    """Prefix every flowrl record this rank logs with ``tag`` (:class:`PoolTag` on the root
    logger's handlers, once: a second job in the same process adds none)."""
    for h in logging.getLogger().handlers:
        if not any(isinstance(f, PoolTag) for f in h.filters):
            h.addFilter(PoolTag(tag))


def quiet_other_ranks(rank: int, speakers: "set[int] | frozenset[int]" = frozenset({0})) -> None:
    """On a ``rank`` not in ``speakers`` (rank 0, and the first rank of each placement pool):
    :class:`RankZeroInfo` on every handler of the root logger (Hydra's console and ``train.log``;
    a logger's own filter would not see its children's records)."""
    if rank == 0 or rank in speakers:
        return
    for h in logging.getLogger().handlers:
        if not any(isinstance(f, RankZeroInfo) for f in h.filters):
            h.addFilter(RankZeroInfo())


_CKPT_GROUP: Any = None


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher following its env protocol) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def init_distributed(device: str = "auto", *, timeout_s: float,
                     heartbeat_timeout_s: float) -> DistInfo:
    """Create the default process group from torchrun's environment (idempotent).

    Backend: ``cpu:gloo,cuda:nccl`` when CUDA is used (NCCL for FSDP, gloo for CPU-side objects
    and asynchronous checkpoint coordination, which DCP requires), plain ``gloo`` on CPU. On CUDA
    the process is pinned to ``cuda:LOCAL_RANK``.

    Args:
        device: ``cpu`` | ``cuda`` | ``auto`` (cuda when available), as ``trainer.device``.
        timeout_s: collective timeout in seconds (``launcher.collective_timeout_s``: its default
            lives in :class:`flowrl.config.LauncherConfig`, as every launcher default). A
            :class:`PeerMonitor` is started too: it stops the job, naming the rank, once a
            rank's heartbeat has been silent for ``heartbeat_timeout_s``
            (``launcher.heartbeat_timeout_s``), long before a collective would time out.

    Returns:
        :class:`DistInfo` of the world (``rank 0 / world 1 / group None`` when not under torchrun).

    Raises:
        RuntimeError: ``device=cuda`` with fewer visible GPUs than local processes.
    """
    if dist.is_available() and dist.is_initialized():
        return dist_info()
    if not launched_by_torchrun() or not dist.is_available():
        return DistInfo()
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} "
                               "CUDA devices are visible: lower --nproc_per_node")
        torch.cuda.set_device(local_rank)
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    info = dist_info()
    log.info("process group: rank %d/%d backend=%s collective timeout %.0f s", info.rank,
             info.world_size, backend, timeout_s, extra={EVERY_RANK: True})
    if info.world_size > 1:
        PeerMonitor.start_from_env(info.rank, info.world_size, timeout_s, heartbeat_timeout_s)
    return info


def init_single_process(device: str) -> DistInfo:
    """A one-rank default process group for a run outside torchrun that still needs one (the
    FSDP2 engine at world size 1: ``trainer.engine.strategy=fsdp``, the CUDA default). Backends as
    :func:`init_distributed`; the rendezvous is an in-process ``HashStore`` (no port is opened).
    Idempotent."""
    if dist.is_initialized():
        return dist_info()
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist_info()


def teardown() -> None:
    """Destroy the default process group (no-op when none) and stop the peer monitor."""
    global _CKPT_GROUP
    if PeerMonitor.current is not None:
        PeerMonitor.current.stop()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _CKPT_GROUP = None


_STEP = [0]  # the step this rank is in (read by the peer monitor's thread)
DONE = "done"  # a finished rank's last heartbeat


def mark_step(step: int) -> None:
    """Record the step this rank is running; the peer monitor sends it at once."""
    _STEP[0] = int(step)
    if PeerMonitor.current is not None:
        PeerMonitor.current._wake.set()


class PeerMonitor:
    """Heartbeats of every rank through torchrun's key-value store; a rank whose heartbeat
    stopped stops the job.

    A daemon thread per rank writes ``<rank> -> "<count> <step> <host> <pid>"`` every
    ``interval_s`` (and at each new step) and reads the others'. A rank whose value has not
    changed for ``stale_s`` (frozen by SIGSTOP, dead, or stuck in C code that holds the GIL) is
    logged as an error, reported to the launcher (``runtime/io/supervisor_dir.py``, which kills it
    when it is its worker) and this rank then stops at once (:attr:`on_silent`: the crash line with
    the resume command, exit status 1) instead of waiting in a collective until its timeout. A
    slow rank that still runs Python (a long generation) keeps beating and is never reported;
    a rank that finished (:meth:`stop`) writes ``done`` and is never reported either. Stale
    after S = min(heartbeat_timeout_s, T/2) s (T: the collective timeout), a beat every
    min(5, S/5) s.

    Args:
        store: a ``torch.distributed.Store`` every rank reaches (a TCPStore client).
        rank, world_size: of the default group.
        timeout_s: the collective timeout T.
        heartbeat_timeout_s: ``launcher.heartbeat_timeout_s`` (its default: in
            :class:`flowrl.config.LauncherConfig`).
    """

    current: "Optional[PeerMonitor]" = None
    # called once (in the monitor's thread) with the clause naming the silent ranks; must not
    # return (``runtime/control/recovery.stop_on_silent_peer``); None: print that clause and exit 1
    on_silent: "Optional[Callable[[str], None]]" = None

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float,
                 heartbeat_timeout_s: float) -> None:
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stale_s = min(heartbeat_timeout_s, timeout_s / 2)
        self.interval_s = min(5.0, self.stale_s / 5)
        self._count, self._last_check = 0, time.monotonic()
        self._seen: dict[int, tuple[str, float]] = {}  # rank -> (last value, when it changed)
        self.stale: dict[int, tuple[str, float]] = {}  # rank -> (where, silent since)
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="flowrl-peer-monitor", daemon=True)

    @classmethod
    def start_from_env(cls, rank: int, world_size: int, timeout_s: float,
                       heartbeat_timeout_s: float) -> "Optional[PeerMonitor]":
        """Connect to torchrun's store (``MASTER_ADDR``/``MASTER_PORT``) and start; None (and a
        debug line) when it cannot be reached: monitoring is a diagnostic, never a failure."""
        try:
            client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=max(10.0, timeout_s / 10)))
            run = (f"flowrl/heartbeat/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
                   f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
            mon = cls(dist.PrefixStore(run, client), rank, world_size, timeout_s,
                      heartbeat_timeout_s)
        except Exception as e:  # no store to reach: run without the monitor
            log.debug("peer monitor not started: %r", e)
            return None
        return mon.start()

    def start(self) -> "PeerMonitor":
        if PeerMonitor.current is not None:
            PeerMonitor.current.stop()
        PeerMonitor.current = self
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and say so: a rank that finished is not a silent one."""
        self._stop.set()
        self._wake.set()
        try:
            self.store.set(str(self.rank), DONE)
        except Exception as e:  # the store went away (the job is ending)
            log.debug("peer monitor: could not write done: %r", e)
        if PeerMonitor.current is self:
            PeerMonitor.current = None

    def beat(self) -> None:
        self._count += 1
        self.store.set(str(self.rank), f"{self._count} {_STEP[0]} {socket.gethostname()} {os.getpid()}")

    def check(self, now: Optional[float] = None) -> dict[int, str]:
        """Read every peer's heartbeat; returns the ranks newly found stale (rank -> text)."""
        now = time.monotonic() if now is None else now
        if now - self._last_check > self.stale_s / 2:  # this thread itself was held up: no verdict
            self._seen = {r: (v, now) for r, (v, _) in self._seen.items()}
        self._last_check = now
        new: dict[int, str] = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = str(r)
            value = self.store.get(key).decode() if self.store.check([key]) else ""
            last = self._seen.get(r)
            if value == DONE:  # it finished: never silent
                self._seen[r] = (value, now)
                self.stale.pop(r, None)
                continue
            if last is None or last[0] != value:
                self._seen[r] = (value, now)
                self.stale.pop(r, None)
                continue
            quiet = now - last[1]
            if quiet >= self.stale_s and r not in self.stale:
                parts = value.split()
                where = (f" (host {parts[2]}, pid {parts[3]}, last at step {parts[1]})"
                         if len(parts) == 4 else " (never sent one)")
                self.stale[r] = (f"rank {r}{where}", last[1])
                new[r] = self.describe(r, now)
                from flowrl.runtime.io.supervisor_dir import report_silent

                report_silent(r, self.last_beats().get(r, {}), quiet, self.stale_s)
        return new

    def last_beats(self) -> dict[int, dict[str, Any]]:
        """The last heartbeat seen of each peer: rank -> ``host``, ``pid``, ``step``."""
        out: dict[int, dict[str, Any]] = {}
        for r, (value, _) in self._seen.items():
            parts = value.split()
            if len(parts) == 4:
                out[r] = {"host": parts[2], "pid": int(parts[3]), "step": int(parts[1])}
        return out

    def report(self) -> str:
        """The silent ranks as one clause ("" when none)."""
        if not self.stale:
            return ""
        return "; ".join(self.describe(r) for r in sorted(self.stale)) + " (frozen, dead or stuck)"

    def describe(self, r: int, now: Optional[float] = None) -> str:
        where, since = self.stale[r]
        now = time.monotonic() if now is None else now
        return f"{where} sent no heartbeat for {now - since:.0f} s"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
                new = self.check()
            except Exception as e:  # the store went away (the job is ending): stop quietly
                log.debug("peer monitor stopped: %r", e)
                return
            for text in new.values():
                log.error("%s: frozen (SIGSTOP), dead, or stuck outside Python; stopping the job "
                          "(launcher.heartbeat_timeout_s=%g)", text, self.heartbeat_timeout_s)
            if new and not self._stop.is_set():
                (PeerMonitor.on_silent or _exit_silent)(
                    f"{self.report()}; launcher.heartbeat_timeout_s={self.heartbeat_timeout_s:g}")
                return
            self._wake.wait(self.interval_s)  # or sooner: a new step (mark_step) or stop
            self._wake.clear()


def _exit_silent(what: str) -> None:  # pragma: no cover - ends the process
    import sys

    print(f"\nflowrl train: stopped: {what}.", file=sys.stderr, flush=True)
    os._exit(1)


def peer_report() -> str:
    """The ranks whose heartbeat stopped, as one clause ("" when none or no monitor)."""
    mon = PeerMonitor.current
    return "" if mon is None else mon.report()


def dist_info() -> DistInfo:
    """Rank/world of the default group, or the single-process DistInfo."""
    if not is_initialized():
        return DistInfo()
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    group=dist.group.WORLD)


def is_rank0() -> bool:
    return dist_info().rank == 0


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (e.g. the run directory)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def checkpoint_group() -> Any:
    """A gloo group for asynchronous DCP saves, so their background collectives never interleave
    with the training collectives on the default group (None when not distributed)."""
    global _CKPT_GROUP
    if not is_initialized():
        return None
    if _CKPT_GROUP is None:
        _CKPT_GROUP = dist.new_group(backend="gloo")
    return _CKPT_GROUP


# metric key → how ranks combine it; the first matching rule wins, the default is the mean
_METRIC_RULES: tuple[tuple[str, str], ...] = (
    ("_max", "max"), ("_min", "min"), ("perf/step_s", "max"), ("time/", "max"), ("perf/swap_s", "max"),
    ("perf/sync_s", "max"), ("store/", "max"), ("reward/unscorable", "sum"), ("data/prompts", "sum"),
    ("perf/rollout_tokens_per_s", "sum"), ("perf/tokens_per_s", "sum"), ("memory/", "max"),
    ("perf/offload_s", "max"), ("perf/onload_s", "max"), ("perf/weight_sync_bytes", "max"),
)


def metric_rule(key: str) -> str:
    """``sum`` / ``max`` / ``min`` / ``mean`` for a metric key.

    Sums: counts and throughputs (every rank contributes its own part). Max: times, peaks, and
    ``*_max`` (the slowest rank sets the step time). Mean: everything else — per-rank averages
    over equal-sized shards (each rank holds ``prompts_per_step × n`` samples), and values that are
    already global (grad norm, lr, the update's all-reduced losses) stay unchanged.
    """
    for pat, rule in _METRIC_RULES:
        if (pat.startswith("_") and key.endswith(pat)) or key.startswith(pat):
            return rule
    return "mean"


def reduce_metrics(metrics: Mapping[str, float], group: Any = None) -> dict[str, float]:
    """Combine each rank's step metrics by :func:`metric_rule` (one all-gather of the dicts, so
    ranks may report different key sets). Returns the input as a plain dict when not distributed."""
    if not is_initialized():
        return dict(metrics)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dict(metrics), group=group)
    return combine_metrics(gathered)


def combine_metrics(dicts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Several ranks' metric dicts (key sets may differ) → one, each key by :func:`metric_rule`."""
    out: dict[str, float] = {}
    for key in sorted({k for m in dicts for k in m}):
        vals = [float(m[key]) for m in dicts if key in m]
        rule = metric_rule(key)
        out[key] = (sum(vals) if rule == "sum" else max(vals) if rule == "max"
                    else min(vals) if rule == "min" else sum(vals) / len(vals))
    return out


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` when not distributed)."""
    if not is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
