"""FSDP2 at one rank keeps the gathered parameters through a pass (``reshard_after_forward``).

At one rank the "shard" is the whole parameter: resharding after forward only drops the compute
copy and makes it again for backward. ``TrainEngineConfig.reshard_after_forward=None`` (auto)
turns it off there, keeps the copies across the update's micro-batches, and drops them when a
pass ends. These tests hold that to the resharding engine's numbers, exactly (fp32 on CPU),
check that the copies really are kept from one micro-batch to the next, and that no gathered
copy outlives a pass in either mode (it would hold device memory until the next backward).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.fsdp import fsdp_variant
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.engines.train.value import ValueTrainEngine, value_model_from_causal_lm
from flowrl.ops.context import DistInfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import worker  # noqa: E402


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded(engine) -> bool:
    return all(isinstance(p, DTensor) for p in engine.model.parameters())


def _engine(cls, model, **cfg):
    return fsdp_variant(cls)(model, TrainEngineConfig(lr=worker.LR, micro_batch_size=2, **cfg))


def _layer_sharded_at_each_forward(engine) -> list[bool]:
    """Whether the first decoder layer's weight is a shard (DTensor) as each micro-batch's
    forward starts (the root's pre-forward hook runs first: the layers are not gathered yet)."""
    seen: list[bool] = []
    w = engine.model.model.layers[0].self_attn.q_proj
    engine.model.register_forward_pre_hook(lambda m, a: seen.append(isinstance(w.weight, DTensor)))
    return seen


def test_one_rank_default_keeps_copies_and_matches_resharding(one_rank):
    keep = _engine(LocalTrainEngine, worker.make_model())
    again = _engine(LocalTrainEngine, worker.make_model(), reshard_after_forward=True)
    assert (keep.reshard_after_forward, again.reshard_after_forward) == (False, True)
    seen_keep, seen_again = _layer_sharded_at_each_forward(keep), _layer_sharded_at_each_forward(again)
    for step in (1, 2, 3):  # 8 rows, 4 micro-batches a pass; logprobs, then the update
        batch = worker.global_batch(step)
        a = worker.update_once(keep, batch, DistInfo(), step)
        b = worker.update_once(again, batch, DistInfo(), step)
        assert _sharded(keep) and _sharded(again), f"a gathered copy outlived step {step}"
        torch.testing.assert_close(a.pop("old_logprobs"), b.pop("old_logprobs"), rtol=0, atol=0)
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/loss"):
            assert a[k] == b[k], (step, k)
        assert a["actor/grad_norm"] > 0.1  # the steps moved the weights
    # each pass (logprobs, then the update: 4 micro-batches each) gathers once when keeping,
    # at every micro-batch when resharding
    assert seen_keep == [True, False, False, False] * 6
    assert seen_again == [True] * 24
    # the weights after three optimizer steps: identical
    for (n, p), (_, q) in zip(keep.model.named_parameters(), again.model.named_parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), n


@pytest.mark.parametrize("reshard", [None, True])
def test_no_grad_pass_drops_copies(one_rank, reshard):
    """logprobs alone leaves no gathered copy, keeping or not (FSDP keeps the root gathered
    after forward by itself), and the pass after an update sees the new weights."""
    eng = _engine(LocalTrainEngine, worker.make_model(), reshard_after_forward=reshard)
    batch = worker.global_batch(1)
    before = eng.logprobs(batch, temperature=1.0).logprobs
    assert _sharded(eng)
    worker.update_once(eng, batch, DistInfo(), step=1)
    after = eng.logprobs(batch, temperature=1.0).logprobs
    assert _sharded(eng)
    assert not torch.equal(before, after)  # the pass saw the updated weights, not a kept copy
    ref = LocalTrainEngine(worker.make_model(), TrainEngineConfig(lr=worker.LR, micro_batch_size=2))
    worker.update_once(ref, batch, DistInfo(), step=1)
    torch.testing.assert_close(after, ref.logprobs(batch, temperature=1.0).logprobs,
                               rtol=1e-5, atol=1e-5)


def test_critic_values_pass_drops_copies(one_rank):
    eng = _engine(ValueTrainEngine, value_model_from_causal_lm(worker.make_model()))
    values = eng.values(worker.global_batch(1))
    assert values.shape == (worker.B_GLOBAL, worker.R)
    assert _sharded(eng)


def test_a_failing_pass_still_drops_copies(one_rank):
    eng = _engine(LocalTrainEngine, worker.make_model())
    batch = worker.global_batch(1)

    def boom(mb, lp, ent):
        raise RuntimeError("loss failed")

    with pytest.raises(RuntimeError, match="loss failed"):
        eng.train_step(batch, boom, temperature=1.0)
    assert _sharded(eng)
