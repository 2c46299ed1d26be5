"""Moving tensors between the pools of a partitioned placement.

* :func:`send_batch` / :func:`recv_batch`: one rollout batch (``"stage.output" → value``) from a
  rollout-pool rank to a train-pool rank, point-to-point, tagged with the weight version that
  produced it. Wire format: an int64 length, a pickled header (version, step, metrics, and per key
  either the tensor's dtype/shape or a small picklable value such as ``ground_truth`` strings),
  then each tensor's bytes. Nothing is gathered on one rank.
* :class:`WeightBroadcaster`: after each update, train-pool rank 0 broadcasts the actor's weights
  to every rollout-pool rank over a dedicated group (``dist.new_group([train0, *rollout])``),
  flattened per dtype into buckets of ``bucket_mb`` MiB, so a 1.7 B model is a few large
  collectives rather than hundreds of small ones.

Every receive waits with a timeout and turns a dead or silent peer (gloo raises on a closed
connection) into :class:`PoolPeerError` naming the pool and rank, so nothing hangs forever.
"""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor


class PoolPeerError(RuntimeError):
    """The other pool stopped sending or receiving (process died, or silent past the timeout)."""


def _peer_error(what: str, e: RuntimeError) -> PoolPeerError:
    return PoolPeerError(f"{what} ({str(e).splitlines()[0][:300]})")


def _post(op: Callable[[], Any], what: str) -> Any:
    """Post an async collective or p2p op. Posting can fail already: gloo refuses an isend /
    irecv to a peer whose connection has closed ("Connection closed by peer"), a dead peer seen
    before the wait."""
    try:
        return op()
    except RuntimeError as e:
        raise _peer_error(what, e) from e


def _wait(work: Any, timeout_s: float, what: str) -> None:
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:  # gloo: "Connection closed by peer", "Timed out waiting ..."
        raise _peer_error(what, e) from e
    if ok is False:  # some backends report a timeout by returning False
        raise PoolPeerError(f"{what} (nothing within {timeout_s:.0f} s)")


def _isend(t: Tensor, dst: int, group: Any, what: str) -> tuple[Any, Tensor]:
    return _post(lambda: dist.isend(t, dst, group=group), what), t


def _recv_into(t: Tensor, src: int, group: Any, timeout_s: float, what: str) -> None:
    _wait(_post(lambda: dist.irecv(t, src, group=group), what), timeout_s, what)


def _send_bytes(obj: Any, dst: int, group: Any, device: torch.device, what: str) -> list:
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    return [_isend(size, dst, group, what), _isend(payload, dst, group, what)]


def _recv_bytes(src: int, group: Any, device: torch.device, timeout_s: float, what: str) -> Any:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    _recv_into(size, src, group, timeout_s, what)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _recv_into(payload, src, group, timeout_s, what)
    return pickle.loads(payload.cpu().numpy().tobytes())


@dataclass
class TaggedBatch:
    """One received rollout batch.

    Attributes:
        data: ``"stage.output"`` → tensor or small object, as the sender's store held it.
        version: weight version (number of updates) of the policy that generated it.
        step: the training step it was generated for.
        metrics: the sending rank's step metrics (reward, rollout times, its store report).
        src: global rank of the sender.
        state: the sender's small picklable state (the prompt sampler's, for checkpoints).
    """

    data: dict[str, Any]
    version: int
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    src: int = -1
    state: Any = None


@dataclass
class PendingSend:
    """In-flight isends of one batch. Holds the only references to the sent tensors (the sender's
    store has already freed them) until :meth:`wait` confirms delivery."""

    works: list
    dst: int
    timeout_s: float
    what: str

    def done(self) -> bool:
        return all(w.is_completed() for w, _ in self.works)

    def wait(self) -> None:
        for w, _ in self.works:
            _wait(w, self.timeout_s, self.what)
        self.works = []


def send_batch(data: Mapping[str, Any], *, version: int, step: int, dst: int,
               metrics: Mapping[str, float] | None = None, group: Any = None,
               device: torch.device | str = "cpu", timeout_s: float = 600.0,
               peer: str = "train pool", state: Any = None) -> PendingSend:
    """Post the isends of one batch to global rank ``dst``; returns without waiting.

    Args:
        data: key → Tensor (any dtype/shape; sent as raw bytes) or picklable object.
        version: weight version that generated the batch; step: its training step.
        device: where tensors travel (``cuda`` under NCCL, ``cpu`` under gloo).
        peer: how errors name the receiver, e.g. ``"train pool rank 0"``.
        state: small picklable object carried in the header (:attr:`TaggedBatch.state`).
    """
    device = torch.device(device)
    header: dict[str, Any] = {"version": int(version), "step": int(step),
                              "metrics": dict(metrics or {}), "tensors": [], "objects": {},
                              "state": state}
    tensors = []
    for key, v in data.items():
        if isinstance(v, Tensor):
            header["tensors"].append((key, v.dtype, tuple(v.shape)))
            tensors.append(v.detach().to(device).contiguous())
        else:
            header["objects"][key] = v
    what = f"{peer} (rank {dst}) stopped receiving"
    works = _send_bytes(header, dst, group, device, what)
    works += [_isend(t, dst, group, what) for t in tensors]
    return PendingSend(works, dst, timeout_s, what)


def recv_batch(src: int, *, group: Any = None, device: torch.device | str = "cpu",
               timeout_s: float = 600.0, peer: str = "rollout pool") -> TaggedBatch:
    """Receive one batch posted by :func:`send_batch` on global rank ``src``.

    Raises:
        PoolPeerError: ``"<peer> rank <src> stopped sending (...)"`` when the sender died or sent
            nothing within ``timeout_s`` seconds (per message).
    """
    device = torch.device(device)
    what = f"{peer} rank {src} stopped sending"
    header = _recv_bytes(src, group, device, timeout_s, what)
    data: dict[str, Any] = dict(header["objects"])
    for key, dtype, shape in header["tensors"]:
        t = torch.empty(shape, dtype=dtype, device=device)
        _recv_into(t, src, group, timeout_s, what)
        data[key] = t
    order = [k for k, _, _ in header["tensors"]] + list(header["objects"])
    return TaggedBatch({k: data[k] for k in order}, header["version"], header["step"],
                       header["metrics"], src, header.get("state"))


def _buckets(meta: list[tuple[str, torch.dtype, tuple]], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``meta`` grouped by dtype, each group cut into runs of <= bucket_bytes (a
    tensor larger than a bucket gets a bucket of its own)."""
    out: list[list[int]] = []
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype, _) in enumerate(meta):
        by_dtype.setdefault(dtype, []).append(i)
    for idx in by_dtype.values():
        cur: list[int] = []
        size = 0
        for i in idx:
            _, dtype, shape = meta[i]
            nb = torch.Size(shape).numel() * dtype.itemsize
            if cur and size + nb > bucket_bytes:
                out.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += nb
        if cur:
            out.append(cur)
    return out


class WeightBroadcaster:
    """Bucketed broadcast of named weights from ``src`` (train-pool rank 0) to the rollout pool.

    Args:
        group: process group of ``src`` and every rollout-pool rank (``dist.new_group``).
        src: global rank that owns the weights.
        bucket_mb: bucket size in MiB (``placement.bucket_mb``).
        device: where buckets travel (``cuda`` under NCCL, ``cpu`` under gloo).
        timeout_s: per-collective timeout of the receivers.
        receivers: how a sender's error names them, e.g. ``"rollout pool ranks [1]"``.
    """

    def __init__(self, group: Any, src: int, *, bucket_mb: int = 256,
                 device: torch.device | str = "cpu", timeout_s: float = 600.0,
                 receivers: str = "rollout pool"):
        self.group, self.src, self.timeout_s = group, src, timeout_s
        self.receivers = receivers  # how errors on the sender name them
        self.bucket_bytes = int(bucket_mb) * 2**20
        self.device = torch.device(device)
        self.last_bytes = 0  # bytes broadcast by the last call
        self.last_buckets = 0

    def _bcast(self, t: Tensor, what: str) -> None:
        work = _post(lambda: dist.broadcast(t, self.src, group=self.group, async_op=True), what)
        _wait(work, self.timeout_s, what)

    def _header(self, obj: Any, what: str) -> Any:
        if dist.get_rank() == self.src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._bcast(size, what)
        if dist.get_rank() != self.src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._bcast(payload, what)
        return pickle.loads(payload.numpy().tobytes())

    def send(self, named: Iterable[tuple[str, Tensor]], version: int) -> None:
        """On ``src``: broadcast ``named`` (e.g. ``engine.named_weights()``) as ``version``.

        Raises:
            PoolPeerError: a rollout-pool rank died or stopped receiving.
        """
        named = [(k, v.detach()) for k, v in named]
        meta = [(k, v.dtype, tuple(v.shape)) for k, v in named]
        what = f"{self.receivers} stopped receiving weights"
        self._header({"version": int(version), "meta": meta}, what)
        self.last_bytes, self.last_buckets = 0, 0
        for idx in _buckets(meta, self.bucket_bytes):
            flat = torch.cat([named[i][1].reshape(-1).to(self.device) for i in idx])
            self._bcast(flat, what)
            self.last_bytes += flat.numel() * flat.element_size()
            self.last_buckets += 1

    def recv(self) -> tuple[int, list[tuple[str, Tensor]]]:
        """On a rollout-pool rank: receive one broadcast; returns ``(version, named tensors)``
        (views into the received buckets, on ``device``).

        Raises:
            PoolPeerError: train pool rank ``src`` died or sent nothing within the timeout.
        """
        what = f"train pool rank {self.src} stopped sending weights"
        head = self._header(None, what)
        meta = head["meta"]
        out: list[tuple[str, Tensor]] = [None] * len(meta)  # type: ignore[list-item]
        self.last_bytes, self.last_buckets = 0, 0
        for idx in _buckets(meta, self.bucket_bytes):
            dtype = meta[idx[0]][1]
            sizes = [torch.Size(meta[i][2]).numel() for i in idx]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            self._bcast(flat, what)
            for i, part in zip(idx, flat.split(sizes)):
                out[i] = (meta[i][0], part.view(meta[i][2]))
            self.last_bytes += flat.numel() * flat.element_size()
            self.last_buckets += 1
        return int(head["version"]), out


__all__ = ["PendingSend", "PoolPeerError", "TaggedBatch", "WeightBroadcaster", "recv_batch",
           "send_batch"]
