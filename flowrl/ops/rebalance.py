"""Data-parallel load balancing: before a train-role forward, the ranks of a pool swap rows so each
holds the same number of rows carrying nearly the same number of tokens; per-row outputs go back
to the rows' owners in their original order.

Why: FSDP ranks run their forwards/backwards in lockstep, so the rank holding the long responses
sets the step time of all of them. The update's gradient does not depend on which rank holds a
row — its loss denominators are all-reduced over the pool (``ops/update.run_minibatches``) — so
rows may move freely.

How (every rank runs the same steps on the same gathered ints, so all agree without a leader):

1. all-gather each rank's ``(rows, prompt width P, response width R)`` and the per-row token
   counts (valid prompt + response tokens) — ints, never the batch;
2. :func:`balance_assignment`: Karmarkar–Karp largest differencing with equal-size bins over the
   world size (``algorithms/balance.karmarkar_karp``; Karmarkar & Karp 1982, k-way form Michiels
   et al. 2007), each bin given to the rank already holding most of its rows (greedy matching),
   so few rows move;
3. every field is padded to the pool's widest P (left: prompts are left-padded) / R (right), a row's
   fields are packed as bytes, and each pair of ranks exchanges one message each way
   (``torch.distributed.batch_isend_irecv``; gloo and NCCL);
4. the rows a rank ends up with run longest first: the engine's fixed-size micro-batches then
   hold rows of similar length (a padded forward costs rows × longest row, not valid tokens);
5. :meth:`Balanced.restore` sends per-row outputs (logprobs, entropy, values) back the same way,
   puts them in the original order (inverse permutation) and trims them to the rank's own R.

Disabled by ``trainer.engine.balance_across_ranks=false``; a no-op at world size 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence, overload

import torch
from torch import Tensor

from flowrl.algorithms.balance import inverse_permutation, karmarkar_karp
from flowrl.ops.context import StageContext

if TYPE_CHECKING:
    from flowrl.engines.base import LogprobEngine, Trainable


def balance_assignment(lengths: Sequence[Sequence[int]]) -> list[list[int]]:
    """Which rows each rank holds after balancing.

    Rows are numbered globally in rank order (rank 0's rows first). With N rows over W ranks every
    rank gets ``N // W`` or ``N // W + 1`` rows (exactly ``N / W`` when W divides N; the remainder
    comes from zero-weight dummy rows added for ``karmarkar_karp(equal_size=True)``).

    Args:
        lengths: ``lengths[r]`` = token count of each row rank r holds now (non-negative ints).

    Returns:
        ``out[r]`` = ascending global row ids rank r holds after balancing. Deterministic: the
        partition breaks ties by row id, and bins go to the ranks already holding most of their
        rows (greedy matching, largest overlap first), so few rows move.

    Raises:
        ValueError: no ranks, or a negative length.
    """
    W = len(lengths)
    if W < 1:
        raise ValueError("rebalance: need at least one rank")
    flat = [int(x) for rank_lengths in lengths for x in rank_lengths]
    N = len(flat)
    owner = [r for r, rank_lengths in enumerate(lengths) for _ in rank_lengths]
    bins = [[g for g in p if g < N] for p in karmarkar_karp(flat + [0] * (-N % W), W, equal_size=True)]
    stay = [[0] * W for _ in range(W)]  # stay[bin][rank]: rows of the bin already on the rank
    for b, rows in enumerate(bins):
        for g in rows:
            stay[b][owner[g]] += 1
    # greedy matching, heaviest overlap first (ties by bin, then rank): at least half the optimal
    # number of staying rows, O(W² log W) — exactness here only saves bytes, not balance
    out: list[list[int] | None] = [None] * W
    bin_done = [False] * W
    for _, b, r in sorted((-stay[b][r], b, r) for b in range(W) for r in range(W)):
        if not bin_done[b] and out[r] is None:
            out[r], bin_done[b] = bins[b], True
    return out  # type: ignore[return-value]


class RowExchange:
    """Rank ``rank``'s side of an assignment: which local rows go where, and how to put tensors
    together. Pure indexing on tensors whose leading dim is the batch; no communication.

    Args:
        assignment: :func:`balance_assignment`'s output (global row ids per rank).
        counts: rows each rank holds before balancing.
        rank: this rank.

    Attributes:
        send: peer → ascending local rows this rank sends there.
        recv: peer → number of rows arriving from it.
        keep: ascending local rows that stay.
    """

    def __init__(self, assignment: Sequence[Sequence[int]], counts: Sequence[int], rank: int) -> None:
        self.rank, self.world = rank, len(counts)
        self.counts = list(counts)
        starts = [sum(counts[:r]) for r in range(self.world)]
        src = {}  # global row → (owner rank, local row)
        for r, (s, n) in enumerate(zip(starts, counts)):
            for i in range(n):
                src[s + i] = (r, i)
        if sorted(g for rows in assignment for g in rows) != list(range(sum(counts))):
            raise ValueError("rebalance: the assignment is not a partition of the rows")
        self.send = {d: [src[g][1] for g in rows if src[g][0] == rank]
                     for d, rows in enumerate(assignment) if d != rank}
        self.send = {d: rows for d, rows in self.send.items() if rows}
        mine = [src[g] for g in sorted(assignment[rank])]
        self.keep = [i for s, i in mine if s == rank]
        self.recv = {s: n for s in range(self.world) if s != rank
                     and (n := sum(1 for o, _ in mine if o == s))}
        self.num_rows = len(mine)

    def outgoing(self, local: Tensor) -> dict[int, Tensor]:
        """peer → this rank's rows to send it (outbound trip)."""
        return {d: local[rows] for d, rows in self.send.items()}

    def assemble(self, local: Tensor, received: Mapping[int, Tensor]) -> Tensor:
        """The balanced rows in ascending global order: source ranks in order, each source's rows
        in its local order (rank order = global order)."""
        parts = [local[self.keep] if s == self.rank else received[s]
                 for s in range(self.world) if s == self.rank or s in self.recv]
        return torch.cat(parts)

    def _spans(self) -> dict[int, slice]:
        """Where each source's rows sit in the balanced batch."""
        spans, at = {}, 0
        for s in range(self.world):
            n = len(self.keep) if s == self.rank else self.recv.get(s, 0)
            spans[s] = slice(at, at + n)
            at += n
        return spans

    def outgoing_back(self, balanced: Tensor) -> dict[int, Tensor]:
        """source peer → its rows of the balanced output (return trip)."""
        spans = self._spans()
        return {s: balanced[spans[s]] for s in self.recv}

    def restore(self, balanced: Tensor, returned: Mapping[int, Tensor]) -> Tensor:
        """This rank's original rows in their original order from the balanced output of the rows
        it kept and the outputs ``returned`` by the peers it sent rows to."""
        kept = balanced[self._spans()[self.rank]]
        order = self.keep + [i for d in sorted(self.send) for i in self.send[d]]
        rows = torch.cat([kept] + [returned[d] for d in sorted(self.send)])
        return rows[torch.tensor(inverse_permutation(order), dtype=torch.long, device=rows.device)]


def _row_bytes(t: Tensor) -> int:
    return t.shape[1:].numel() * t.element_size()


def pack_rows(fields: Sequence[Tensor]) -> Tensor:
    """(B, total bytes) uint8: every field's row (any dtype/shape with leading dim B) as raw bytes,
    so one message per peer carries all fields."""
    B = fields[0].shape[0]
    if B == 0:
        return torch.empty((0, sum(map(_row_bytes, fields))), dtype=torch.uint8,
                           device=fields[0].device)
    return torch.cat([f.contiguous().reshape(B, -1).view(torch.uint8) for f in fields], dim=1)


def unpack_rows(packed: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Inverse of :func:`pack_rows`: fields with the dtypes and per-row shapes of ``like``."""
    out, at, B = [], 0, packed.shape[0]
    for f in like:
        n = _row_bytes(f)
        # a fresh copy: a view's byte offset need not be a multiple of the dtype's size
        col = packed[:, at:at + n].clone(memory_format=torch.contiguous_format)
        out.append(col.view(f.dtype).reshape(B, *f.shape[1:]))
        at += n
    return out


def _pad_width(t: Tensor, width: int, fill: Any, left: bool) -> Tensor:
    if t.dim() < 2 or t.shape[1] == width:
        return t
    new = t.new_full((t.shape[0], width, *t.shape[2:]), fill)
    if left:
        new[:, width - t.shape[1]:] = t
    else:
        new[:, :t.shape[1]] = t
    return new


_VISION_KEYS = ("pixel_values", "image_grid_thw")  # flowrl.data.images (ops/fields.py VISION)


def check_batch(stage: str, batch: Mapping[str, Any]) -> tuple[int, int, int]:
    """(B, P, R) of a batch that may be rebalanced.

    Raises:
        TypeError: a field that is not a tensor (a list cannot move between ranks row by row).
        ValueError: ``prompt_mask``/``response_mask`` missing, a field whose leading dim is not B,
            or a 2-D+ field whose width is neither P (``prompt_*``) nor R (everything else).
    """
    for k, v in batch.items():
        if not isinstance(v, Tensor):
            raise TypeError(f"stage '{stage}': field '{k}' is a {type(v).__name__}, not a tensor; "
                            "only (B, ...) tensors can be balanced across ranks")
    if "prompt_mask" not in batch or "response_mask" not in batch:
        raise ValueError(f"stage '{stage}': balancing across ranks needs prompt_mask and response_mask")
    B, P = batch["prompt_mask"].shape
    R = batch["response_mask"].shape[1]
    for k, v in batch.items():
        width = P if k.startswith("prompt_") else R
        if k in _VISION_KEYS and v.dim() >= 2 and v.shape[0] == B:
            continue  # (B, N, D) patches / (B, K, 3) grids: widths of their own
        if v.dim() == 0 or v.shape[0] != B or (v.dim() >= 2 and v.shape[1] != width):
            raise ValueError(f"stage '{stage}': field '{k}' has shape {tuple(v.shape)}; expected "
                             f"({B},) or ({B}, {width}, ...)")
    return B, P, R


def _p2p(outgoing: Mapping[int, Tensor], incoming: Mapping[int, int], width: int, group: Any,
         device: torch.device) -> dict[int, Tensor]:
    """Send ``outgoing[peer]`` and receive ``incoming[peer]`` rows of ``width`` bytes from each
    peer (group ranks), all posted at once so no pair waits on another."""
    import torch.distributed as dist

    bufs = {s: torch.empty((n, width), dtype=torch.uint8, device=device) for s, n in incoming.items()}
    ops = [dist.P2POp(dist.isend, t.to(device).contiguous(), dist.get_global_rank(group, d), group)
           for d, t in sorted(outgoing.items())]
    ops += [dist.P2POp(dist.irecv, b, dist.get_global_rank(group, s), group)
            for s, b in sorted(bufs.items())]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return bufs


@dataclass
class Balanced:
    """A stage's batch after balancing and the way back.

    Attributes:
        batch: the rows this rank runs (all fields padded to the pool's widest P / R).
        metrics: ``balance/tokens_max_over_mean_before`` / ``_after`` (max over ranks of the rank's
            tokens / their mean; 1.0 = perfect), ``balance/rows_moved``; empty when disabled.
    """

    batch: dict[str, Tensor]
    metrics: dict[str, float] = field(default_factory=dict)
    exchange: RowExchange | None = None
    group: Any = None
    device: torch.device | None = None
    widths: tuple[int, int] = (0, 0)  # this rank's own (P, R) before padding
    pool_R: int = 0
    order: list[int] = field(default_factory=list)  # batch row j = exchanged row order[j]

    @overload
    def restore(self, out: Tensor) -> Tensor: ...

    @overload
    def restore(self, out: None) -> None: ...

    def restore(self, out: Tensor | None) -> Tensor | None:
        """Per-row output of :attr:`batch` — (B_bal,) or response-aligned (B_bal, R_pool, ...) —
        as the rows this rank held before, in their order, trimmed to its own R, on ``out``'s
        device. Collective: every rank of the pool calls it (``None`` passes through on all)."""
        if out is None or self.exchange is None or self.device is None:
            return out  # not exchanged (disabled, or one rank): the rows are this rank's own
        ex, dev = self.exchange, out.device
        inv = torch.tensor(inverse_permutation(self.order), dtype=torch.long, device=self.device)
        local = out.detach().to(self.device)[inv]
        packed = pack_rows([local])
        back = _p2p({s: pack_rows([t]) for s, t in ex.outgoing_back(local).items()},
                    {d: len(rows) for d, rows in ex.send.items()}, packed.shape[1], self.group,
                    self.device)
        mine = ex.restore(local, {d: unpack_rows(b, [local])[0] for d, b in back.items()})
        if mine.dim() >= 2 and mine.shape[1] == self.pool_R:
            mine = mine[:, :self.widths[1]]
        return mine.to(dev)


def enabled(ctx: StageContext[LogprobEngine | Trainable]) -> bool:
    """``trainer.engine.balance_across_ranks`` of the stage's engine, in a pool of > 1 ranks."""
    from flowrl.ops.collectives import is_initialized

    return ctx.dist.world_size > 1 and is_initialized() and ctx.engine.cfg.balance_across_ranks


def balance_rows(ctx: StageContext[LogprobEngine | Trainable], batch: Mapping[str, Tensor],
                 pad_id: int | None = None) -> Balanced:
    """Balance ``batch`` over the ranks of ``ctx.dist.group`` (collective: every rank calls it).

    Args:
        ctx: the stage's StageContext (engine config, ``dist``).
        batch: (B, ...) tensors: ``prompt_*`` (B, P) left-padded, everything else (B,) or
            (B, R, ...) right-padded. Ranks may differ in B, P and R.
        pad_id: fill of padded ``*_ids`` columns (masks get False, the rest 0); default the
            tokenizer's pad id when the run has one, else 0.

    Returns:
        :class:`Balanced`: this rank's assigned rows, longest (valid tokens) first, ties by
        global row id; identity (same tensors, no metrics) when :func:`enabled` is false.

    Raises:
        TypeError / ValueError: see :func:`check_batch` (checked at every world size).
    """
    import torch.distributed as dist

    from flowrl.ops.collectives import device_for

    B, P, R = check_batch(ctx.stage, batch)
    # a vision-language batch stays where it is: its patch widths differ from rank to rank
    # (each rank then trains its own rows; balancing only evens the work out)
    if not enabled(ctx) or any(k in batch for k in _VISION_KEYS):
        return Balanced(dict(batch))
    group = ctx.dist.group if ctx.dist.group is not None else dist.group.WORLD
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    device = device_for(group)
    shapes = [torch.zeros(3, dtype=torch.long, device=device) for _ in range(W)]
    dist.all_gather(shapes, torch.tensor([B, P, R], device=device), group=group)
    counts, Ps, Rs = zip(*(s.tolist() for s in shapes))
    lengths = (batch["prompt_mask"].bool().sum(-1) + batch["response_mask"].bool().sum(-1)).cpu()
    padded = torch.zeros(max(counts), dtype=torch.long)
    padded[:B] = lengths
    gathered = [torch.zeros_like(padded, device=device) for _ in range(W)]
    dist.all_gather(gathered, padded.to(device), group=group)
    per_rank = [g[:n].tolist() for g, n in zip(gathered, counts)]
    assignment = balance_assignment(per_rank)
    ex = RowExchange(assignment, counts, rank)

    if pad_id is None:
        tok = ctx.resources.get("tokenizer")
        pad_id = getattr(tok, "pad_token_id", None) or 0
    P_max, R_max = max(Ps), max(Rs)
    keys = sorted(batch)
    fields = [_pad_width(batch[k].to(device), P_max if k.startswith("prompt_") else R_max,
                         False if batch[k].dtype == torch.bool else pad_id if k.endswith("_ids") else 0,
                         left=k.startswith("prompt_")) for k in keys]
    packed = pack_rows(fields)
    received = _p2p(ex.outgoing(packed), ex.recv, packed.shape[1], group, device)
    flat = [x for rows in per_rank for x in rows]
    mine = [flat[g] for g in sorted(assignment[rank])]  # exchanged rows: ascending global id
    order = sorted(range(len(mine)), key=lambda j: (-mine[j], j))  # longest first
    exchanged = ex.assemble(packed, received)[torch.tensor(order, dtype=torch.long, device=device)]
    out_fields = unpack_rows(exchanged, fields)
    src_dev = {k: batch[k].device for k in keys}

    before = [sum(rows) for rows in per_rank]
    after = [sum(flat[g] for g in rows) for rows in assignment]
    mean = sum(before) / W

    def ratio(tokens: list[int]) -> float:
        return max(tokens) / mean if mean > 0 else 1.0

    starts = [sum(counts[:r]) for r in range(W)] + [sum(counts)]
    moved = sum(1 for r, rows in enumerate(assignment) for g in rows
                if not starts[r] <= g < starts[r + 1])
    metrics = {"balance/tokens_max_over_mean_before": ratio(before),
               "balance/tokens_max_over_mean_after": ratio(after),
               "balance/rows_moved": float(moved)}
    return Balanced({k: v.to(src_dev[k]) for k, v in zip(keys, out_fields)}, metrics, ex, group,
                    device, (P, R), R_max, order)
