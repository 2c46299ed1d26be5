"""Karmarkar–Karp partitioning, token-budget micro-batches, order restoration (exact values)."""
import pytest

from flowrl.algorithms.balance import (
    inverse_permutation,
    karmarkar_karp,
    num_budget_parts,
    partition_sums,
    token_budget_partitions,
)


def test_kk_two_way_textbook_example():
    # {8,7,6,5,4}: the largest differencing method ends with difference 2 (14 / 16), the known
    # gap to the perfect 15 / 15 split (Karmarkar & Karp 1982) -- proof it is LDM, not a search
    w = [8, 7, 6, 5, 4]
    parts = karmarkar_karp(w, 2)
    assert parts == [[0, 2], [1, 3, 4]]
    assert partition_sums(w, parts) == [14, 16]


def test_kk_equal_size_and_three_way():
    w = [10, 9, 8, 7, 6, 5, 4, 3]
    eq = karmarkar_karp(w, 2, equal_size=True)
    assert eq == [[0, 3, 5, 6], [1, 2, 4, 7]] and partition_sums(w, eq) == [26, 26]
    three = karmarkar_karp(w, 3)
    assert three == [[0, 3], [1, 4, 7], [2, 5, 6]] and partition_sums(w, three) == [17, 18, 17]
    # every index exactly once
    assert sorted(i for p in three for i in p) == list(range(len(w)))


def test_kk_more_bins_than_items_and_errors():
    assert karmarkar_karp([1, 2], 4) == [[0], [1], [], []]
    with pytest.raises(ValueError, match="k must be >= 1"):
        karmarkar_karp([1], 0)
    with pytest.raises(ValueError, match="equal_size"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)
    with pytest.raises(ValueError, match=">= 0"):
        karmarkar_karp([1, -2], 2)


def test_token_budget_fits_and_uses_fewest_bins():
    lengths = [100, 10, 10, 10, 50, 60]
    parts = token_budget_partitions(lengths, 100)
    assert parts == [[0], [1, 2, 4], [3, 5]]
    assert partition_sums(lengths, parts) == [100, 70, 70]
    assert num_budget_parts(lengths, 100) == 3
    # a sequence longer than the budget gets a bin of its own (the only over-budget case)
    assert token_budget_partitions([300, 5, 5], 100) == [[0], [1, 2]]
    # ranks agree on a larger count: min_parts forces it, bins stay balanced
    forced = token_budget_partitions(lengths, 100, min_parts=4)
    assert forced == [[0], [1, 2, 3], [4], [5]]
    assert partition_sums(lengths, forced) == [100, 30, 50, 60]
    with pytest.raises(ValueError, match="at least one"):
        token_budget_partitions([], 10)


def test_inverse_permutation_restores_order():
    parts = [[2, 0], [3], [1]]
    order = [i for p in parts for i in p]  # rows as the micro-batches emit them
    inv = inverse_permutation(order)
    emitted = [f"row{i}" for i in order]
    assert [emitted[j] for j in inv] == ["row0", "row1", "row2", "row3"]
    with pytest.raises(ValueError, match="permutation"):
        inverse_permutation([0, 0])


# ---------------------------------------------------------------- padded layout
def test_padded_bins_group_similar_lengths_and_fit_the_budget():
    from flowrl.algorithms.balance import padded_budget_partitions

    # 8 long rows (256) among 24 short ones (30), prompts of 100: rows longest first
    p, r = [100] * 32, [256 if i % 4 == 0 else 30 for i in range(32)]
    bins = padded_budget_partitions(p, r, 2048)
    assert bins == [[0, 4, 8, 12, 16], [1, 2, 20, 24, 28], [3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17,
                                                          18, 19, 21, 22],
                    [23, 25, 26, 27, 29, 30, 31]]
    padded = [len(b) * (max(p[i] for i in b) + max(r[i] for i in b)) for b in bins]
    assert padded == [1780, 1780, 1950, 910] and max(padded) <= 2048
    assert sorted(i for b in bins for i in b) == list(range(32))
    # valid-token bins of the same budget (Karmarkar-Karp) pad a long row into every bin
    kk = token_budget_partitions([a + b for a, b in zip(p, r)], 2048)
    kk_padded = [len(b) * (max(p[i] for i in b) + max(r[i] for i in b)) for b in kk]
    assert max(kk_padded) > 2048


def test_padded_bins_one_over_budget_row_alone_and_min_parts_splits_the_largest():
    from flowrl.algorithms.balance import padded_budget_partitions

    assert padded_budget_partitions([10, 2, 2], [500, 3, 3], 100) == [[0], [1, 2]]
    assert padded_budget_partitions([5, 5, 5], [1, 2, 3], 100) == [[0, 1, 2]]
    assert padded_budget_partitions([5, 5, 5], [1, 2, 3], 100, min_parts=2) == [[0, 1], [2]]
    assert padded_budget_partitions([5, 5, 5], [1, 2, 3], 100, min_parts=5) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="n >= 1 equal-length lists"):
        padded_budget_partitions([1, 2], [3], 10)
    with pytest.raises(ValueError, match="max_tokens and min_parts must be >= 1"):
        padded_budget_partitions([1], [3], 0)
