"""flowrl.runtime.step.weight_check: the positions a weight-sync check samples (exact values)."""
import torch

from flowrl.runtime.step.weight_check import SAMPLES, sample_index


def test_positions_are_spread_first_and_last_included_and_in_range():
    assert sample_index(0).tolist() == []
    assert sample_index(1).tolist() == [0]
    assert sample_index(5).tolist() == [0, 1, 2, 3, 4]  # fewer elements than samples: all
    idx = sample_index(1000)
    assert len(idx) == SAMPLES and idx[0] == 0 and idx[-1] == 999
    assert torch.equal(idx, torch.unique(idx))  # strictly increasing, no repeats


def test_tensors_over_two_to_the_24_elements_stay_in_range():
    # SmolLM2's embedding, 49152 x 576 = 28,311,552 elements: a float32 linspace put the last
    # position at 28,311,552 (one past the end) and the default job's first sync raised IndexError
    for numel in (49152 * 576, 2**24 + 1, 2**31 + 3):
        idx = sample_index(numel)
        assert idx.dtype == torch.long and idx[0] == 0 and idx[-1] == numel - 1
        assert bool((idx < numel).all()) and len(torch.unique(idx)) == len(idx) == SAMPLES
