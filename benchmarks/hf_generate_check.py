"""flowrl's HF rollout engine against the ``transformers.generate`` call TRL makes, on one GPU.

Run (one H200, about 2-3 minutes):
    python benchmarks/hf_generate_check.py --out benchmarks/results/hf_generate_h200.md
CPU smoke (a 2-layer shape): python benchmarks/hf_generate_check.py --device cpu --rows 8 --max-new-tokens 16

Issue 24: in the e2e benchmark flowrl's HF generate took 7.51 s where TRL's took 6.88 s, the same
``transformers.generate`` underneath. Same model (the Qwen2.5-0.5B shape, bf16, random: it never
samples EOS, so every variant runs all steps), same left-padded prompts (rows x 80..200 tokens),
same sampling (T=0.7, top_p=1, top_k=0), variants interleaved (A B C D, A B C D, ...), median of
``--reps``; ms per decoding step = seconds / max_new_tokens:

- ``trl``: TRL 1.16's call: the GRPOTrainer's GenerationConfig (temperature etc. in the config,
  ``disable_compile=True``), ``torch.no_grad()``, the model in train mode (the Trainer's) under
  bf16 autocast (accelerate wraps the forward in it with ``bf16=True``);
- ``trl_eval``: the same in eval mode, without autocast;
- ``flowrl``: ``HFRolloutEngine.generate`` as the rollout stage calls it (logprob recorder,
  ``inference_mode``, its own warpers, output copied back to the host);
- ``flowrl_no_recorder``: the same with the logprob recorder a no-op (what recording costs);
- ``trl_monitored`` / ``flowrl_monitored``: ``trl`` / ``flowrl`` while a second process reads
  this one's ``psutil.memory_full_info`` every 0.25 s, as the e2e benchmark's TreeMonitor does for
  every framework process (the read walks the process's memory map under its mmap lock);
- ``flowrl_liger``: ``flowrl`` on a liger-patched copy of the model (what a GPU run's shared
  actor module is, ``model.liger_kernel=auto``); the engine decodes inside
  ``models/kernels.eager_kernels``, so transformers' own modules run;
- ``flowrl_liger_fused``: the same with liger's kernels in the decode (before 56a43ab; the
  e2e profile put 2.2 s of host time in them at 256 rows x 256 tokens);
- ``flowrl_liger_compile``: ``rollout.hf.compile=true`` (static cache, transformers' compiled
  decode) on a liger-patched copy as a training loop runs it: one update step (forward, backward,
  AdamW) on that copy before every call, untimed. The engine decodes inside ``eager_kernels``, so
  dynamo compiles transformers' own modules;
- ``flowrl_liger_compile_fused``: the same with liger's kernels inside the compiled decode (the
  engine before this variant existed). Inside the e2e loop that decode ran at eager speed (8.4k
  against 24.3k tok/s alone, ``rollout_h200.md``); suspected: a graph break at each liger call.

Each compiled variant gets a copy of its own (transformers caches the compiled call on the model)
and the table says how many graphs dynamo compiled and how many graph breaks it met in the
variant's warm-up call and in its timed calls (a recompile inside the timed calls shows there).

``--variants a,b`` runs a subset (CUDA only for the liger ones). The liger variants need
liger-kernel:
    python benchmarks/hf_generate_check.py --variants trl,flowrl_liger,flowrl_liger_fused \
        --max-new-tokens 64 --out benchmarks/results/hf_generate_liger_h100.md
    python benchmarks/hf_generate_check.py --variants trl,flowrl_liger,flowrl_liger_compile \
        --out benchmarks/results/hf_generate_compile_h200.md     # ~2 min on an H200
(one compiled variant per run: dynamo's caches would mix; hf_generate_compile_h100.md)
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, git_revision, markdown_table, text_table, utc_now, versions  # noqa: E402

QWEN05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
               intermediate_size=4864, tie_word_embeddings=True)
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default="trl,trl_eval,flowrl,flowrl_no_recorder,trl_monitored,"
                   "flowrl_monitored", help="comma-separated subset (plus flowrl_liger, "
                   "flowrl_liger_fused: CUDA and liger-kernel)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import torch
    from transformers import GenerationConfig

    import flowrl.engines.rollout.hf as hf
    from flowrl.engines.base import SamplingConfig
    from flowrl.models.loading import ModelConfig, build_tiny, load_tokenizer, tiny_model_config

    dev = torch.device(args.device)
    shape = QWEN05B if dev.type == "cuda" else SMOKE
    mc = ModelConfig(tiny={**tiny_model_config("llama"), "model_type": "qwen2", **shape})
    model = build_tiny(mc, torch.bfloat16, device=dev)
    tok = load_tokenizer(mc)
    g = torch.Generator().manual_seed(0)
    P = 200
    lens = torch.randint(80, P + 1, (args.rows,), generator=g)
    mask = torch.arange(P)[None] >= (P - lens)[:, None]
    ids = torch.where(mask, torch.randint(10, len(tok), (args.rows, P), generator=g), tok.pad_token_id)
    never = [len(tok) + 7]  # an id past the vocabulary: no row stops early in any variant
    n = args.max_new_tokens
    sampling = SamplingConfig(temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=n)
    trl_cfg = GenerationConfig(max_new_tokens=n, do_sample=True, pad_token_id=tok.pad_token_id,
                               bos_token_id=tok.bos_token_id, eos_token_id=never, temperature=0.7,
                               top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                               cache_implementation=None, disable_compile=True)
    engine = hf.HFRolloutEngine(model, tok, hf.HFRolloutConfig(batch_size=args.rows), shared=True)
    engine.eos_token_id = never[0]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def trl(train: bool, autocast: bool):
        def run():
            model.train(train)
            amp = torch.autocast(dev.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with torch.no_grad(), amp:
                model.generate(input_ids=ids.to(dev), attention_mask=mask.long().to(dev),
                               generation_config=trl_cfg)
        return run

    liger: dict[str, hf.HFRolloutEngine] = {}

    def patched_copy():
        import copy

        from flowrl.models.kernels import apply_liger_kernels

        patched = copy.deepcopy(model)
        apply_liger_kernels(patched)
        return patched

    def update_step(m, opt) -> None:
        """One training step on ``m`` as the loop's update makes between two rollouts: forward
        with grad through liger's kernels, backward, AdamW in place (untimed)."""
        m.train()
        rows = min(32, args.rows)
        batch = ids[:rows].to(dev)
        logits = m(input_ids=batch, attention_mask=mask[:rows].long().to(dev)).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                 batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()

    def flowrl_compiled(fused: bool):
        m = patched_copy() if dev.type == "cuda" else copy_of(model)
        eng = hf.HFRolloutEngine(m, tok, hf.HFRolloutConfig(batch_size=args.rows, compile=True),
                                 shared=True)
        eng.eos_token_id = never[0]
        opt = torch.optim.AdamW(m.parameters(), lr=1e-7)

        def prepare():
            update_step(m, opt)

        def run():
            orig = hf.eager_kernels
            if fused:  # liger's kernels inside the compiled decode (the engine before the change)
                hf.eager_kernels = lambda model: contextlib.nullcontext()  # type: ignore[assignment]
            try:
                eng.generate(ids, mask, sampling, generator=torch.Generator().manual_seed(1))
            finally:
                hf.eager_kernels = orig  # type: ignore[assignment]
        run.prepare = prepare  # type: ignore[attr-defined]
        return run

    def copy_of(m):
        import copy

        return copy.deepcopy(m)

    def liger_engine() -> hf.HFRolloutEngine:
        if "engine" not in liger:  # built only when a liger variant runs
            liger["engine"] = hf.HFRolloutEngine(patched_copy(), tok, hf.HFRolloutConfig(batch_size=args.rows),
                                                 shared=True)
            liger["engine"].eos_token_id = never[0]
        return liger["engine"]

    def flowrl_liger(fused: bool):
        def run():
            eng, orig = liger_engine(), hf.eager_kernels
            if fused:  # the decode as before 56a43ab: liger's kernels at every step
                hf.eager_kernels = contextlib.nullcontext  # type: ignore[assignment]
            try:
                eng.generate(ids, mask, sampling, generator=torch.Generator().manual_seed(1))
            finally:
                hf.eager_kernels = orig  # type: ignore[assignment]
        return run

    def flowrl(record: bool):
        def run():
            orig = hf._LogprobRecorder.__call__, hf._LogprobRecorder.finish
            if not record:
                hf._LogprobRecorder.__call__ = lambda self, input_ids, scores: scores  # type: ignore[method-assign]
                hf._LogprobRecorder.finish = (  # type: ignore[method-assign]
                    lambda self, seqs: torch.zeros(seqs.shape[0], n, device=seqs.device))
            try:
                engine.generate(ids, mask, sampling, generator=torch.Generator().manual_seed(1))
            finally:
                hf._LogprobRecorder.__call__, hf._LogprobRecorder.finish = orig  # type: ignore[method-assign]
        return run

    def monitored(fn):
        """fn while another process reads this one's memory_full_info every 0.25 s, as the e2e
        benchmark's TreeMonitor does (it reads /proc/<pid>/smaps*, under this process's mmap lock)."""
        def run():
            import os
            import subprocess

            code = ("import psutil, sys, time\np = psutil.Process(int(sys.argv[1]))\n"
                    "while True:\n    p.memory_full_info(); time.sleep(0.25)")
            sampler = subprocess.Popen([sys.executable, "-c", code, str(os.getpid())])
            time.sleep(2.0)  # its start-up (imports) outside the timed region
            try:
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                return time.perf_counter() - t0
            finally:
                sampler.kill()
                sampler.wait()
        return run

    every = {"trl": lambda: trl(True, dev.type == "cuda"), "trl_eval": lambda: trl(False, False),
             "flowrl": lambda: flowrl(True), "flowrl_no_recorder": lambda: flowrl(False),
             "trl_monitored": lambda: monitored(trl(True, dev.type == "cuda")),
             "flowrl_monitored": lambda: monitored(flowrl(True)),
             "flowrl_liger": lambda: flowrl_liger(False), "flowrl_liger_fused": lambda: flowrl_liger(True),
             "flowrl_liger_compile": lambda: flowrl_compiled(False),
             "flowrl_liger_compile_fused": lambda: flowrl_compiled(True)}
    names = list(dict.fromkeys(v.strip() for v in args.variants.split(",") if v.strip()))
    if unknown := [v for v in names if v not in every]:
        p.error(f"unknown variants {unknown}; known: {', '.join(every)}")
    if any(v.startswith("flowrl_liger") and "compile" not in v for v in names) \
            or (dev.type == "cuda" and any("compile" in v for v in names)):
        from flowrl.models.kernels import liger_importable

        if dev.type != "cuda" or not liger_importable():
            p.error("the flowrl_liger* variants need a CUDA device and liger-kernel "
                    "(pip install -e '.[gpu]')")
    if len([v for v in names if "compile" in v]) > 1:
        # dynamo's caches are per code object, shared by the copies: one variant's frames
        # (the fused one's per-layer graph pieces) made the other recompile per layer until
        # its limit, on the H100 (benchmarks/results/hf_generate_compile_h100.md)
        p.error("one compiled variant per run: their dynamo caches would mix (run "
                "--variants trl,flowrl_liger_compile and --variants trl,flowrl_liger_compile_fused "
                "apart)")
    if "trl" not in names:
        names.insert(0, "trl")  # the ratios' base
    variants = {k: every[k]() for k in names}
    times: dict[str, list[float]] = {k: [] for k in variants}
    # dynamo's work per variant: graphs compiled and graph breaks, in the warm-up / timed calls
    dynamo: dict[str, list[int]] = {k: [0, 0, 0, 0] for k in variants}

    def counted(name: str, slot: int, fn):
        from torch._dynamo.utils import counters

        graphs0 = counters["stats"]["unique_graphs"]
        breaks0 = sum(counters["graph_break"].values())
        out = fn()
        dynamo[name][slot] += counters["stats"]["unique_graphs"] - graphs0
        dynamo[name][slot + 2] += sum(counters["graph_break"].values()) - breaks0
        return out

    for name, fn in variants.items():  # warm-up: kernels, allocator pool, the compile
        if hasattr(fn, "prepare"):
            fn.prepare()
        if not name.endswith("_monitored"):
            t0 = time.perf_counter()
            counted(name, 0, fn)
            # as it goes: a run cut short by its time limit still says what it measured
            print(f"warm-up {name}: {time.perf_counter() - t0:.2f} s, graphs {dynamo[name][0]}, "
                  f"graph breaks {dynamo[name][2]}", flush=True)
    for rep in range(args.reps):
        for name, fn in variants.items():
            if hasattr(fn, "prepare"):
                fn.prepare()
            sync()
            t0 = time.perf_counter()
            dt = counted(name, 1, fn)
            sync()
            times[name].append(dt if dt is not None else time.perf_counter() - t0)
            print(f"rep {rep + 1} {name}: {times[name][-1]:.3f} s", flush=True)
    base = statistics.median(times["trl"])
    head = ["variant", "median s", "min–max s", "ms / step", "vs trl",
            "graphs compiled (warm-up / timed)", "graph breaks (warm-up / timed)"]
    rows = [[k, f"{statistics.median(v):.3f}", f"{min(v):.3f}–{max(v):.3f}",
             f"{1e3 * statistics.median(v) / n:.2f}", f"{statistics.median(v) / base:.3f}×",
             f"{dynamo[k][0]} / {dynamo[k][1]}", f"{dynamo[k][2]} / {dynamo[k][3]}"]
            for k, v in times.items()]
    print(text_table(head, rows))
    if args.out:
        args.out.write_text("\n".join([
            "# flowrl's HF rollout engine vs TRL's transformers.generate call", "",
            "Produced by `benchmarks/hf_generate_check.py` (see its docstring).", "",
            f"- command: `{command_line()}`", f"- date: {utc_now()}; flowrl commit {git_revision()}",
            f"- device: {torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}; "
            + ", ".join(f"{k} {x}" for k, x in versions(["torch", "transformers"]).items()),
            f"- {args.rows} rows, prompts 80-200 tokens, {n} new tokens, {args.reps} interleaved reps", "",
            markdown_table(head, rows), ""]))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
