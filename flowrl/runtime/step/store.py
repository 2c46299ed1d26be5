"""TensorStore with the lifecycle manager: each intermediate is released after its last consumer.

Keys are ``"stage.output"``. Reference counts come from the ExecutionPlan's lifecycle table, so
the store frees a value the moment the plan says nobody will read it again; on CUDA the caching
allocator gets the memory back when the last Python reference goes.

The store holds a step on one *home device* (``flowrl/runtime/step/devices.py``: the pool's trainer
device); ``put`` moves what it is given there, so that is the one place a batch changes device on
its way between stages. Byte counts are split by where the storage lives (``*_device_bytes``:
accelerator memory), so a GPU run reports what the lifecycle saves in device memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from flowrl.runtime.step.devices import to_device


def nbytes(value: Any, device_only: bool = False) -> int:
    """Bytes held by a value: tensor storage (deduplicated by data_ptr), recursing into
    lists/tuples/dicts; other objects count 0 (strings are noise next to logits).
    ``device_only``: count only storage on an accelerator (not CPU, not meta)."""
    seen: set[int] = set()

    def walk(v) -> int:
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            if (device_only and v.device.type in ("cpu", "meta")) or st.data_ptr() in seen:
                return 0
            seen.add(st.data_ptr())
            return st.nbytes()
        if isinstance(v, dict):
            return sum(walk(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return sum(walk(x) for x in v)
        return 0

    return walk(value)


@dataclass
class StoreStats:
    """Bytes of one step's intermediates (all devices; ``*_device_*``: accelerator memory only).

    ``peak_bytes`` is what the lifecycle manager held at most; ``produced_bytes`` what keeping
    every intermediate until the end of the step would hold (the peak without the manager).
    """

    live_bytes: int = 0
    peak_bytes: int = 0
    produced_bytes: int = 0  # what keeping every intermediate until step end would hold
    live_device_bytes: int = 0
    peak_device_bytes: int = 0
    produced_device_bytes: int = 0
    freed_by_stage: dict[str, int] = field(default_factory=dict)


class TensorStore:
    """Holds one step's intermediates.

    Args:
        release_after: stage → keys whose last consumer is that stage (from the plan).
        device: the home device every value is moved to on ``put`` (None: kept where it is).
    """

    def __init__(self, release_after: dict[str, list[str]], device: torch.device | None = None):
        self._release_after = {k: list(v) for k, v in release_after.items()}
        self.device = device
        self._data: dict[str, Any] = {}
        self._size: dict[str, tuple[int, int]] = {}  # key -> (bytes, device bytes)
        self.stats = StoreStats()

    def put(self, stage: str, outputs: dict[str, Any]) -> None:
        """Store ``outputs`` of ``stage`` as ``"stage.name"``, moved to the home device.

        Raises:
            KeyError: a key is already held (a stage ran twice in one step).
        """
        st = self.stats
        for name, value in outputs.items():
            key = f"{stage}.{name}"
            if key in self._data:
                raise KeyError(f"store already holds '{key}' (stage run twice in one step?)")
            if self.device is not None:
                value = to_device(value, self.device)
            self._data[key] = value
            size = self._size[key] = (nbytes(value), nbytes(value, device_only=True))
            st.live_bytes += size[0]
            st.produced_bytes += size[0]
            st.live_device_bytes += size[1]
            st.produced_device_bytes += size[1]
        st.peak_bytes = max(st.peak_bytes, st.live_bytes)
        st.peak_device_bytes = max(st.peak_device_bytes, st.live_device_bytes)

    def get(self, key: str) -> Any:
        if key not in self._data:
            raise KeyError(f"'{key}' is not in the store (never produced, or already freed)")
        return self._data[key]

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def keys(self) -> Iterable[str]:
        return self._data.keys()

    def release_after(self, stage: str) -> int:
        """Free every key whose last consumer is ``stage``; returns bytes freed."""
        freed = freed_device = 0
        for key in self._release_after.get(stage, []):
            if key in self._data:
                del self._data[key]
                size = self._size.pop(key)
                freed += size[0]
                freed_device += size[1]
        self.stats.live_bytes -= freed
        self.stats.live_device_bytes -= freed_device
        self.stats.freed_by_stage[stage] = freed
        return freed

    def clear(self) -> None:
        """End of step: drop anything left (there should be nothing) and reset the counters."""
        self._data.clear()
        self._size.clear()
        self.stats = StoreStats()
