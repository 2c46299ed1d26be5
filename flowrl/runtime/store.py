"""TensorStore with the lifecycle manager: each intermediate is released after its last consumer.

Keys are ``"stage.output"``. Reference counts come from the ExecutionPlan's lifecycle table, so
the store frees a value the moment the plan says nobody will read it again; on CUDA the caching
allocator gets the memory back when the last Python reference goes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch


def nbytes(value: Any) -> int:
    """Bytes held by a value: tensor storage (deduplicated by data_ptr), recursing into
    lists/tuples/dicts; other objects count 0 (strings are noise next to logits)."""
    seen: set[int] = set()

    def walk(v) -> int:
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            if st.data_ptr() in seen:
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
    live_bytes: int = 0
    peak_bytes: int = 0
    produced_bytes: int = 0  # what keeping every intermediate until step end would hold
    freed_by_stage: dict[str, int] = field(default_factory=dict)


class TensorStore:
    """Holds one step's intermediates.

    Args:
        release_after: stage → keys whose last consumer is that stage (from the plan).
    """

    def __init__(self, release_after: dict[str, list[str]]):
        self._release_after = {k: list(v) for k, v in release_after.items()}
        self._data: dict[str, Any] = {}
        self._size: dict[str, int] = {}
        self.stats = StoreStats()

    def put(self, stage: str, outputs: dict[str, Any]) -> None:
        for name, value in outputs.items():
            key = f"{stage}.{name}"
            if key in self._data:
                raise KeyError(f"store already holds '{key}' (stage run twice in one step?)")
            self._data[key] = value
            self._size[key] = nbytes(value)
            self.stats.live_bytes += self._size[key]
            self.stats.produced_bytes += self._size[key]
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.live_bytes)

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
        freed = 0
        for key in self._release_after.get(stage, []):
            if key in self._data:
                del self._data[key]
                freed += self._size.pop(key)
        self.stats.live_bytes -= freed
        self.stats.freed_by_stage[stage] = freed
        return freed

    def clear(self) -> None:
        """End of step: drop anything left (there should be nothing) and reset the counters."""
        self._data.clear()
        self._size.clear()
        self.stats = StoreStats()
