"""Rank side of tests/distributed/test_rebalance.py: 2 gloo processes, CPU.

    torchrun --nproc_per_node=2 tests/distributed/rebalance_worker.py OUT_DIR

Rank 0 holds 4 long rows (prompt width 4, response width 8), rank 1 holds 4 short ones (widths
3 and 2). Every quantity is computed twice, with ``balance_across_ranks`` on and off, through the
real ops (``logprobs``, ``values``, ``update.policy``); each rank writes ``OUT_DIR/rank{r}.pt``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import worker  # noqa: E402  (make_model, VOCAB, ALGO, LR)

# (prompt lengths, response lengths, P, R) per rank; tokens per row: rank 0 [12, 10, 12, 8] = 42,
# rank 1 [5, 3, 5, 2] = 15
SHAPES = {0: ([4, 3, 4, 2], [8, 7, 8, 6], 4, 8), 1: ([3, 2, 3, 1], [2, 1, 2, 1], 3, 2)}


def rank_batch(rank: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses, per-row advantages (fixed seed per rank)."""
    p_lens, r_lens, P, R = SHAPES[rank]
    g = torch.Generator().manual_seed(100 + rank)
    p_mask = torch.arange(P).flip(0).unsqueeze(0) < torch.tensor(p_lens).unsqueeze(1)
    r_mask = torch.arange(R).unsqueeze(0) < torch.tensor(r_lens).unsqueeze(1)
    p_ids = torch.randint(1, worker.VOCAB, (len(p_lens), P), generator=g) * p_mask
    r_ids = torch.randint(1, worker.VOCAB, (len(p_lens), R), generator=g) * r_mask
    adv = torch.randn(len(p_lens), 1, generator=g).expand(-1, R) * r_mask
    return {"prompt_ids": p_ids, "prompt_mask": p_mask, "response_ids": r_ids,
            "response_mask": r_mask, "advantages": adv.contiguous()}


def ctx_for(stage: str, engine, info, step: int = 1):
    from flowrl.algorithms.config import AlgorithmConfig
    from flowrl.engines.base import SamplingConfig
    from flowrl.ops.context import StageContext

    return StageContext(stage=stage, step=step, engine=engine, dist=info,
                        resources={"algorithm": AlgorithmConfig(**worker.ALGO),
                                   "sampling": SamplingConfig(temperature=1.0)},
                        generator=torch.Generator().manual_seed(step))


def run(balance: bool, batch: dict, info) -> dict:
    """old logprobs (with entropy) → values → one update step, all through the registered ops."""
    from flowrl.engines.config import TrainEngineConfig
    from flowrl.engines.train.fsdp import FSDPTrainEngine
    from flowrl.engines.train.value import ValueTrainEngine, value_model_from_causal_lm
    from flowrl.ops.critic import values
    from flowrl.ops.logprobs import LogprobsConfig, logprobs
    from flowrl.ops.rebalance import balance_rows
    from flowrl.ops.update import PolicyUpdateConfig, update_policy

    cfg = TrainEngineConfig(lr=worker.LR, micro_batch_size=2, balance_across_ranks=balance)
    actor = FSDPTrainEngine(worker.make_model(), cfg)
    fwd = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
    out: dict = {}
    bal = balance_rows(ctx_for("probe", actor, info), fwd)
    out["balanced_rows"] = {k: v.clone() for k, v in bal.batch.items()}
    out["balance_metrics"] = dict(bal.metrics)
    lp_ctx = ctx_for("old_logprobs", actor, info)
    old = logprobs(lp_ctx, LogprobsConfig(with_entropy=True), **fwd)["logprobs"]
    out["old_logprobs"], out["old_logprobs_metrics"] = old, dict(lp_ctx.metrics)
    critic = ValueTrainEngine(value_model_from_causal_lm(worker.make_model(seed=3)), cfg)
    out["values"] = values(ctx_for("values", critic, info), None, **fwd)["values"]
    up_ctx = ctx_for("update", actor, info)
    update_policy(up_ctx, PolicyUpdateConfig(), **batch, old_logprobs=old)
    out["update_metrics"] = dict(up_ctx.metrics)
    out["weights"] = {k: v.clone() for k, v in actor.named_weights()}
    return out


def main(out_dir: Path) -> None:
    from flowrl.config import LauncherConfig
    from flowrl.runtime.io import distributed as fdist

    info = fdist.init_distributed("cpu", timeout_s=LauncherConfig().collective_timeout_s,
                                  heartbeat_timeout_s=LauncherConfig().heartbeat_timeout_s)
    batch = rank_batch(info.rank)
    res = {"batch": batch, "on": run(True, batch, info), "off": run(False, batch, info)}
    torch.save(res, out_dir / f"rank{info.rank}.pt")
    fdist.barrier()
    fdist.teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
