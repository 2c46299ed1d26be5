"""Rollout throughput of flowrl's HF engine, of raw ``vllm.LLM`` and of flowrl's own vLLM engines
(in process, and N engine processes per GPU) on a Qwen2.5-0.5B-shaped model, plus the colocated
switch cost (sleep + wake + weight load).

    python benchmarks/rollout.py --variants hf-dynamic,hf-static,vllm-default,vllm-tuned \\
        --batches 256,2048 --json-out r.json
    python benchmarks/rollout.py --report r.json [more.json ...] --md-out benchmarks/results/rollout_h200.md

Model: random weights, transformers ``Qwen2Config`` (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings; 494M parameters) in bf16, saved once to
``--model-dir`` so that both engines load the same checkpoint. Workload: ``B`` random 128-token
prompts, temperature 1, ``--new-tokens`` (256) new tokens each, the sampled token's logprob recorded
per token (what flowrl's trainer needs). Every response runs the full length: vLLM gets
``ignore_eos=True``; the HF engine always stops at EOS, which a random model samples with
probability ~1/151936 per token, and ``generate`` keeps decoding the batch until its last row ends,
so its time is that of B × 256 tokens either way (tokens counted are the ones returned).

Each variant runs in its own child process (clean GPU memory, isolated failures); a variant
measures every batch size after one short warm-up generate at that size (full length for compiled
HF, whose static cache shape is part of the compiled graph). Reported: response tokens / wall
seconds of ``generate`` up to (B, R) logprob tensors on the host.

vLLM settings (``VLLM_VARIANTS``) and sampling options (``SAMPLING``) are an ablation; ``--gc-freeze``
runs vLLM's ``generate`` with Python's GC frozen and off; ``--switch`` adds the colocated switch cost
(in-process engine only) to a vLLM variant. Results and their reading: benchmarks/results/rollout_h200.md.
``--smoke`` runs a 2-layer model on CPU (numbers meaningless; the CPU tests of this script use it;
head size 32, which vLLM-CPU needs).

flowrl's engines (``FLOWRL_VARIANTS``, benchmarks/_rollout_flowrl.py): ``flowrl-vllm`` =
``VLLMRolloutEngine`` (flowrl's defaults + max_model_len P + R, bf16, KV cache 1.5x the largest
batch's tokens = 13.5 GiB at B=2048), ``flowrl-vllm-procs{2,4,8}`` = ``VLLMProcessEngine`` with the
same totals split over 2/4/8 engine processes on the GPU. Tokens/s = ``response_mask.sum()`` / wall
seconds of one warm ``engine.generate`` (rows may stop at EOS: see the mean-length column);
``--flowrl-rng seeded,unseeded`` times it with a ``torch.Generator`` (what flowrl's rollout op passes)
and without. ``--switch`` times sleep/wake/load_weights through the engine API (procs: the weights go
to every engine by CUDA IPC). The H200 run (vLLM under /tmp/vsite; one call):

    PYTHONPATH=/tmp/vsite:$PYTHONPATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 timeout 470 python3 \
        benchmarks/rollout.py --variants flowrl-vllm,flowrl-vllm-procs4,flowrl-vllm-procs2 \
        --batches 2048 --flowrl-rng seeded,unseeded --switch --child-timeout 200 \
        --json-out $OUT/6_flowrl_engines.json 2>&1 | tee $OUT/6_flowrl_engines.log

Expected 6-8 min: per variant ~30 s to start its process, build the model and export it, the engine
start (rollout_h200 init_s: ~50 s with CUDA graphs up to 2048, ~150 s for the first engine of a
machine, whose torch.compile cache is cold; procs engines start side by side), ~13-20 s per timed
generate, ~15 s of switch cycles. The JSON is rewritten after each variant, so ``timeout`` keeps every
finished one (procs2, the least telling, runs last). Then, here:
``--report benchmarks/results/rollout_h200/*.json --notes benchmarks/results/rollout_h200/notes.md
--md-out benchmarks/results/rollout_h200.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    command_line,
    git_revision,
    machine_info,
    text_table,
    utc_now,
    versions,
)
from benchmarks._rollout_flowrl import FLOWRL_ENV, FLOWRL_VARIANTS, RNG, run_flowrl  # noqa: E402
from benchmarks._rollout_report import floor_tokens_per_s, report  # noqa: E402,F401 (API)

EOS = 151643

HF_VARIANTS = {  # name -> HFRolloutConfig fields (batch_size is always B: one generate call)
    "hf-dynamic": dict(cache_implementation="dynamic"),
    "hf-static": dict(cache_implementation="static"),
    "hf-static-compile": dict(cache_implementation="static", compile=True),
}
# Settings every vLLM variant shares: what flowrl needs (bf16, token ids in/out, sleep mode for the
# colocated switch, the sampler without the checkpoint's generation_config overrides).
VLLM_BASE = dict(dtype="bfloat16", seed=0, skip_tokenizer_init=True, generation_config="vllm",
                 enable_sleep_mode=True)
_TUNED = dict(max_num_seqs=2048, max_cudagraph_capture_size=2048, max_num_batched_tokens=32768)
VLLM_VARIANTS = {  # name -> (extra LLM kwargs, extra environment)
    "vllm-default": ({}, {}),  # on an H200: max_num_seqs 1024, batched tokens 16384, graphs <= 512
    "vllm-seqs2048": (dict(max_num_seqs=2048), {}),  # concurrency alone, graphs still <= 512
    "vllm-graphs1024": (dict(max_cudagraph_capture_size=1024), {}),  # graphs cover 1024 seqs
    "vllm-tuned": (_TUNED, {}),
    "vllm-tuned-noasync": ({**_TUNED, "async_scheduling": False}, {}),
    "vllm-tuned-noprefix": ({**_TUNED, "enable_prefix_caching": False}, {}),
    "vllm-tuned-throughput": ({**_TUNED, "performance_mode": "throughput"}, {}),
    "vllm-tuned-mp": (_TUNED, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),  # engine core in a 2nd process
}
SAMPLING = {  # name -> SamplingParams fields beyond temperature/max_tokens/ignore_eos/detokenize
    "lp": dict(logprobs=0),                        # per-token dict[int, Logprob] objects
    "lp-flat": dict(logprobs=0, flat_logprobs=True),  # flat primitive lists (FlatLogprobs)
    "nolp": dict(logprobs=None),                   # no logprobs: the cost of having them
}


def build_model(smoke: bool, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    shape = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936)
    if smoke:
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,  # head size 32
                     num_key_value_heads=1, intermediate_size=128, vocab_size=1024)
    cfg = transformers.Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=4096,
                                   eos_token_id=EOS if not smoke else 1, bos_token_id=None)
    return transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def prompts_for(B: int, P: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(B)
    return torch.randint(0, min(vocab, 151000), (B, P), generator=g)


# ---------------------------------------------------------------------------------------- workers
def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_hf(args, variant: str) -> list[dict]:
    import torch
    import transformers

    from flowrl.engines.base import SamplingConfig
    from flowrl.engines.config import HFRolloutConfig
    from flowrl.engines.rollout.hf import HFRolloutEngine

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.Qwen2ForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).to(dev)
    tok = type("Tok", (), {"eos_token_id": model.config.eos_token_id,
                           "pad_token_id": model.config.eos_token_id})()
    rows = []
    for B in args.batches:
        eng = HFRolloutEngine(model, tok, HFRolloutConfig(batch_size=B, **HF_VARIANTS[variant]))
        ids = prompts_for(B, args.prompt_len, model.config.vocab_size)
        mask = torch.ones_like(ids, dtype=torch.bool)
        warm = args.new_tokens if eng.cfg.compile else min(8, args.new_tokens)
        eng.generate(ids, mask, SamplingConfig(max_new_tokens=warm), torch.Generator().manual_seed(1))
        _sync()
        t0 = time.perf_counter()
        out = eng.generate(ids, mask, SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens),
                           torch.Generator().manual_seed(0))
        _sync()
        dt = time.perf_counter() - t0
        n = int(out.response_mask.sum())
        assert torch.isfinite(out.rollout_logprobs).all()
        rows.append(dict(variant=variant, batch=B, sampling="lp", tokens=n, seconds=dt,
                         tokens_per_s=n / dt, settings=HF_VARIANTS[variant]))
        print(f"{variant} B={B}: {n / dt:,.0f} tok/s ({dt:.2f} s)", flush=True)
    return rows


def _vllm_logprobs(o, flat: bool) -> list[float]:
    if flat:  # logprobs=0: one entry (the sampled token) per position
        return list(o.logprobs.logprobs)
    return [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]


def run_vllm(args, variant: str) -> list[dict]:
    import torch
    from vllm import LLM, SamplingParams

    extra, _ = VLLM_VARIANTS[variant]
    P, R = args.prompt_len, args.new_tokens
    t0 = time.perf_counter()
    llm = LLM(model=args.model_dir, max_model_len=P + R, **VLLM_BASE, **extra)
    init_s = time.perf_counter() - t0
    sched = llm.llm_engine.vllm_config.scheduler_config
    comp = llm.llm_engine.vllm_config.compilation_config
    effective = dict(max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                     async_scheduling=sched.async_scheduling,
                     max_cudagraph_capture_size=comp.max_cudagraph_capture_size, init_s=round(init_s, 1))
    print(f"{variant}: init {init_s:.1f} s, effective {effective}", flush=True)
    rows = []
    for B in args.batches:
        prompts = [{"prompt_token_ids": p} for p in prompts_for(B, P, 151936).tolist()]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
        for s in args.sampling:
            sp = SamplingParams(temperature=1.0, max_tokens=R, ignore_eos=True, detokenize=False,
                                **SAMPLING[s])
            _sync()
            t0 = time.perf_counter()
            with _gc_frozen(args.gc_freeze):
                outs = llm.generate(prompts, sp, use_tqdm=False)
            ids = torch.tensor([o.outputs[0].token_ids for o in outs])
            lps = (torch.tensor([_vllm_logprobs(o.outputs[0], "flat" in s) for o in outs])
                   if SAMPLING[s]["logprobs"] is not None else None)
            dt = time.perf_counter() - t0
            n = ids.numel()
            assert ids.shape == (B, R) and (lps is None or bool(torch.isfinite(lps).all()))
            rows.append(dict(variant=variant, batch=B, sampling=s + ("+gc-freeze" if args.gc_freeze else ""),
                             tokens=n, seconds=dt,
                             tokens_per_s=n / dt, settings={**extra, **VLLM_VARIANTS[variant][1]},
                             effective=effective))
            print(f"{variant} B={B} {s}: {n / dt:,.0f} tok/s ({dt:.2f} s)", flush=True)
    if args.switch and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        rows.append(switch_cost(args, llm))  # in-place load needs the model in this process
    return rows


@contextlib.contextmanager
def _gc_frozen(on: bool):
    """Python's cyclic GC off during generate: every engine step allocates per-request objects, and
    with ~10^6 live ones (outputs, logprob lists) each gen-2 collection walks them all."""
    if not on:
        yield
        return
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def switch_cost(args, llm) -> dict:
    """sleep + wake + in-place load of a training-side module's full (gathered) bf16 tensors."""
    from vllm import SamplingParams

    train_side = build_model(False, seed=1).cuda()  # different weights: the load must show
    engine = llm.llm_engine
    executor = getattr(engine, "model_executor", None) or engine.engine_core.engine_core.model_executor
    runner = executor.driver_worker.worker.model_runner
    times: dict[str, list[float]] = {}

    def timed(key, fn):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.setdefault(key, []).append(time.perf_counter() - t0)

    def load():
        runner.model.load_weights(train_side.named_parameters())
        llm.reset_prefix_cache()

    for _ in range(3):  # level 1: weights kept in pinned CPU memory, KV cache dropped
        timed("sleep1_s", lambda: llm.sleep(level=1))
        timed("wake1_s", lambda: llm.wake_up())
        timed("load_s", load)
    for _ in range(3):  # level 2: weights dropped too (they are replaced anyway)
        timed("sleep2_s", lambda: llm.sleep(level=2))
        timed("wake2_weights_s", lambda: llm.wake_up(tags=["weights"]))
        timed("load2_s", load)
        timed("wake2_kv_s", lambda: llm.wake_up(tags=["kv_cache"]))
    emb = runner.model.model.embed_tokens.weight
    diff = float((emb - train_side.model.embed_tokens.weight.detach()).abs().max())
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts_for(256, args.prompt_len, 151936).tolist()],
                        SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False, logprobs=0,
                                       flat_logprobs=True), use_tqdm=False)
    ok = all(len(o.outputs[0].token_ids) == 16 for o in outs)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"switch: {med} load max|diff| {diff} generate-after-switch ok {ok}", flush=True)
    return dict(variant="switch", batch=0, sampling="", tokens=0, seconds=0.0, tokens_per_s=0.0,
                switch=med, all_times=times, load_max_abs_diff=diff, generate_after_switch_ok=ok,
                weight_gb=sum(p.numel() * 2 for p in train_side.parameters()) / 1e9)


# ---------------------------------------------------------------------------------------- driver
def worker_main(args) -> None:
    if args.worker in FLOWRL_VARIANTS:
        rows = run_flowrl(args, args.worker, build_model, prompts_for, _sync)
    else:
        rows = run_hf(args, args.worker) if args.worker in HF_VARIANTS else run_vllm(args, args.worker)
    Path(args.worker_out).write_text(json.dumps(rows))


def run_variants(args) -> dict:
    """Every variant in its own child process (or here with ``--in-process``); the result JSON is
    rewritten after each variant, so an outer ``timeout`` keeps the variants that finished."""
    import torch
    import transformers

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        build_model(args.smoke).save_pretrained(model_dir)
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build_model(args.smoke).parameters())
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)"
    result = dict(command=command_line([__file__, *args.argv]), date=utc_now(), git=git_revision(),
                  machine=machine_info(), gpu=gpu, versions=versions(["torch", "transformers", "vllm"] + ["vllm-cpu"] * args.smoke),
                  prompt_len=args.prompt_len, new_tokens=args.new_tokens, n_params=n_params, rows=[],
                  errors={}, floor={str(B): floor_tokens_per_s(B, args.prompt_len, args.new_tokens,
                                                               n_params, cfg) for B in args.batches})
    for v in args.variants:
        out = Path(args.model_dir) / f"_rows_{v}.json"
        out.unlink(missing_ok=True)
        if args.in_process:
            worker_main(argparse.Namespace(**{**vars(args), "worker": v, "worker_out": str(out)}))
            rc = 0
        else:
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                   **VLLM_VARIANTS.get(v, ({}, {}))[1], **FLOWRL_ENV.get(v, {})}
            cmd = [sys.executable, __file__, "--worker", v, "--worker-out", str(out), *args.argv]
            try:
                rc = subprocess.run(cmd, env=env, timeout=args.child_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if out.exists():
            result["rows"] += json.loads(out.read_text())
        else:
            result["errors"][v] = f"child exit {rc}"
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default="hf-dynamic,hf-static,vllm-default,vllm-tuned",
                   type=lambda s: s.split(","),
                   help=f"of {list(HF_VARIANTS) + list(VLLM_VARIANTS) + list(FLOWRL_VARIANTS)}")
    p.add_argument("--batches", default="256,2048", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--sampling", default="lp", type=lambda s: s.split(","), help=f"of {list(SAMPLING)} (vLLM)")
    p.add_argument("--flowrl-rng", default="seeded", type=lambda s: s.split(","),
                   help=f"of {list(RNG)} (flowrl variants: generate with a torch.Generator or None)")
    p.add_argument("--flowrl-logprobs", default="all", type=lambda s: s.split(","),
                   help="of all,none (flowrl variants: the generate call's SamplingConfig.logprobs)")
    p.add_argument("--rounds", type=int, default=1,
                   help="flowrl variants: interleaved rounds over the rng x logprobs modes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--switch", action="store_true",
                   help="measure the switch cost in each vLLM / flowrl variant")
    p.add_argument("--gc-freeze", action="store_true", help="vLLM generate with Python's GC frozen+off")
    p.add_argument("--model-dir", default="/tmp/flowrl_bench_qwen05b")
    p.add_argument("--smoke", action="store_true", help="2-layer model (CPU check of the script)")
    p.add_argument("--in-process", action="store_true", help="run variants in this process")
    p.add_argument("--child-timeout", type=float, default=480)
    p.add_argument("--json-out", default=None)
    p.add_argument("--report", nargs="+", default=None, help="result JSONs -> markdown")
    p.add_argument("--md-out", default=None)
    p.add_argument("--notes", default=None, help="markdown file appended to the report")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    known = {**HF_VARIANTS, **VLLM_VARIANTS, **FLOWRL_VARIANTS}
    unknown = [v for v in args.variants if v not in known]
    bad_s = ([s for s in args.sampling if s not in SAMPLING] + [r for r in args.flowrl_rng if r not in RNG]
             + [m for m in args.flowrl_logprobs if m not in ("all", "none")])
    if unknown or bad_s:
        p.error(f"unknown variants {unknown} / sampling or flowrl-rng {bad_s}")
    if args.worker:
        return worker_main(args)
    if args.report:
        results = [json.loads(Path(f).read_text()) for f in args.report]
    else:
        results = [run_variants(args)]
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results[0], indent=1))
    rows = [r for res in results for r in res["rows"] if "switch" not in r]
    print(text_table(["variant", "sampling", "B", "tok/s", "s"],
                     [[r["variant"], r["sampling"], r["batch"], f"{r['tokens_per_s']:,.0f}",
                       f"{r['seconds']:.2f}"] for r in rows]))
    if args.md_out:
        notes = Path(args.notes).read_text() if args.notes else ""
        Path(args.md_out).write_text(report(results, notes, command_line([__file__, *args.argv]) if args.report else ""))


if __name__ == "__main__":
    main()
