"""Process group set-up under ``torchrun`` and the few typed collectives the SPMD runtime needs.

World size 1 without ``torchrun`` is the plain path: no process group is created and every helper
returns its input unchanged, so single-process code never branches on "distributed or not".

Launch (one node, N processes)::

    torchrun --nproc_per_node=N -m flowrl.train model=tiny trainer=smoke
    flowrl train launcher.nproc=N model=tiny trainer=smoke        # the same, via flowrl.launch

Multi-node: the same command on every node with torchrun's c10d rendezvous
(``--nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --rdzv_id=JOB``; ``launcher.nnodes``,
``launcher.rdzv_endpoint``), or ``sbatch scripts/slurm.sbatch``.
"""
from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from flowrl.ops.context import DistInfo

log = logging.getLogger(__name__)

_CKPT_GROUP: Any = None


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher following its env protocol) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Create the default process group from torchrun's environment (idempotent).

    Backend: ``cpu:gloo,cuda:nccl`` when CUDA is used (NCCL for FSDP, gloo for CPU-side objects
    and asynchronous checkpoint coordination, which DCP requires), plain ``gloo`` on CPU. On CUDA
    the process is pinned to ``cuda:LOCAL_RANK``.

    Args:
        device: ``cpu`` | ``cuda`` | ``auto`` (cuda when available), as ``trainer.device``.
        timeout_s: collective timeout.

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
    log.info("process group: rank %d/%d backend=%s", info.rank, info.world_size, backend)
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
    """Destroy the default process group (no-op when none)."""
    global _CKPT_GROUP
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _CKPT_GROUP = None


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


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


def _device_for(group: Any) -> torch.device:
    """Where a CPU value must go for a collective: a NCCL-only group needs the current GPU."""
    if str(dist.get_backend(group)) == "nccl":  # a mixed "cpu:gloo,cuda:nccl" group takes CPU tensors
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(value: float | Tensor, op: str = "sum", group: Any = None) -> float | Tensor:
    """All-reduce a Python float or a tensor (returned as a new value; the input is not modified).

    Args:
        value: float, or tensor of any shape (float tensors reduce in their own dtype).
        op: ``sum`` | ``max`` | ``min`` | ``mean`` (mean = sum / world size).
        group: process group (default world). Without a process group the value comes back.

    Raises:
        ValueError: unknown ``op``.
    """
    if op not in (*_OPS, "mean"):
        raise ValueError(f"all_reduce: op must be sum, max, min or mean, got {op!r}")
    if not is_initialized():
        return value
    is_float = not isinstance(value, Tensor)
    t = torch.tensor([value], dtype=torch.float64) if is_float else value.detach().clone()
    orig = t.device
    if t.device.type == "cpu":
        t = t.to(_device_for(group))
    dist.all_reduce(t, op=_OPS["sum" if op == "mean" else op], group=group)
    if op == "mean":
        t = t / dist.get_world_size(group)
    t = t.to(orig)
    return float(t.item()) if is_float else t


def all_reduce_sum(value, group: Any = None):
    return all_reduce(value, "sum", group)


def all_reduce_max(value, group: Any = None):
    return all_reduce(value, "max", group)


def all_reduce_mean(value, group: Any = None):
    return all_reduce(value, "mean", group)


def all_reduce_floats(values: Sequence[float], op: str = "sum", group: Any = None) -> list[float]:
    """All-reduce several floats in one collective (float64)."""
    if not is_initialized() or not values:
        return [float(v) for v in values]
    out = all_reduce(torch.tensor(list(values), dtype=torch.float64), op, group)
    return [float(v) for v in out.tolist()]


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
