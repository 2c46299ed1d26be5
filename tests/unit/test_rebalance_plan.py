"""ops/rebalance.py without processes: the assignment, the per-rank exchange simulated over
3 ranks (pack → send → assemble → return trip → restore), and the world-size-1 identity."""
import pytest
import torch

from flowrl.engines.config import TrainEngineConfig
from flowrl.ops.context import StageContext
from flowrl.ops.rebalance import (
    RowExchange,
    _pad_width,
    balance_assignment,
    balance_rows,
    check_batch,
    pack_rows,
    unpack_rows,
)


def sums(lengths, assignment):
    flat = [x for rows in lengths for x in rows]
    return [sum(flat[g] for g in rows) for rows in assignment]


def test_two_ranks_exact_assignment():
    lengths = [[10, 9, 8, 1], [2, 2, 1, 1]]  # 28 vs 6 tokens
    a = balance_assignment(lengths)
    # equal-size bins; 19 is the best max any 4/4 split reaches (a bin with the 10 can only add
    # 2+2+1 without going over), and rank 0 keeps 2 of its rows in either bin: ties → bin 0
    assert a == [[0, 3, 4, 5], [1, 2, 6, 7]]
    assert sums(lengths, a) == [15, 19]


def test_three_ranks_bins_go_where_most_rows_already_are():
    lengths = [[3, 1, 4], [1, 5, 9], [2, 6, 5]]  # 8, 15, 13 tokens
    a = balance_assignment(lengths)
    assert a == [[1, 2, 7], [0, 3, 5], [4, 6, 8]]
    assert sums(lengths, a) == [11, 13, 12]


def test_rows_not_divisible_by_world_size_differ_by_one():
    assert balance_assignment([[5, 5, 5], [1]]) == [[0, 2], [1, 3]]
    a = balance_assignment([[7, 7, 7, 7, 1], [], [2]])
    assert sorted(len(rows) for rows in a) == [2, 2, 2]
    assert sorted(g for rows in a for g in rows) == list(range(6))
    assert balance_assignment([[], []]) == [[], []]


def test_assignment_errors():
    with pytest.raises(ValueError, match="at least one rank"):
        balance_assignment([])
    with pytest.raises(ValueError, match="weights"):
        balance_assignment([[1, -1]])
    with pytest.raises(ValueError, match="not a partition"):
        RowExchange([[0, 1], [1]], [2, 1], 0)


def test_exchange_plan_exact():
    a = [[1, 2, 7], [0, 3, 5], [4, 6, 8]]
    ex = [RowExchange(a, [3, 3, 3], r) for r in range(3)]
    assert [(e.send, e.recv, e.keep) for e in ex] == [
        ({1: [0]}, {2: 1}, [1, 2]), ({2: [1]}, {0: 1}, [0, 2]), ({0: [1]}, {1: 1}, [0, 2])]


def test_pack_roundtrip_keeps_dtypes_and_shapes():
    fields = [torch.tensor([[True, False], [False, True]]), torch.tensor([[1, 2], [3, -4]]),
              torch.tensor([0.5, -1.25]), torch.tensor([[1.5, 2.0]] * 2, dtype=torch.bfloat16),
              torch.arange(12, dtype=torch.float32).reshape(2, 3, 2)]
    packed = pack_rows(fields)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 2 + 16 + 4 + 4 + 24)
    for got, want in zip(unpack_rows(packed, fields), fields):
        assert got.dtype == want.dtype and torch.equal(got, want)
    empty = [f[:0] for f in fields]
    assert pack_rows(empty).shape == (0, 50)
    assert [u.shape for u in unpack_rows(pack_rows(empty), empty)] == [f.shape for f in empty]


def test_pad_width_left_and_right():
    left = _pad_width(torch.tensor([[7, 8]]), 4, 0, left=True)
    assert left.tolist() == [[0, 0, 7, 8]]
    right = _pad_width(torch.tensor([[True]]), 3, False, left=False)
    assert right.tolist() == [[True, False, False]] and right.dtype == torch.bool


def test_simulated_three_rank_exchange_and_restore():
    """Every rank's balanced rows are its assigned global rows in ascending order, and per-row
    outputs return to their owners in the original order."""
    counts = [3, 2, 4]
    lengths = [[9, 8, 7], [1, 1], [5, 4, 3, 2]]
    a = balance_assignment(lengths)
    ex = [RowExchange(a, counts, r) for r in range(3)]
    starts = [0, 3, 5]
    # row content: its global id in an int64 field and (id, -id) in a float field
    local = [pack_rows([torch.arange(s, s + n), torch.stack([torch.arange(s, s + n).float(),
                                                             -torch.arange(s, s + n).float()], 1)])
             for s, n in zip(starts, counts)]
    like = unpack_rows(local[0], [torch.zeros(1, dtype=torch.long), torch.zeros(1, 2)])
    sent = [e.outgoing(p) for e, p in zip(ex, local)]
    bal = [e.assemble(local[e.rank], {s: sent[s][e.rank] for s in e.recv}) for e in ex]
    for r in range(3):
        ids, pair = unpack_rows(bal[r], like)
        assert ids.tolist() == a[r]
        assert pair[:, 1].tolist() == [-float(g) for g in a[r]]
    assert sorted(len(rows) for rows in a) == [3, 3, 3]
    # a per-row output (global id × 10) goes back to its owner, in the owner's order
    outs = [unpack_rows(b, like)[0] * 10 for b in bal]
    back = [e.outgoing_back(o) for e, o in zip(ex, outs)]
    for e in ex:
        restored = e.restore(outs[e.rank], {d: back[d][e.rank] for d in e.send})
        s = starts[e.rank]
        assert restored.tolist() == [10 * g for g in range(s, s + counts[e.rank])]


class _Engine:
    def __init__(self, on=True):
        self.cfg = TrainEngineConfig(balance_across_ranks=on)


def _batch():
    return {"prompt_ids": torch.ones(2, 3, dtype=torch.long), "prompt_mask": torch.ones(2, 3, dtype=torch.bool),
            "response_ids": torch.ones(2, 4, dtype=torch.long),
            "response_mask": torch.ones(2, 4, dtype=torch.bool), "advantages": torch.zeros(2, 4)}


def test_world_size_1_is_identity():
    batch = _batch()
    bal = balance_rows(StageContext(stage="old_logprobs", step=1, engine=_Engine()), batch)
    assert all(bal.batch[k] is v for k, v in batch.items())
    assert bal.metrics == {} and bal.exchange is None
    out = torch.randn(2, 4)
    assert bal.restore(out) is out and bal.restore(None) is None


def test_bad_fields_are_named():
    ctx = StageContext(stage="update", step=1, engine=_Engine())
    with pytest.raises(TypeError, match="stage 'update': field 'group_names' is a list"):
        balance_rows(ctx, {**_batch(), "group_names": ["a", "b"]})
    with pytest.raises(ValueError, match="field 'advantages' has shape \\(2, 3\\)"):
        check_batch("update", {**_batch(), "advantages": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="needs prompt_mask and response_mask"):
        check_batch("update", {"response_ids": torch.zeros(2, 3)})
    assert check_batch("update", {**_batch(), "truncated": torch.zeros(2, dtype=torch.bool)}) == (2, 3, 4)


def test_knob_default_on():
    assert TrainEngineConfig().balance_across_ranks is True


def test_unpack_one_row_at_an_odd_byte_offset():
    fields = [torch.tensor([[True]]), torch.tensor([[3, 4]])]  # int64 starts at byte 1
    assert [f.tolist() for f in unpack_rows(pack_rows(fields), fields)] == [[[True]], [[3, 4]]]
