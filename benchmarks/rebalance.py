"""Step time of old-logprobs + one policy update with rows balanced across data-parallel ranks
(``trainer.engine.balance_across_ranks``) vs not, on a batch whose long responses sit on rank 0.

    torchrun --standalone --nproc_per_node=2 benchmarks/rebalance.py [--budget TOKENS] [--micro-batch N]

Results: benchmarks/results/rebalance_cpu.md (2-layer smoke model on CPU; no GPU run yet).

Model: the Qwen2.5-0.5B-shaped random model of ``benchmarks/scaling.py`` (FSDP2, bf16 compute).
Each rank holds ``--rows`` sequences of ``--prompt-len`` prompt tokens; response lengths are drawn
uniformly from ``--long`` on rank 0 and ``--short`` on rank 1 (same seed for both settings).
Times: wall seconds of the ``logprobs`` op + the ``update.policy`` op (one optimizer step), max
over ranks, median of ``--repeats`` after one warm-up; the batch is the same in every repeat.
Without a GPU it runs a 2-layer model of the same family on gloo: the effect on a small model,
not GPU timings.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.scaling import qwen05b  # noqa: E402


def rank_batch(rank: int, args) -> dict[str, torch.Tensor]:
    lo, hi = args.long if rank == 0 else args.short
    g = torch.Generator().manual_seed(rank)
    lens = torch.randint(lo, hi + 1, (args.rows,), generator=g)
    R, P = int(lens.max()), args.prompt_len
    r_mask = torch.arange(R).unsqueeze(0) < lens.unsqueeze(1)
    return {"prompt_ids": torch.randint(1, 150000, (args.rows, P), generator=g),
            "prompt_mask": torch.ones(args.rows, P, dtype=torch.bool),
            "response_ids": torch.randint(1, 150000, (args.rows, R), generator=g) * r_mask,
            "response_mask": r_mask,
            "advantages": (torch.randn(args.rows, 1, generator=g) * r_mask).contiguous()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--long", type=int, nargs=2, default=[1024, 2048])
    p.add_argument("--short", type=int, nargs=2, default=[64, 512])
    p.add_argument("--budget", type=int, default=0, help="max_tokens_per_micro_batch; 0 = off")
    p.add_argument("--micro-batch", type=int, default=4, help="micro_batch_size (budget off)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    from flowrl.algorithms.config import AlgorithmConfig
    from flowrl.engines.base import SamplingConfig
    from flowrl.engines.config import TrainEngineConfig
    from flowrl.engines.train.fsdp import FSDPTrainEngine
    from flowrl.ops.context import StageContext
    from flowrl.ops.logprobs import LogprobsConfig, logprobs
    from flowrl.ops.update import PolicyUpdateConfig, update_policy
    from flowrl.runtime.io import distributed as fdist

    cuda = torch.cuda.is_available()
    from flowrl.config import LauncherConfig
    info = fdist.init_distributed("cuda" if cuda else "cpu", timeout_s=LauncherConfig().collective_timeout_s,
                                  heartbeat_timeout_s=LauncherConfig().heartbeat_timeout_s)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    batch = rank_batch(info.rank, args)
    tokens = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    rows = {}
    for balance in (False, True):
        cfg = TrainEngineConfig(lr=1e-6, max_tokens_per_micro_batch=args.budget or None,
                                micro_batch_size=args.micro_batch, balance_across_ranks=balance)
        eng = FSDPTrainEngine(qwen05b(smoke=not cuda).to(dev), cfg)
        times, metrics = [], {}
        for it in range(args.repeats + 1):
            ctx = StageContext(stage="update", step=it + 1, engine=eng, dist=info,
                               resources={"algorithm": AlgorithmConfig(n=2),
                                          "sampling": SamplingConfig(temperature=1.0)},
                               generator=torch.Generator().manual_seed(it))
            fdist.barrier()
            sync()
            t0 = time.perf_counter()
            fwd = {k: v for k, v in batch.items() if k != "advantages"}
            old = logprobs(ctx, LogprobsConfig(), **fwd)["logprobs"]
            update_policy(ctx, PolicyUpdateConfig(), **batch, old_logprobs=old)
            sync()
            dt = fdist.all_reduce_max(time.perf_counter() - t0)
            if it:
                times.append(dt)
            metrics = ctx.metrics
        rows[balance] = (statistics.median(times), metrics)
        del eng
        if cuda:
            torch.cuda.empty_cache()
    total = fdist.all_reduce_sum(float(tokens))
    if info.rank == 0:
        gpu = torch.cuda.get_device_name() if cuda else "cpu (smoke: 2-layer model)"
        print(f"# Cross-rank row balancing: {info.world_size} × {gpu}\n")
        print(f"`torchrun --standalone --nproc_per_node={info.world_size} benchmarks/rebalance.py "
              f"{' '.join(sys.argv[1:])}`  ")
        print(f"{args.rows} rows/rank, prompt {args.prompt_len}, responses U{args.long} on rank 0 "
              f"and U{args.short} on rank 1; {int(total)} tokens in all; micro-batches: "
              + (f"{args.budget} tokens" if args.budget else f"{args.micro_batch} rows")
              + f"; old logprobs + 1 update step; median of {args.repeats}.\n")
        print("| balance_across_ranks | step s | tokens/s | max/mean rank tokens | grad norm |")
        print("|---|---|---|---|---|")
        m = rows[True][1]
        for balance, (t, met) in rows.items():
            ratio = m["balance/tokens_max_over_mean_after" if balance
                      else "balance/tokens_max_over_mean_before"]
            print(f"| {str(balance).lower()} | {t:.3f} | {total / t:,.0f} | {ratio:.3f} | "
                  f"{met['actor/grad_norm']:.6f} |")
        print(f"\nspeed-up {rows[False][0] / rows[True][0]:.2f}×; rows moved "
              f"{int(m['balance/rows_moved'])}")
    fdist.teardown()


if __name__ == "__main__":
    main()
