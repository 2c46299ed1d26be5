"""Data-parallel scaling of flowrl's FSDP2 train engine and HF rollout on a Qwen2.5-0.5B-shaped model.

    torchrun --standalone --nproc_per_node=1 benchmarks/scaling.py --out r1.json
    torchrun --standalone --nproc_per_node=2 benchmarks/scaling.py --out r2.json
    python benchmarks/scaling.py --report r1.json r2.json > benchmarks/results/scaling.md

Random weights (Qwen2Config: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864,
vocab 151936, tied embeddings; 494M parameters), fp32 master weights, bf16 compute (FSDP
MixedPrecisionPolicy, fp32 gradient reduce). Fixed shapes: every rank holds ``--batch`` sequences
of ``--prompt-len`` prompt + ``--response-len`` response tokens (weak scaling: the global batch
grows with the world size, as in an RL run with ``prompts_per_step`` per rank).

Measured per rank, reported for rank 0 (times are max over ranks):
- rollout tokens/s: HF ``generate`` (bf16 copy of the model, KV cache) of ``--rollout-batch``
  prompts; response tokens produced / seconds, summed over ranks.
- training tokens/s: one ``train_step`` (forward + backward + clip + AdamW) over the batch in
  token-budget micro-batches; (prompt + response) tokens of the global batch / seconds.
- MFU: model FLOPs (6·N_matmul + 12·L·d·S per token, PaLM appendix B) / seconds / (world ·
  989 TFLOP/s, H200 dense bf16 spec).
- peak memory (torch.cuda.max_memory_allocated), offload and onload seconds, weight gather
  (FSDP shards → rollout engine, in bf16) bytes/s.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PEAK_BF16 = 989e12  # H200 SXM dense bf16 (spec sheet); ~790 TFLOP/s measured on this machine


def qwen05b(seed: int = 0, smoke: bool = False):
    import transformers

    torch.manual_seed(seed)
    shape = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864)
    if smoke:  # CPU check of the script itself: a 2-layer model of the same family
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128)
    cfg = transformers.Qwen2Config(**shape, vocab_size=151936, tie_word_embeddings=True,
                                   max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    return transformers.Qwen2ForCausalLM(cfg)


def flops_per_token(model, seq: int) -> float:
    """6·N (matmul params: every weight but the embedding lookup; the tied LM head counts) plus
    12·L·d·S for attention scores/values (PaLM, Chowdhery et al. 2022, appendix B)."""
    c = model.config
    n = sum(p.numel() for p in model.parameters())  # tied head = embedding: counted once, as matmul
    return 6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(args) -> dict:
    import copy

    from flowrl.engines.base import SamplingConfig
    from flowrl.engines.config import TrainEngineConfig
    from flowrl.engines.rollout.hf import HFRolloutEngine
    from flowrl.engines.train.fsdp import FSDPTrainEngine, broadcast_module
    from flowrl.ops import collectives as coll
    from flowrl.runtime.io import distributed as fdist

    smoke = not torch.cuda.is_available()
    if smoke:  # no GPU: exercise the script on a tiny model (numbers meaningless)
        torch.cuda.max_memory_allocated = torch.cuda.memory_allocated = lambda *a: 0
        torch.cuda.reset_peak_memory_stats = torch.cuda.empty_cache = lambda *a: None
        torch.cuda.get_device_name = lambda *a: "cpu (smoke)"
    from flowrl.config import LauncherConfig
    info = fdist.init_distributed("cpu" if smoke else "cuda", timeout_s=LauncherConfig().collective_timeout_s,
                                  heartbeat_timeout_s=LauncherConfig().heartbeat_timeout_s)
    if info.world_size == 1 and not coll.is_initialized():
        raise SystemExit("run under torchrun (FSDP needs a process group), see the docstring")
    rank, world = info.rank, info.world_size
    dev = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    model = qwen05b(smoke=smoke).to(dev)
    broadcast_module(model)
    n_params = sum(p.numel() for p in model.parameters())
    P, R, B = args.prompt_len, args.response_len, args.batch
    g = torch.Generator().manual_seed(1000 + rank)

    # ---------------- rollout (bf16 copy, as the FSDP plan's rollout engine)
    tok = type("Tok", (), {"eos_token_id": 151643, "pad_token_id": 151643})()
    rmodel = copy.deepcopy(model).to(torch.bfloat16).eval()
    rollout = HFRolloutEngine(rmodel, tok)
    prompts = torch.randint(0, 151000, (args.rollout_batch, P), generator=g).to(dev)
    pmask = torch.ones_like(prompts, dtype=torch.bool)
    sp = SamplingConfig(temperature=1.0, max_new_tokens=R)
    rollout.generate(prompts[:4], pmask[:4], SamplingConfig(temperature=1.0, max_new_tokens=8))
    sync()
    t0 = time.perf_counter()
    out = rollout.generate(prompts, pmask, sp, generator=torch.Generator().manual_seed(rank))
    sync()
    roll_s = time.perf_counter() - t0
    roll_tokens = float(out.response_mask.sum())

    # ---------------- training step
    cfg = TrainEngineConfig(lr=1e-6, max_tokens_per_micro_batch=args.budget,
                            gradient_checkpointing=args.ckpt_act)
    eng = FSDPTrainEngine(model, cfg)
    batch = {"prompt_ids": torch.randint(0, 151000, (B, P), generator=g),
             "prompt_mask": torch.ones(B, P, dtype=torch.bool),
             "response_ids": torch.randint(0, 151000, (B, R), generator=g),
             "response_mask": torch.ones(B, R, dtype=torch.bool),
             "advantages": torch.randn(B, R, generator=g)}
    n_tok = coll.all_reduce_sum(float(B * R))

    def loss_fn(mb, lp, ent):
        adv = mb["advantages"].to(lp.device)
        return -(lp * adv).sum() / n_tok, {}

    eng.train_step(batch, loss_fn, temperature=1.0)  # warm-up (allocator, kernels)
    sync()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        sync()
        fdist.barrier()
        t0 = time.perf_counter()
        m = eng.train_step(batch, loss_fn, temperature=1.0)
        sync()
        times.append(time.perf_counter() - t0)
    step_s = coll.all_reduce_max(min(times))
    peak_train = torch.cuda.max_memory_allocated() / 2**30
    global_tokens = B * (P + R) * world
    mfu = flops_per_token(model, P + R) * global_tokens / step_s / (world * PEAK_BF16)

    # ---------------- logprobs (old-policy forward) throughput
    sync()
    t0 = time.perf_counter()
    eng.logprobs(batch, temperature=1.0)
    sync()
    lp_s = coll.all_reduce_max(time.perf_counter() - t0)

    # ---------------- weight hand-off: gather shards in buckets into the rollout engine (bf16)
    sync()
    t0 = time.perf_counter()
    rollout.load_weights(eng.named_weights(torch.bfloat16))
    sync()
    gather_s = time.perf_counter() - t0
    gather_bytes = eng.last_timings["gather_bytes"]

    # ---------------- offload / onload of params + grads + optimizer state
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() / 2**30
    eng.offload()
    off_s = eng.last_timings["offload_s"]
    after = torch.cuda.memory_allocated() / 2**30
    eng.onload()
    on_s = eng.last_timings["onload_s"]
    res = {
        "world_size": world, "params": n_params, "batch_per_rank": B, "prompt_len": P,
        "response_len": R, "budget": args.budget, "activation_checkpointing": args.ckpt_act,
        "rollout_batch_per_rank": args.rollout_batch,
        "rollout_tokens_per_s": coll.all_reduce_sum(roll_tokens) / coll.all_reduce_max(roll_s),
        "rollout_s": coll.all_reduce_max(roll_s),
        "train_step_s": step_s, "train_tokens_per_s": global_tokens / step_s, "mfu": mfu,
        "logprobs_tokens_per_s": global_tokens / lp_s,
        "peak_mem_train_gib": coll.all_reduce_max(peak_train),
        "mem_before_offload_gib": before, "mem_after_offload_gib": after,
        "offload_s": coll.all_reduce_max(off_s), "onload_s": coll.all_reduce_max(on_s),
        "gather_s": coll.all_reduce_max(gather_s), "gather_gb": gather_bytes / 1e9,
        "gather_gb_per_s": gather_bytes / 1e9 / max(gather_s, 1e-9),
        "grad_norm": m["grad_norm"], "loss": m["loss"],
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["torchrun --standalone", f"--nproc_per_node={world}",
                             "benchmarks/scaling.py", *sys.argv[1:]]),
    }
    if rank == 0:
        print(json.dumps(res, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    fdist.teardown()
    return res


def report(paths: list[str]) -> str:
    rows = [json.loads(Path(p).read_text()) for p in paths]
    rows.sort(key=lambda r: r["world_size"])
    keys = [("world_size", "GPUs", "{:d}"), ("rollout_tokens_per_s", "rollout tok/s", "{:,.0f}"),
            ("train_tokens_per_s", "train tok/s", "{:,.0f}"), ("mfu", "MFU", "{:.1%}"),
            ("logprobs_tokens_per_s", "logprob tok/s", "{:,.0f}"),
            ("train_step_s", "step s", "{:.2f}"), ("peak_mem_train_gib", "peak GiB", "{:.1f}"),
            ("offload_s", "offload s", "{:.2f}"), ("onload_s", "onload s", "{:.2f}"),
            ("gather_gb_per_s", "gather GB/s", "{:.1f}")]
    lines = ["| " + " | ".join(k[1] for k in keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f.format(r[k]) for k, _, f in keys) + " |")
    if len(rows) > 1 and rows[0]["world_size"] == 1:
        for r in (r for r in rows if r["world_size"] > 1):
            ratio = r["train_tokens_per_s"] / rows[0]["train_tokens_per_s"]
            lines.append(f"\n1→{r['world_size']} GPU training throughput ratio: **{ratio:.2f}×**")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64, help="sequences per rank in the train step")
    p.add_argument("--rollout-batch", type=int, default=64, help="prompts per rank generated")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--budget", type=int, default=16384, help="max_tokens_per_micro_batch")
    p.add_argument("--steps", type=int, default=3, help="timed train steps (best is reported)")
    p.add_argument("--ckpt-act", action="store_true", help="activation checkpointing")
    p.add_argument("--out", default=None)
    p.add_argument("--report", nargs="+", default=None, help="JSON results → markdown table")
    args = p.parse_args()
    if args.report:
        print(report(args.report))
        return
    run(args)


if __name__ == "__main__":
    main()
