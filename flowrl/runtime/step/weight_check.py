"""After each weight sync: did the weights really reach the rollout engine?

A sync can silently do nothing: a LoRA source that merges no adapter, names the engine does not
map, a load into a stale or restarted engine, a "shared" engine that is not. The run then keeps
sampling an old policy and only the logprob mismatch drifts. :class:`SyncProbe` records, while
the tensors stream to the engine (one pass, nothing materialised twice), ``SAMPLES`` values of
each at fixed flat positions; :func:`check_sync` reads the same positions back from the engine
(``engines.base.WeightReadback``) and compares them exactly, after casting the trainer's values
to the engine's dtype (the cast the engine's own copy did). Cost: a gather of ``SAMPLES`` values
per tensor on each side (microseconds; one round trip to vLLM engine processes).

Switch: ``rollout.verify_sync`` (default on).
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch
from torch import Tensor

from flowrl.engines.base import WeightReadback
from flowrl.errors import RunStopped

log = logging.getLogger(__name__)

SAMPLES = 64  # values read back per tensor
_warned: set[str] = set()


class WeightSyncError(RunStopped):
    """The rollout engine does not serve the weights the trainer just synced (one line with the
    resume command: ``runtime/control/recovery.report_crash``)."""


def sample_index(numel: int) -> Tensor:
    """``min(SAMPLES, numel)`` flat positions spread over a tensor of ``numel`` elements (CPU
    int64, deterministic: first and last element included). Integer arithmetic: a float32
    ``linspace`` rounds its last position past the end of any tensor over 2^24 elements
    (SmolLM2's 49152 x 576 embedding: an IndexError at the first sync of the default job)."""
    n = min(SAMPLES, numel)
    if n <= 1:
        return torch.zeros(n, dtype=torch.long)
    return (torch.arange(n, dtype=torch.long) * (numel - 1)) // (n - 1)


class SyncProbe:
    """Wraps a sync's ``(name, tensor)`` stream; records each tensor's sampled values (CPU) as
    the engine takes it. :meth:`drain` then runs the stream to its end (an FSDP source's
    gathers are collectives: every rank iterates it to the end), recording what the engine left
    untaken."""

    def __init__(self, named: Iterable[tuple[str, Tensor]]) -> None:
        self._it = iter(named)
        self.samples: dict[str, tuple[Tensor, Tensor]] = {}  # name -> (index, values)
        self.untaken: list[str] = []

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for name, t in self._it:
            idx = sample_index(t.numel())
            with torch.no_grad():
                vals = t.detach().reshape(-1)[idx.to(t.device)].cpu()
            self.samples[name] = (idx, vals)
            yield name, t

    def drain(self) -> None:
        for name, _ in self._it:
            self.untaken.append(name)


def check_sync(sink: object, probe: SyncProbe, what: str, shared: bool) -> dict[str, float]:
    """Raise :class:`WeightSyncError` when ``sink`` does not hold what ``probe`` saw streamed
    into it; ``what``: ``"actor -> rollout (HFRolloutEngine)"``, for the message; ``shared``:
    the engine runs the trainer's own module (a sync may then move nothing). Returns
    ``{"tensors_checked": n}``.

    Raises:
        WeightSyncError: no tensor was delivered to an engine with its own copy, or some
            tensors' values differ (named, with the largest difference).
    """
    probe.drain()
    if probe.untaken:
        raise WeightSyncError(
            f"weight sync {what}: the engine's load_weights took {len(probe.samples)} of the "
            f"{len(probe.samples) + len(probe.untaken)} tensors sent (not e.g. "
            f"{', '.join(probe.untaken[:3])}): it serves stale weights. Set "
            "rollout.verify_sync=false to run anyway")
    if not probe.samples:
        if shared:
            return {"tensors_checked": 0.0}
        raise WeightSyncError(
            f"weight sync {what}: the engine holds its own copy of the weights but the sync "
            "delivered no tensor (a LoRA source that merged no adapter, a name filter that dropped "
            "every tensor?): it would keep sampling the initial policy. Fix the sync, or set "
            "rollout.verify_sync=false to run anyway")
    if not isinstance(sink, WeightReadback):
        if what not in _warned:
            log.info("weight sync %s: the engine cannot read its weights back; not verified", what)
            _warned.add(what)
        return {"tensors_checked": 0.0}
    got = sink.weight_samples({n: idx for n, (idx, _) in probe.samples.items()})
    bad: list[str] = []
    for name, back in got.items():
        sent = probe.samples[name][1].to(back.dtype)
        if not torch.equal(sent, back):
            diff = (sent.double() - back.double()).abs().nan_to_num(float("inf")).max().item()
            bad.append(f"{name} (max |difference| {diff:.3g} over {sent.numel()} sampled values)")
    if bad:
        raise WeightSyncError(
            f"weight sync {what}: the engine does not serve the weights it was sent: "
            f"{len(bad)} of {len(got)} checked tensors differ, e.g. {'; '.join(bad[:3])} (a load "
            "that did nothing, a stale engine, names mapped to the wrong tensors?). Set "
            "rollout.verify_sync=false to run anyway")
    if not got and what not in _warned:
        log.info("weight sync %s: the engine holds none of the synced names directly (fused); "
                 "not verified", what)
        _warned.add(what)
    return {"tensors_checked": float(len(got))}
