"""Collectives an op may call over its pool's process group (``ctx.dist.group``; None = the
world): all-reduce of floats and tensors that works unchanged at world size 1 (no process group:
the value comes back). ``runtime/io/distributed.py`` re-exports them for the job's own reductions.

Here, below the runtime, because ops need them (the update's loss denominators, row balancing)
and ops sit under the runtime (DESIGN.md "Layers").
"""
from __future__ import annotations

from typing import Any, Sequence, overload

import torch
import torch.distributed as dist
from torch import Tensor


def is_initialized() -> bool:
    """A torch.distributed process group exists (torchrun, or a one-rank group on a GPU run)."""
    return dist.is_available() and dist.is_initialized()


def device_for(group: Any) -> torch.device:
    """Where a CPU value must go for a collective: a NCCL-only group needs the current GPU."""
    if str(dist.get_backend(group)) == "nccl":  # a mixed "cpu:gloo,cuda:nccl" group takes CPU tensors
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@overload
def all_reduce(value: Tensor, op: str = "sum", group: Any = None) -> Tensor: ...


@overload
def all_reduce(value: float, op: str = "sum", group: Any = None) -> float: ...


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
    t = value.detach().clone() if isinstance(value, Tensor) else \
        torch.tensor([value], dtype=torch.float64)
    orig = t.device
    if t.device.type == "cpu":
        t = t.to(device_for(group))
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


