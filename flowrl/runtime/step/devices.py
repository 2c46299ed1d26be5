"""Where a step's tensors live: the one rule, applied by the executor and the store only.

* The **store** keeps every intermediate of a step on the pool's *home device*
  (:func:`home_device`: the training engine's device, ``cuda:LOCAL_RANK`` on a GPU run, else the
  rollout engine's, else the CPU). ``TensorStore.put`` moves what an op returns there.
* The **executor** hands each op its inputs on the op's *compute device*
  (:func:`stage_device`): the ``device`` of the stage's engine; the host for a role-less stage
  (rewards, advantages, filters: (B,)/(B, R) arithmetic next to text decoding and Python reward
  functions, which need host data anyway). Ops, engines and loss functions therefore see one
  device and never call ``.to()`` on their inputs; an engine returns its outputs on its own
  device, and the store takes them home.
* Host copies are explicit and only where host data is the point: decoding text for rewards
  (``.tolist()``), vLLM's token lists, checkpoint writes, the partitioned transport (gloo sends
  host tensors, NCCL device tensors).

See DESIGN.md "Where tensors live".
"""
from __future__ import annotations

from typing import Any, Mapping

import torch


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (recursing into dicts, lists and tuples) on ``device``.

    Tensors already there are returned as they are (no copy); host → CUDA copies are
    ``non_blocking`` (the copy is ordered on the current stream before any kernel that reads it).
    Non-tensor leaves (strings, numbers, None) pass through.
    """
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        return value.to(device, non_blocking=device.type == "cuda")
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(to_device(v, device) for v in value)
    return value


def engine_device(engine: Any) -> torch.device | None:
    """The ``device`` an engine computes on (every engine Protocol declares it), None for none."""
    if engine is None:
        return None
    dev = engine.device
    return dev if isinstance(dev, torch.device) else torch.device(dev)


HOST = torch.device("cpu")


def stage_device(engine: Any) -> torch.device:
    """Where a stage's op gets its inputs: its engine's ``device``, the host for role-less ops."""
    return engine_device(engine) or HOST


def home_device(engines: Mapping[str, Any]) -> torch.device:
    """The device a pool's store keeps the step on: the first of actor, critic, ref, rollout that
    the pool has, else the CPU. A GPU run therefore keeps its batch on the trainer's GPU, where the
    forward/backward stages read it; a partitioned rollout pool on its rollout engine's device."""
    for role in ("actor", "critic", "ref", "rollout"):
        if role in engines:
            return engine_device(engines[role]) or torch.device("cpu")
    return torch.device("cpu")
