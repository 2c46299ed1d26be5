"""Sequence-length load balancing: split sequences into k bins of nearly equal token count.

Used for micro-batching by token budget (every micro-batch of a rank carries about the same number
of tokens, so no forward pass is padded to a long outlier) and for equal work per data-parallel
rank. Pure Python on integer weights; no torch, no flowrl imports.

The partitioner is the Karmarkar–Karp largest differencing method generalised to k subsets
(Karmarkar & Karp 1982, "The differencing method of set partitioning"; k-way form: Michiels,
Aarts, Korst & van Leeuwen 2007, "Performance ratios of the Karmarkar–Karp differencing
algorithm", §2). Each item starts as a k-tuple of subsets ``({item}, ∅, …, ∅)``; the two tuples with
the largest spread (max − min subset sum) are repeatedly merged by joining the heaviest subset of
one with the lightest of the other, the second heaviest with the second lightest, and so on,
until one tuple — the partition — is left.
"""
from __future__ import annotations

import heapq
import math
from typing import Sequence


def _check(weights: Sequence[int], k: int) -> None:
    if k < 1:
        raise ValueError(f"balance: number of partitions k must be >= 1, got {k}")
    if any(w < 0 for w in weights):
        raise ValueError("balance: weights (sequence lengths) must be >= 0")


def karmarkar_karp(weights: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Partition item indices ``0..n-1`` into ``k`` subsets of nearly equal total weight.

    Args:
        weights: (n,) non-negative integers, e.g. tokens per sequence.
        k: number of subsets.
        equal_size: every subset gets exactly ``n / k`` items (n must be divisible by k): items
            enter in sorted chunks of k, one per subset, so merges never change subset sizes.

    Returns:
        k lists of indices, each sorted ascending; the lists are ordered by their smallest index
        (empty lists last), so the result is deterministic. With n < k some lists are empty.

    Raises:
        ValueError: k < 1, a negative weight, or ``equal_size`` with n not divisible by k.
    """
    _check(weights, k)
    n = len(weights)
    if equal_size and n % k:
        raise ValueError(f"balance: equal_size needs n % k == 0, got n={n}, k={k}")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    # a state: k subsets as (sum, indices), kept sorted by sum descending
    states: list[list[tuple[int, list[int]]]] = []
    if equal_size:
        for c in range(0, n, k):
            chunk = order[c:c + k]
            states.append(sorted(((weights[i], [i]) for i in chunk), key=lambda s: -s[0]))
    else:
        for i in order:
            states.append([(weights[i], [i])] + [(0, []) for _ in range(k - 1)])
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []  # (-spread, id, state)
    for sid, st in enumerate(states):
        heapq.heappush(heap, (-(st[0][0] - st[-1][0]), sid, st))
    counter = len(states)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # heaviest of a with lightest of b: the differencing step
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    parts = [sorted(ix) for _, ix in heap[0][2]] if heap else [[] for _ in range(k)]
    return sorted(parts, key=lambda p: (not p, p[0] if p else 0))


def partition_sums(weights: Sequence[int], parts: Sequence[Sequence[int]]) -> list[int]:
    """Total weight of each subset of ``parts`` (same order)."""
    return [sum(weights[i] for i in p) for p in parts]


def token_budget_partitions(lengths: Sequence[int], max_tokens: int, *, min_parts: int = 1,
                            max_parts: int | None = None) -> list[list[int]]:
    """Micro-batches by token budget: the fewest balanced bins whose sums fit ``max_tokens``.

    Starts from ``k = max(min_parts, ceil(sum / max_tokens))`` and adds a bin while the heaviest
    exceeds the budget (a single sequence longer than the budget gets a bin of its own and is the
    only way a bin can exceed it). ``min_parts`` lets data-parallel ranks agree on one micro-batch
    count (all-reduce max of each rank's count first): FSDP collectives need every rank to run the
    same number of forward/backward passes.

    Args:
        lengths: (n,) tokens per sequence (prompt + response, valid tokens), n >= 1.
        max_tokens: budget per micro-batch, >= 1.
        min_parts: lower bound on the number of bins (clipped to n).
        max_parts: upper bound (default n).

    Returns:
        ``karmarkar_karp(lengths, k)`` with no empty bin.

    Raises:
        ValueError: empty ``lengths``, ``max_tokens < 1`` or ``min_parts < 1``.
    """
    n = len(lengths)
    if n == 0:
        raise ValueError("balance: token_budget_partitions needs at least one sequence")
    if max_tokens < 1 or min_parts < 1:
        raise ValueError(f"balance: max_tokens and min_parts must be >= 1, got {max_tokens}, {min_parts}")
    hi = min(n, max_parts if max_parts is not None else n)
    # an over-budget sequence fills one bin whatever its length: count it as `max_tokens`
    k = min(hi, max(min_parts, math.ceil(sum(min(x, max_tokens) for x in lengths) / max_tokens)))
    while True:
        parts = karmarkar_karp(lengths, k)
        fits = all(len(p) == 1 or s <= max_tokens for p, s in zip(parts, partition_sums(lengths, parts)))
        if k >= hi or fits:
            return parts
        k += 1


def padded_budget_partitions(prompt_lens: Sequence[int], response_lens: Sequence[int],
                             max_tokens: int, *, min_parts: int = 1) -> list[list[int]]:
    """Micro-batches of a padded layout: bins whose padded size fits ``max_tokens``.

    A padded micro-batch of rows ``b`` runs ``len(b) × (max prompt + max response)`` positions
    (its columns are trimmed to its longest prompt and response), so balancing *valid* tokens
    (:func:`token_budget_partitions`) can put one long row with many short ones and run far more
    positions than the budget: at 32k valid tokens, SmolLM2's ~30-token answers beside a few
    256-token ones made ~100k padded positions and a 40 GiB activation peak on an H100. Here rows
    go longest first (prompt + response, ties by index) into the current bin while its padded size
    stays within the budget, so rows of similar length share a bin (little padding) and no bin's
    padded size exceeds the budget unless it is one row.

    Args:
        prompt_lens, response_lens: (n,) real prompt tokens and response positions per row, n >= 1.
        max_tokens: padded positions per micro-batch, >= 1.
        min_parts: lower bound on the number of bins (clipped to n): the bin with the largest
            padded size is split in half (by its order) until there are enough (data-parallel
            ranks agree on one count).

    Returns:
        Lists of row indices, each ascending, the bins ordered by their smallest index.

    Raises:
        ValueError: empty or unequal ``prompt_lens`` / ``response_lens``, ``max_tokens < 1``
            or ``min_parts < 1``.
    """
    n = len(prompt_lens)
    if n == 0 or len(response_lens) != n:
        raise ValueError(f"balance: padded_budget_partitions needs n >= 1 equal-length lists, got "
                         f"{n} prompt and {len(response_lens)} response lengths")
    if max_tokens < 1 or min_parts < 1:
        raise ValueError(f"balance: max_tokens and min_parts must be >= 1, got {max_tokens}, {min_parts}")
    order = sorted(range(n), key=lambda i: (-(prompt_lens[i] + response_lens[i]), i))
    bins: list[list[int]] = []
    cur: list[int] = []
    mp = mr = 0
    for i in order:
        p, r = max(mp, prompt_lens[i]), max(mr, response_lens[i])
        if cur and (len(cur) + 1) * (p + r) > max_tokens:
            bins.append(cur)
            cur, mp, mr = [i], prompt_lens[i], response_lens[i]
        else:
            cur.append(i)
            mp, mr = p, r

    bins.append(cur)

    def padded(b: list[int]) -> int:
        return len(b) * (max(prompt_lens[i] for i in b) + max(response_lens[i] for i in b))

    while len(bins) < min(min_parts, n):
        j = max((j for j in range(len(bins)) if len(bins[j]) > 1), key=lambda j: (padded(bins[j]), -j))
        b = bins.pop(j)
        bins[j:j] = [b[:len(b) // 2], b[len(b) // 2:]]
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def num_budget_parts(lengths: Sequence[int], max_tokens: int) -> int:
    """How many bins :func:`token_budget_partitions` uses for ``lengths`` (for the cross-rank max)."""
    return len(token_budget_partitions(lengths, max_tokens))


def inverse_permutation(order: Sequence[int]) -> list[int]:
    """``inv`` with ``inv[order[j]] = j``: concatenated per-bin outputs ``out`` (rows in ``order``)
    go back to the original row order as ``out[inv]``.

    Raises:
        ValueError: ``order`` is not a permutation of ``0..n-1``.
    """
    n = len(order)
    inv = [-1] * n
    for j, i in enumerate(order):
        if not 0 <= i < n or inv[i] != -1:
            raise ValueError("balance: order is not a permutation")
        inv[i] = j
    return inv
