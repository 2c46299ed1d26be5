"""flowrl.runtime.step.weight_check: the positions a weight-sync check samples (exact values)."""
import pytest
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


def _adapted(seed: int = 0):
    """A module with LoRA on an Embedding and two Linears (with bias), adapters non-zero."""
    import peft

    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 6)
            self.proj = torch.nn.Linear(6, 5)
            self.out = torch.nn.Linear(5, 7)

    model = peft.get_peft_model(Net(), peft.LoraConfig(r=2, lora_alpha=4,
                                                       target_modules=["emb", "proj", "out"]))
    for n, p in model.named_parameters():
        if "lora_" in n:
            torch.nn.init.normal_(p, std=0.5)
    return model.get_base_model()


def _merged(model):
    """(name, W0 + delta) of every adapted layer, by peft's own ``get_delta_weight``."""
    from peft.tuners.lora import LoraLayer

    return [(f"{n}.weight", (m.get_base_layer().weight + m.get_delta_weight("default")).detach())
            for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def _probe(named):
    from flowrl.runtime.step.weight_check import SyncProbe

    probe = SyncProbe(named)
    for _ in probe:  # the engine takes every tensor
        pass
    return probe


def test_effective_check_passes_the_merged_weights_and_names_the_base_ones():
    from flowrl.runtime.step.weight_check import WeightSyncError, check_effective

    model = _adapted()
    assert check_effective(model, _probe(_merged(model)), "actor -> rollout (E)") == \
        {"effective_checked": 3.0}
    base = [(f"{n}.weight", m.get_base_layer().weight.detach())
            for n, m in model.named_modules() if n in ("emb", "proj", "out")]
    with pytest.raises(WeightSyncError) as e:
        check_effective(model, _probe(base), "actor -> rollout (E) after step 1")
    assert str(e.value).startswith(
        "weight sync actor -> rollout (E) after step 1: the weights sent are not the trainer's "
        "effective weights: 3 of 3 LoRA-adapted tensors differ from what the trainer computes "
        "with its adapters, e.g. emb.weight (max |difference| ")
    # a merged sync that leaves an adapted layer out (the engine keeps its base weight)
    with pytest.raises(WeightSyncError, match=r"^weight sync x: 1 of 3 LoRA-adapted layers were "
                       r"not sent \(e.g. emb.weight\)"):
        check_effective(model, _probe(_merged(model)[1:]), "x")
    # the adapter tensors sent themselves (an engine that applies them): not judged here
    adapters = [(n, p.detach()) for n, p in model.named_parameters() if "lora_" in n]
    assert check_effective(model, _probe(adapters), "x") == {"effective_checked": 0.0}
    # a model without adapters (full fine-tuning): nothing to compare
    plain = torch.nn.Linear(3, 2)
    assert check_effective(plain, _probe(plain.named_parameters()), "x") == {"effective_checked": 0.0}


def test_effective_check_tolerates_the_cast_to_the_sync_dtype_only():
    from flowrl.runtime.step.weight_check import WeightSyncError, check_effective

    model = _adapted(1)
    sent = [(n, t.to(torch.bfloat16)) for n, t in _merged(model)]  # gather_dtype=bf16
    assert check_effective(model, _probe(sent), "x") == {"effective_checked": 3.0}
    # one value off by 8 ulps of bf16 at the tensor's largest value: refused
    n, t = sent[1]
    t = t.clone()
    t.view(-1)[0] += 8 * torch.finfo(torch.bfloat16).eps * t.abs().max()
    with pytest.raises(WeightSyncError, match=r"1 of 3 LoRA-adapted tensors differ .* e.g. proj.weight"):
        check_effective(model, _probe([sent[0], (n, t), sent[2]]), "x")
