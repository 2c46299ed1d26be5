"""TensorStore + lifecycle: a value is freed exactly after its last consumer runs."""
import torch

from flowrl.runtime.step.store import TensorStore, nbytes


def test_frees_exactly_after_last_consumer():
    # a -> b -> c, and c also reads a: a.x lives until c, b.y until c
    store = TensorStore({"a": [], "b": [], "c": ["a.x", "b.y"]})
    store.put("a", {"x": torch.zeros(10, dtype=torch.float32)})  # 40 bytes
    assert store.release_after("a") == 0 and "a.x" in store
    store.put("b", {"y": torch.zeros(5, dtype=torch.int64)})  # 40 bytes
    assert store.release_after("b") == 0
    assert store.stats.live_bytes == 80 and store.stats.peak_bytes == 80
    store.get("a.x"); store.get("b.y")
    assert store.release_after("c") == 80
    assert "a.x" not in store and "b.y" not in store
    assert store.stats.live_bytes == 0 and store.stats.peak_bytes == 80
    assert store.stats.freed_by_stage == {"a": 0, "b": 0, "c": 80}


def test_unused_output_freed_at_once():
    store = TensorStore({"a": ["a.unused"]})
    store.put("a", {"unused": torch.zeros(4)})
    assert store.release_after("a") == 16 and "a.unused" not in store


def test_nbytes_dedupes_views_and_ignores_strings():
    t = torch.zeros(8)
    assert nbytes([t, t[:4], "text"]) == 32


def test_peak_is_less_than_keep_all():
    store = TensorStore({"a": [], "b": ["a.x"], "c": ["b.y"]})
    store.put("a", {"x": torch.zeros(100)}); store.release_after("a")
    store.put("b", {"y": torch.zeros(100)}); store.release_after("b")
    store.put("c", {}); store.release_after("c")
    assert store.stats.peak_bytes == 800 and store.stats.produced_bytes == 800
    store2 = TensorStore({"a": [], "b": ["a.x"], "c": ["b.y"]})
    store2.put("a", {"x": torch.zeros(100)}); store2.release_after("a")
    store2.put("b", {"y": torch.zeros(100)}); store2.release_after("b")
    store2.put("c", {"z": torch.zeros(100)}); store2.release_after("c")
    # a.x was freed after b, so c's output never coexists with it
    assert store2.stats.peak_bytes == 800 and store2.stats.produced_bytes == 1200
