"""The rank side of tests/distributed: run under ``torchrun --nproc_per_node=2`` (gloo, CPU).

    torchrun --nproc_per_node=2 tests/distributed/worker.py OUT_DIR

Rank 0 writes ``OUT_DIR/results.pt``; the pytest process (world size 1) recomputes the same
quantities with :class:`LocalTrainEngine` on the whole global batch and compares.
Shared by both sides: :func:`global_batch`, :func:`make_model`, :func:`update_once`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

from flowrl.algorithms.config import AlgorithmConfig
from flowrl.engines.base import SamplingConfig
from flowrl.engines.config import TrainEngineConfig
from flowrl.ops.context import DistInfo, StageContext

B_GLOBAL, P, R, VOCAB = 8, 4, 6, 256
# valid response lengths of the 8 global rows: uneven on purpose (rank 0 gets rows 0-3)
RESP_LENS = [6, 1, 3, 2, 5, 6, 1, 4]
PROMPT_LENS = [4, 2, 3, 4, 1, 4, 2, 3]
LR = 1e-3
ALGO = dict(n=2, loss_agg_mode="token-mean")


def make_model(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def global_batch(seed: int) -> dict[str, torch.Tensor]:
    """8 left-padded prompts / right-padded responses with uneven lengths, plus advantages."""
    g = torch.Generator().manual_seed(seed)
    p_mask = torch.arange(P).flip(0).unsqueeze(0) < torch.tensor(PROMPT_LENS).unsqueeze(1)
    r_mask = torch.arange(R).unsqueeze(0) < torch.tensor(RESP_LENS).unsqueeze(1)
    p_ids = torch.randint(1, VOCAB, (B_GLOBAL, P), generator=g) * p_mask
    r_ids = torch.randint(1, VOCAB, (B_GLOBAL, R), generator=g) * r_mask
    adv = torch.randn(B_GLOBAL, 1, generator=g).expand(B_GLOBAL, R) * r_mask
    return {"prompt_ids": p_ids, "prompt_mask": p_mask, "response_ids": r_ids,
            "response_mask": r_mask, "advantages": adv.contiguous()}


def shard(batch: dict, rank: int, world: int) -> dict:
    n = B_GLOBAL // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def update_once(engine, batch: dict, dist: DistInfo, step: int) -> dict[str, float]:
    """old_logprobs from the engine, then one ``update.policy`` op call (the real op)."""
    from flowrl.ops.update import PolicyUpdateConfig, update_policy

    batch = dict(batch)
    batch["old_logprobs"] = engine.logprobs(batch, temperature=1.0).logprobs
    ctx = StageContext(stage="update", step=step, engine=engine, dist=dist,
                       resources={"algorithm": AlgorithmConfig(**ALGO),
                                  "sampling": SamplingConfig(temperature=1.0)},
                       generator=torch.Generator().manual_seed(step))
    update_policy(ctx, PolicyUpdateConfig(), **batch)
    return {**ctx.metrics, "old_logprobs": batch["old_logprobs"]}


def main(out: Path) -> None:
    from flowrl.config import LauncherConfig
    from flowrl.engines.train.fsdp import FSDPTrainEngine
    from flowrl.runtime.io import distributed as fdist
    from flowrl.runtime.io.checkpoint import CheckpointManager

    info = fdist.init_distributed("cpu", timeout_s=LauncherConfig().collective_timeout_s,
                                  heartbeat_timeout_s=LauncherConfig().heartbeat_timeout_s)
    r, w = info.rank, info.world_size
    res: dict = {}
    # token budget 12: balanced bins differ from the reference's fixed micro-batches of 2 rows
    cfg = TrainEngineConfig(lr=LR, max_tokens_per_micro_batch=12)
    eng = FSDPTrainEngine(make_model(), cfg)
    b1 = shard(global_batch(1), r, w)
    parts = eng._partitions(b1)
    p_lens, r_lens = b1["prompt_mask"].sum(-1).tolist(), b1["response_mask"].sum(-1).tolist()
    gathered = [None] * w
    torch.distributed.all_gather_object(gathered, [[(p_lens[i], r_lens[i]) for i in p] for p in parts])
    res["micro_batch_rows"] = gathered
    m1 = update_once(eng, b1, info, step=1)
    olp = [None] * w
    torch.distributed.all_gather_object(olp, m1.pop("old_logprobs"))
    res["old_logprobs"] = torch.cat(olp)
    res["step1"] = m1
    # the fast forward paths under FSDP: packed micro-batches, LM head in chunks of 3 tokens
    fast = FSDPTrainEngine(make_model(), TrainEngineConfig(
        lr=LR, max_tokens_per_micro_batch=12, padding_free="true", logprob_chunk_size=3))
    mf = update_once(fast, b1, info, step=1)
    torch.distributed.all_gather_object(olp, mf.pop("old_logprobs"))
    res["fast_old_logprobs"], res["fast_step1"] = torch.cat(olp), mf
    del fast
    # sharded save at world size 2 (async: returns after the host copy), then one more step
    ckpts = CheckpointManager(out / "ckpt")
    ckpts.save(1, {"actor": eng.state_dict()}, {"world_size": w}, async_save=True)
    ckpts.wait()
    res["step2"] = update_once(eng, shard(global_batch(2), r, w), info, step=2)
    res["step2"].pop("old_logprobs")
    res["weights"] = {k: v.clone() for k, v in eng.named_weights()}
    res["gather"] = dict(eng.last_timings)
    if r == 0:
        torch.save(res, out / "results.pt")
    fdist.barrier()
    fdist.teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
