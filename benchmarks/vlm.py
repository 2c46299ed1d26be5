"""Vision-language RL on one GPU: rollout tokens/s and training step time of a Qwen2.5-VL-3B-shaped
random model, with flowrl's HF and vLLM rollout engines (the images of ``data=visual``; vLLM's
through ``multi_modal_data``), the train engine's logprobs and update, the vLLM weight sync, plus
raw vLLM generation from text prompts on the same checkpoint.

    HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 timeout 580 python benchmarks/vlm.py \
        --md-out benchmarks/results/vlm_h200.md        # one H200: ~5-7 min (estimate, not run)
    python benchmarks/vlm.py --with-raw ...             # + raw vLLM from text prompts (~2 min)
    python benchmarks/vlm.py --skip-vllm ...            # the HF rows only
    python benchmarks/vlm.py --smoke                    # CPU, a 2-layer model: numbers mean nothing

Model: transformers ``Qwen2_5_VLConfig`` with Qwen2.5-VL-3B's shapes (text: hidden 2048, 36
layers, 16 heads, 2 KV heads, intermediate 11008, vocab 151936, tied embeddings; vision: 32
blocks of width 1280, 16 heads, window attention, out width 2048), random weights, saved once in
bf16 to ``--model-dir`` with the tokenizer (SmolLM2's + the vision tokens, VL chat template) and
the image processor, so every variant loads the same directory. Workload: ``--prompts`` visual
prompts (``--image-size`` pixels: 448 = 32x32 patches = 256 image tokens each) x ``--n``
samples, temperature 1, ``--new-tokens`` new tokens per response (a random model rarely samples
EOS, so responses run the full length).

Rows: ``hf-rollout`` (HFRolloutEngine.generate with the images, bf16 copy of the weights),
``logprobs`` (LocalTrainEngine.logprobs in ``--train-dtype``, default bf16 weights: the one-GPU
FSDP2 mixed-precision path is not used here; note: the HF rollout's mismatch against it),
``train-step`` (one AdamW step of the GRPO loss over the batch in micro-batches of
``--micro-batch``); in a child process each (a clean device; a failure is reported in the table,
not raised): ``vllm-rollout`` (flowrl's in-process VLLMRolloutEngine.generate with the images,
bf16, CUDA graphs; note: its mismatch against the bf16 trainer), ``vllm-weight-sync`` (one
``load_weights`` of the whole VLM from the trainer's parameters, GiB in the note) and, with
``--with-raw``, ``vllm-raw`` (``vllm.LLM.generate`` of chat-template text prompts +
``multi_modal_data``: vLLM without flowrl).
``step (hf)`` / ``step (vllm)`` add up one GRPO step's parts (rollout + logprobs + train step
[+ weight sync]): sums of the rows above, not one measured run (the trainer's two rows are
measured once, on the HF rollout's batch).
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWEN25_VL_3B = {
    "model_type": "qwen2_5_vl",
    "text_config": {"hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
                    "num_key_value_heads": 2, "intermediate_size": 11008, "vocab_size": 151936,
                    "tie_word_embeddings": True, "max_position_embeddings": 32768,
                    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
    "vision_config": {"depth": 32, "hidden_size": 1280, "num_heads": 16, "intermediate_size": 3420,
                      "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "in_channels": 3},
    "tie_word_embeddings": True,
}
SMOKE = {
    "model_type": "qwen2_5_vl",
    "text_config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "intermediate_size": 128,
                    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}},
    "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                      "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [0],
                      "in_channels": 3},
}


def build_model_dir(tiny: dict, out: Path, image_size: int) -> Path:
    """Random model + tokenizer + image processor saved to ``out`` (once)."""
    import torch

    from flowrl.models.loading import ModelConfig, load_model, load_tokenizer
    from flowrl.models.vision import image_processor

    if (out / "config.json").is_file():
        return out
    cfg = ModelConfig(tiny=tiny, dtype="bfloat16")
    tok = load_tokenizer(cfg)
    model = load_model(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    proc = image_processor(cfg)
    proc.min_pixels = proc.max_pixels = image_size * image_size
    proc.size = {"shortest_edge": image_size * image_size, "longest_edge": image_size * image_size}
    proc.save_pretrained(out)
    return out


def prompts(args, tok, model_cfg):
    from flowrl.data import DataConfig, PromptSource
    from flowrl.data.visual import VisualConfig
    from flowrl.runtime.step.resources import image_encoder

    data = DataConfig(name="visual", visual=VisualConfig(image_size=args.image_size,
                                                         train_size=max(64, args.prompts),
                                                         test_size=8),
                      max_prompt_tokens=4096)
    return PromptSource(data, tok, image_encoder=image_encoder(model_cfg, tok))


def run_flowrl(args, model_dir: Path) -> list[dict]:
    import torch

    from flowrl.algorithms.losses import POLICY_LOSSES
    from flowrl.engines.base import SamplingConfig
    from flowrl.engines.config import TrainEngineConfig
    from flowrl.engines.rollout.hf import HFRolloutEngine
    from flowrl.engines.train.local import LocalTrainEngine
    from flowrl.models.loading import ModelConfig, load_model, load_tokenizer
    from flowrl.ops.vision import cut_at_vision_tokens

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cfg = ModelConfig(path=str(model_dir), dtype=args.train_dtype, attn_implementation="sdpa")
    tok = load_tokenizer(cfg)
    src = prompts(args, tok, cfg)
    batch = src.sample(args.prompts, args.n)
    images = {k: v.to(dev) for k, v in batch.images().items()}
    p_ids, p_mask = batch.prompt_ids.to(dev), batch.prompt_mask.to(dev)
    actor = load_model(cfg, dev)
    rollout_model = load_model(ModelConfig(path=str(model_dir), dtype="bfloat16",
                                           attn_implementation="sdpa"), dev)
    rollout = HFRolloutEngine(rollout_model, tok)
    params = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens)
    rows = []
    rollout.generate(p_ids[:2], p_mask[:2], SamplingConfig(temperature=1.0, max_new_tokens=4),
                     images={k: v[:2] for k, v in images.items()})  # warm-up
    sync()
    t0 = time.perf_counter()
    out = rollout.generate(p_ids, p_mask, params, generator=torch.Generator().manual_seed(0),
                           images=images)
    sync()
    dt = time.perf_counter() - t0
    out = cut_at_vision_tokens(out, tok)
    ntok = int(out.response_mask.sum())
    rows.append({"variant": "hf-rollout", "seconds": dt, "tokens": ntok, "tokens_per_s": ntok / dt})
    del rollout, rollout_model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    engine = LocalTrainEngine(actor, TrainEngineConfig(lr=1e-6, micro_batch_size=args.micro_batch,
                                                       gradient_checkpointing=True))
    mb = {"prompt_ids": p_ids, "prompt_mask": p_mask, "response_ids": out.response_ids.to(dev),
          "response_mask": out.response_mask.to(dev), **images}
    sync()
    t0 = time.perf_counter()
    lp = engine.logprobs(mb, temperature=1.0).logprobs
    sync()
    dt_lp = time.perf_counter() - t0
    mask = mb["response_mask"]
    mismatch = float((lp - out.rollout_logprobs.to(dev)).abs()[mask].mean())
    rows.append({"variant": "logprobs", "seconds": dt_lp, "tokens": ntok,
                 "tokens_per_s": ntok / dt_lp, "mismatch_mean": mismatch})
    adv = torch.randn(mask.shape[0], 1, device=dev).expand_as(mask).contiguous()
    loss_impl = POLICY_LOSSES["ppo_clip"]
    n = float(mask.sum())

    def loss_fn(m, logprobs, entropy):
        per_tok, _ = loss_impl(logprobs, m["old_logprobs"], m["advantages"], m["response_mask"],
                               clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
        return torch.where(m["response_mask"], per_tok, 0.0).sum() / n, {}

    mb.update(old_logprobs=lp, advantages=adv)
    sync()
    t0 = time.perf_counter()
    stats = engine.train_step(mb, loss_fn, temperature=1.0)
    sync()
    dt_step = time.perf_counter() - t0
    rows.append({"variant": "train-step", "seconds": dt_step, "tokens": ntok,
                 "tokens_per_s": ntok / dt_step, "grad_norm": stats["grad_norm"]})
    return rows


def _flowrl_vllm_child(args_dict: dict, model_dir: str, q) -> None:
    """flowrl's vLLM engine with the images: generate, the trainer's mismatch, one weight sync."""
    rows: list[dict] = []
    try:
        import torch

        from flowrl.engines.base import SamplingConfig
        from flowrl.engines.config import TrainEngineConfig
        from flowrl.engines.rollout.vllm import VLLMRolloutEngine
        from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
        from flowrl.engines.train.local import LocalTrainEngine
        from flowrl.models.loading import ModelConfig, load_model, load_tokenizer
        from flowrl.models.vision import image_processor
        from flowrl.ops.vision import cut_at_vision_tokens

        args = argparse.Namespace(**args_dict)
        cfg = ModelConfig(path=model_dir, dtype=args.train_dtype, attn_implementation="sdpa")
        tok = load_tokenizer(cfg)
        batch = prompts(args, tok, cfg).sample(args.prompts, args.n)
        images = {k: v.cuda() for k, v in batch.images().items()}
        p_ids, p_mask = batch.prompt_ids.cuda(), batch.prompt_mask.cuda()
        model = load_model(cfg, "cuda")
        seqs = args.prompts * args.n
        eng = VLLMRolloutEngine(model, tok, VLLMRolloutConfig(
            dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=4096,
            max_num_seqs=max(8, seqs), max_cudagraph_capture_size=max(8, seqs)),
            image_processor=image_processor(cfg))
        eng.generate(p_ids[:2], p_mask[:2], SamplingConfig(temperature=1.0, max_new_tokens=4),
                     images={k: v[:2] for k, v in images.items()})  # warm-up
        params = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens)
        t0 = time.perf_counter()
        out = eng.generate(p_ids, p_mask, params, generator=torch.Generator().manual_seed(0),
                           images=images)
        dt = time.perf_counter() - t0
        out = cut_at_vision_tokens(out, tok)
        trainer = LocalTrainEngine(model, TrainEngineConfig(micro_batch_size=args.micro_batch),
                                   trainable=False)
        mask = out.response_mask.cuda()
        lp = trainer.logprobs({"prompt_ids": p_ids, "prompt_mask": p_mask,
                               "response_ids": out.response_ids.cuda(), "response_mask": mask,
                               **images}, temperature=1.0).logprobs
        ntok = int(mask.sum())
        rows.append({"variant": "vllm-rollout", "seconds": dt, "tokens": ntok,
                     "tokens_per_s": ntok / dt, "mismatch_mean": float(
                         (lp - out.rollout_logprobs.cuda()).abs()[mask].mean())})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.load_weights(trainer.named_weights())
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rows.append({"variant": "vllm-weight-sync", "seconds": dt, "tokens": 0, "tokens_per_s": 0.0,
                     "gib": eng.last_load_counts["bytes"] / 2**30})
        eng.close()
    except Exception as e:  # reported in the table
        rows.append({"variant": "vllm-rollout" if not rows else "vllm-weight-sync",
                     "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
    q.put(rows)


def _vllm_child(args_dict: dict, model_dir: str, q) -> None:
    try:
        from vllm import LLM, SamplingParams

        from flowrl.data.images import open_image
        from flowrl.data.visual import VisualConfig, load_visual

        recs = load_visual("train", args_dict["prompts"], VisualConfig(
            image_size=args_dict["image_size"], train_size=max(64, args_dict["prompts"]), test_size=8))
        llm = LLM(model=model_dir, dtype="bfloat16", gpu_memory_utilization=0.5,
                  max_model_len=4096, limit_mm_per_prompt={"image": 1}, seed=0)
        tok = llm.get_tokenizer()
        reqs = []
        for r in recs:
            text = tok.apply_chat_template(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["question"]}]}],
                tokenize=False, add_generation_prompt=True)
            reqs.append({"prompt": text, "multi_modal_data": {"image": open_image(r["images"][0])}})
        sp = SamplingParams(n=args_dict["n"], temperature=1.0, max_tokens=args_dict["new_tokens"],
                            ignore_eos=True, logprobs=0)
        llm.generate(reqs[:2], SamplingParams(max_tokens=4))
        t0 = time.perf_counter()
        outs = llm.generate(reqs, sp)
        dt = time.perf_counter() - t0
        ntok = sum(len(c.token_ids) for o in outs for c in o.outputs)
        q.put([{"variant": "vllm-raw", "seconds": dt, "tokens": ntok, "tokens_per_s": ntok / dt}])
    except Exception as e:  # reported in the table: vLLM may not run this architecture here
        q.put([{"variant": "vllm-raw",
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}])


def run_child(target, variant: str, args, model_dir: Path) -> list[dict]:
    """``target``'s rows, run in a spawned process (its own CUDA context and vLLM)."""
    import queue

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(vars(args), str(model_dir), q))
    p.start()
    try:  # read before join: a child blocks on a full queue until it is read
        rows = q.get(timeout=args.child_timeout)
    except queue.Empty:
        rows = [{"variant": variant, "error": f"no result in {args.child_timeout} s "
                 f"(child {'running' if p.is_alive() else f'exit {p.exitcode}'})"}]
    p.join(30)
    if p.is_alive():
        p.kill()
    return rows


def free_device() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def step_rows(rows: list[dict]) -> list[dict]:
    """One GRPO step's time per backend: the sum of its parts' rows (absent when one failed)."""
    t = {r["variant"]: r["seconds"] for r in rows if "seconds" in r}
    out = []
    for name, parts in (("step (hf)", ("hf-rollout", "logprobs", "train-step")),
                        ("step (vllm)", ("vllm-rollout", "logprobs", "train-step",
                                         "vllm-weight-sync"))):
        if all(p in t for p in parts):
            rollout = next(r for r in rows if r["variant"] == parts[0])
            secs = sum(t[p] for p in parts)
            out.append({"variant": name, "seconds": secs, "tokens": rollout["tokens"],
                        "tokens_per_s": rollout["tokens"] / secs, "sum_of": " + ".join(parts)})
    return out


def report(rows: list[dict], args, argv: list[str]) -> str:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    try:
        import torch
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor()
    except Exception:
        gpu = "?"
    lines = ["# Vision-language RL on one GPU (Qwen2.5-VL-3B-shaped, random weights)", "",
             f"Command: `python benchmarks/vlm.py {' '.join(argv)}`  ",
             f"Commit: {commit}; machine: {gpu}; date: {datetime.date.today()}  ",
             f"Workload: {args.prompts} prompts x n={args.n}, {args.image_size}px images, "
             f"{args.new_tokens} new tokens, T=1; train dtype {args.train_dtype}, micro-batch "
             f"{args.micro_batch}, gradient checkpointing.", "",
             "| variant | seconds | response tokens | tokens/s | note |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | - | - | - | {r['error']} |")
            continue
        note = ", ".join(f"{k}={r[k]:.3g}" for k in ("mismatch_mean", "grad_norm", "gib") if k in r)
        if "sum_of" in r:
            note = f"sum of {r['sum_of']}"
        lines.append(f"| {r['variant']} | {r['seconds']:.2f} | {r['tokens']} | "
                     f"{r['tokens_per_s']:.0f} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model-dir", default="/tmp/flowrl_qwen25vl3b_random")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--train-dtype", default="bfloat16")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--with-raw", action="store_true", help="also raw vLLM from text prompts")
    ap.add_argument("--child-timeout", type=int, default=360)
    ap.add_argument("--smoke", action="store_true", help="CPU, a 2-layer model")
    ap.add_argument("--md-out", default=None)
    args = ap.parse_args(argv)
    tiny = QWEN25_VL_3B
    if args.smoke:
        tiny, args.device, args.prompts, args.n, args.new_tokens = SMOKE, "cpu", 2, 2, 8
        args.image_size, args.train_dtype, args.skip_vllm = 56, "float32", True
        args.model_dir = args.model_dir + "_smoke"
    model_dir = build_model_dir(tiny, Path(args.model_dir), args.image_size)
    free_device()
    vllm_rows: list[dict] = []
    if not args.skip_vllm:  # first, each in a child: the whole device is free for vLLM
        vllm_rows += run_child(_flowrl_vllm_child, "vllm-rollout", args, model_dir)
        if args.with_raw:
            vllm_rows += run_child(_vllm_child, "vllm-raw", args, model_dir)
    rows = run_flowrl(args, model_dir) + vllm_rows
    rows += step_rows(rows)
    md = report(rows, args, argv)
    print(md)
    print(json.dumps(rows))
    if args.md_out:
        Path(args.md_out).write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
