"""After each weight sync: did the weights really reach the rollout engine?

A sync can silently do nothing: a LoRA source that merges no adapter, names the engine does not
map, a load into a stale or restarted engine, a "shared" engine that is not. The run then keeps
sampling an old policy and only the logprob mismatch drifts. :class:`SyncProbe` records, while
the tensors stream to the engine (one pass, nothing materialised twice), ``SAMPLES`` values of
each at fixed flat positions; :func:`check_sync` reads the same positions back from the engine
(``engines.base.WeightReadback``) and compares them exactly, after casting the trainer's values
to the engine's dtype (the cast the engine's own copy did). Cost: a gather of ``SAMPLES`` values
per tensor on each side (microseconds; one round trip to vLLM engine processes).

The readback proves the engine holds what was sent, not that what was sent is the policy being
trained: a LoRA merge that sends the base weights passes it. :func:`check_effective` then
compares the sampled values sent for each LoRA-adapted layer with the weight that layer's own
forward computes with (one-hot inputs through the trainer's module: base plus adapters, no merge
code shared with the sync), and refuses a merged sync that leaves an adapted layer out. It runs on
what the trainer streamed, so it holds for every rollout engine (HF, vLLM in-process or in its
own processes). A sync of the adapter tensors themselves is not judged by it.

Switch: ``rollout.verify_sync`` (default on; both checks).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, Iterator, cast

import torch
from torch import Tensor

from flowrl.engines.base import WeightReadback
from flowrl.errors import RunStopped

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

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


def _full(t: Tensor) -> Tensor:
    """``t`` whole: an FSDP2 ``DTensor`` shard is all-gathered (a collective: every rank runs
    the check, over the same tensors in the same order, as it runs the sync)."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


@torch.no_grad()
def _effective_at(lora: "LoraLayer", index: Tensor) -> Tensor | None:
    """The weight ``layer`` (a peft ``LoraLayer``) computes with, at the flat positions ``index``
    of its base layer's weight: read from the layer's own forward on one-hot inputs (an
    embedding: on the sampled token ids), so the adapters enter exactly as training applies them
    and no merge code is shared with the sync under check. ``f(e_c) - f(0)`` cancels the bias.
    None for a layer kind this does not read (conv)."""
    from torch.func import functional_call

    layer = cast(torch.nn.Module, lora)  # peft's LoraLayer is a mixin of the module classes
    base = lora.get_base_layer()
    w = base.weight
    if not isinstance(w, Tensor) or w.dim() != 2:
        return None
    params = {n: _full(p) for n, p in layer.named_parameters()}
    params.update({n: _full(b) for n, b in layer.named_buffers()})
    rows, cols = w.shape
    r, c = index // cols, index % cols
    was = layer.training
    layer.eval()  # adapter dropout off: the weights served are the deterministic ones
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a TF32 one-hot product rounds W itself
    try:
        dev, dt = params["base_layer.weight"].device, params["base_layer.weight"].dtype
        if isinstance(base, torch.nn.Embedding):
            ids, pos = torch.unique(r, return_inverse=True)
            y = functional_call(layer, params, (ids.to(dev),))
            return y[pos.to(dev), c.to(dev)].cpu()
        if isinstance(base, torch.nn.Linear):
            inp, out, k_in = c, r, cols  # (out, in): position (r, c) = input c, output r
        elif getattr(lora, "fan_in_fan_out", False):  # GPT-2's Conv1D: (in, out)
            inp, out, k_in = r, c, rows
        else:
            return None
        ins, pos = torch.unique(inp, return_inverse=True)
        x = torch.zeros(len(ins) + 1, k_in, device=dev, dtype=dt)
        x[torch.arange(len(ins), device=dev), ins.to(dev)] = 1  # last row: the zero input
        y = functional_call(layer, params, (x,))
        y = y[:-1] - y[-1:]
        return y[pos.to(dev), out.to(dev)].cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        layer.train(was)


def check_effective(model: torch.nn.Module, probe: SyncProbe, what: str) -> dict[str, float]:
    """Raise :class:`WeightSyncError` when what ``probe`` saw sent for a LoRA-adapted tensor is
    not the weight the trainer's ``model`` computes with (its base plus its adapters).

    The readback (:func:`check_sync`) proves the engine holds what was sent; this proves what was
    sent is the policy being trained: a LoRA sync whose merge sent the base weights (adapters not
    merged, merged from the wrong adapter) passes the readback and keeps sampling the initial
    policy. Each sampled value of every sent tensor named after a peft ``LoraLayer``'s base
    weight is compared with that layer's forward on one-hot inputs (:func:`_effective_at`), in
    the coarser of the two dtypes: a difference over 4 ulps of the tensor's largest sampled value
    fails. So an adapter delta below the sync dtype's resolution is not seen (the engine could not
    serve it either). Cost per adapted tensor: one forward of at most ``SAMPLES`` + 1 rows (an
    FSDP2 layer's parameters gathered once more). A model without LoRA layers: nothing to check.
    Returns ``{"effective_checked": n}``.

    Raises:
        WeightSyncError: some adapted tensors sent differ from the trainer's effective weights
            (named, with the largest difference).
    """
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # without peft no model has LoRA layers
        return {"effective_checked": 0.0}

    layers = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    bad: list[str] = []
    checked = 0
    sent_merged = set(layers) & set(probe.samples)
    # a merged sync (some adapted layer sent under its base name) must cover every adapted
    # layer: one it leaves out keeps its base weight in the engine. A sync of the adapter
    # tensors themselves (the engine applies them) sends no such name and is not judged here
    missing = sorted(n for n, m in layers.items() if n not in probe.samples
                     and not any(k.startswith(n[:-len("weight")]) for k in probe.samples))
    if sent_merged and missing:
        raise WeightSyncError(
            f"weight sync {what}: {len(missing)} of {len(layers)} LoRA-adapted layers were not "
            f"sent (e.g. {', '.join(missing[:3])}): the engine keeps their base weights while "
            "the trainer computes with its adapters. Set rollout.verify_sync=false to run anyway")
    for name in sorted(set(layers) & set(probe.samples)):
        idx, sent = probe.samples[name]
        eff = _effective_at(layers[name], idx)
        if eff is None:
            continue
        checked += 1
        dtype = sent.dtype if _eps(sent.dtype) >= _eps(eff.dtype) else eff.dtype
        s, e = sent.to(dtype).double(), eff.to(dtype).double()
        diff = (s - e).abs().nan_to_num(float("inf"))
        tol = 4 * _eps(dtype) * max(s.abs().max().item(), e.abs().max().item())
        if diff.max().item() > tol:
            bad.append(f"{name} (max |difference| {diff.max().item():.3g} over {len(idx)} "
                       "sampled values)")
    if bad:
        raise WeightSyncError(
            f"weight sync {what}: the weights sent are not the trainer's effective weights: "
            f"{len(bad)} of {checked} LoRA-adapted tensors differ from what the trainer computes "
            f"with its adapters, e.g. {'; '.join(bad[:3])} (the adapters not merged into the "
            "sync?): the engine would keep sampling the base policy. Set "
            "rollout.verify_sync=false to run anyway")
    return {"effective_checked": float(checked)}
