"""LoRA vs full fine-tuning: memory and step time of one RL training step, and the weight-sync bytes.

    python benchmarks/lora.py                       # CPU, SmolLM2-135M shape, writes results/lora.md
    python benchmarks/lora.py --device cuda --shape qwen05b --out benchmarks/results/lora_gpu.md

One step = ref logprobs + old logprobs + one policy update (``LocalTrainEngine.train_step``) on a
fixed batch (``--rows`` sequences of ``--prompt-len`` + ``--response-len`` tokens), on a random-init
model of the named shape (weights do not change the cost). Full: actor + a frozen reference copy
(what ``build_engines`` builds); LoRA (``--rank``, all linear layers): the actor with adapters, the
reference = the same module with the adapters disabled. Each mode runs in its own process; numbers:
median step seconds of ``--repeats`` after one warm-up, the process's peak RSS (CPU) or peak CUDA
memory, the training state bytes (weights + grads + AdamW moments + the reference copy), trainable
parameters, and the bytes one weight sync moves (full: every tensor; LoRA: the merged tensors the
adapters change (an HF rollout copy), or all of them merged (vLLM's whole-layer reload)).
Merged vs adapter sync into vLLM (rollout.vllm.lora_sync) on the GPU: benchmarks/lora_sync.py.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import git_revision, machine_info, utc_now  # noqa: E402

SHAPES = {  # llama-family shapes (SmolLM2-135M; Qwen2.5-0.5B-like: llama attention without bias)
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                    tie_word_embeddings=True),
    "qwen05b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                    tie_word_embeddings=True),
}


def run_mode(args) -> dict:
    import transformers

    from flowrl.engines.config import TrainEngineConfig
    from flowrl.engines.train.local import LocalTrainEngine
    from flowrl.models.lora import (
        AdapterDisabledReference,
        LoraConfig,
        build_lora_actor,
        merged_weights,
    )

    device = torch.device(args.device)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SHAPES[args.shape], **(
        {"num_hidden_layers": args.layers} if args.layers else {})})
    with device:
        model = transformers.LlamaForCausalLM(config)
    cfg = TrainEngineConfig(lr=1e-5, micro_batch_size=args.rows)
    if args.mode == "full":
        import copy

        ref = LocalTrainEngine(copy.deepcopy(model), cfg, trainable=False)
        actor = LocalTrainEngine(model, cfg)
    else:
        actor = build_lora_actor(LocalTrainEngine, model, LoraConfig(rank=args.rank, alpha=2 * args.rank),
                                 cfg, sync="changed")
        ref = AdapterDisabledReference(actor)
    g = torch.Generator().manual_seed(0)
    B, P, R = args.rows, args.prompt_len, args.response_len
    batch = {"prompt_ids": torch.randint(3, config.vocab_size, (B, P), generator=g),
             "prompt_mask": torch.ones(B, P, dtype=torch.bool),
             "response_ids": torch.randint(3, config.vocab_size, (B, R), generator=g),
             "response_mask": torch.ones(B, R, dtype=torch.bool),
             "advantages": torch.randn(B, 1, generator=g).expand(B, R).contiguous()}
    batch = {k: v.to(device) for k, v in batch.items()}
    denom = float(B * R)

    def loss_fn(mb, lp, ent):
        return -(lp * mb["advantages"]).sum() / denom, {}

    def step():
        ref.logprobs(batch, 1.0)
        actor.logprobs(batch, 1.0)
        actor.train_step(batch, loss_fn, 1.0)
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        step()
        if i:
            times.append(time.perf_counter() - t0)
    trainable = [p for p in actor.model.parameters() if p.requires_grad]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    opt = [v for st in actor.optimizer.state.values() for v in st.values()
           if isinstance(v, torch.Tensor) and v.dim() > 0]
    state = nbytes(actor.model.parameters()) + nbytes(trainable) + nbytes(opt)
    if args.mode == "full":
        state += nbytes(ref.model.parameters())
        sync = sync_all = nbytes(p for _, p in actor.named_weights())
    else:
        sync = nbytes(t for _, t in merged_weights(actor.model))
        sync_all = nbytes(t for _, t in merged_weights(actor.model, full=True))
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"mode": args.mode, "step_s": statistics.median(times), "peak_bytes": peak,
            "state_bytes": state, "trainable": sum(p.numel() for p in trainable),
            "sync_bytes": sync, "sync_bytes_full_set": sync_all}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("full", "lora"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "lora.md"))
    args = p.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    rows = []
    for mode in ("full", "lora"):
        cmd = [sys.executable, __file__, "--mode", mode] + [a for a in sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    mib = lambda b: f"{b / 2**20:.1f} MiB"
    mem = "peak CUDA memory" if args.device == "cuda" else "peak RSS"
    table = [f"| mode | step s | {mem} | train state (weights+grads+AdamW+ref) | trainable params "
             "| sync bytes (HF copy: changed) | sync bytes (vLLM: full set) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['mode']} | {r['step_s']:.2f} | {gib(r['peak_bytes'])} | "
                     f"{gib(r['state_bytes'])} | {r['trainable']:,} | {mib(r['sync_bytes'])} | "
                     f"{mib(r['sync_bytes_full_set'])} |")
    m = machine_info()
    text = "\n".join([
        "# LoRA vs full fine-tuning (one RL step: ref + old logprobs + one update)", "",
        f"Command: `python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}`".rstrip() + "  ",
        f"Commit: {git_revision()}  ", f"Date: {utc_now()}  ",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory']}; device {args.device}  ",
        f"Shape: {args.shape}{f' cut to {args.layers} layers' if args.layers else ''} (random init), LoRA rank {args.rank} alpha {2 * args.rank} on all "
        f"linear layers; batch {args.rows} x ({args.prompt_len} + {args.response_len}) tokens, "
        f"median of {args.repeats} steps after a warm-up.", "", *table, ""])
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
