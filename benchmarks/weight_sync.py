"""Where the time of a weight sync into vLLM engine processes goes, whether the parent's exported
copies are freed after it, and what a garbage collection in the engines after each load changes.

A colocated GPU run with ``rollout=vllm`` loads the actor's weights into every engine process
after each update (``VLLMProcessEngine.load_weights``: CUDA IPC handles in buckets, vLLM's
in-place ``reload_weights`` in each engine, then ``torch.cuda.ipc_collect()`` in the parent, which
frees the exported blocks the engines no longer reference). This times ``--loads`` loads of the
same model per variant and tracks the parent's device memory across them (exported copies that
are never freed show as growth per load).
``--source copy`` (the default) sends fresh tensors each load and drops them after it, as an FSDP
actor's bucketed gather does (then ``ipc_collect`` has exported blocks to release);
``--source params`` sends the model's own parameters (nothing is freed after the load):

- ``none``: the shipped code (references are left to reference counting);
- ``full``: ``gc.collect()`` in each engine after each load (the code from e1c7d4b to 6a3da43);
- ``young``: ``gc.collect(1)`` there (generations 0 and 1 only).

Run (GPU machine, vLLM installed)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/weight_sync.py --variants none,full

Writes ``benchmarks/results/weight_sync_h200.md`` (``--out``).

``--paths reload,direct`` (the load paths of ``rollout.vllm.weight_load``) instead starts one
``VLLMProcessEngine`` of ``--procs`` engines per path on the same model and syncs them in
``--rounds`` interleaved rounds (path order alternating each round, so drift of the machine hits
both alike), fresh tensors each sync as an FSDP gather sends. Per sync: the parent's wall time
(the whole ``load_weights``: handles, the engines' loads, replies, ``ipc_collect``), the slowest
engine's ``load_weights_s`` (its vLLM load plus prefix-cache reset), and the rest (IPC handle
exchange and pipe round trips). After every sync one unfused parameter per layer kind is read back
from the engines and must equal what was sent (bf16: exactly), so a fast path that loads nothing
fails loudly. ``--shape`` picks the model shape (qwen05b: Qwen2.5-0.5B's, smollm135m:
SmolLM2-135M's). GPU (<= 3 min on an H200: two sets of 4 engines start side by side)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/weight_sync.py --paths reload,direct \
        --rounds 8 --out /root/out/weight_sync_paths.md

CPU (vLLM-CPU repacks its GEMM weights, so "direct" is refused there unless ``--cpu-plain-gemm``
swaps vLLM-CPU's GEMM dispatch for its plain ``F.linear`` fallback; timings only indicative)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/weight_sync.py --paths reload,direct \
        --cpu-plain-gemm --in-process --shape smollm135m --rounds 4 --out /tmp/ws.md
"""
from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._common import (  # noqa: E402
    command_line,
    git_revision,
    machine_info,
    markdown_table,
    text_table,
    utc_now,
    versions,
)

# Qwen2.5-0.5B's shape with the SmolLM2 vocabulary (benchmarks/e2e_vs_trl.py's qwen05b)
QWEN05B = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
               num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True)
# SmolLM2-135M's shape (llama)
SMOLLM135M = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True)
SHAPES = {"qwen05b": QWEN05B, "smollm135m": SMOLLM135M}
# parameters read back after each sync: unfused in vLLM (HF name and layout kept)
READBACK = ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.norm.weight", "model.embed_tokens.weight")


def serve_variant(conn, exported, cfg, env, variant: str = "none") -> None:
    """``vllm_proc._serve`` with a timed collection after each load for ``full``/``young``
    (reported as the engine's ``collect_s``)."""
    import flowrl.engines.rollout.vllm_proc as vp

    if variant != "none":
        from flowrl.engines.rollout.vllm import VLLMRolloutEngine

        load = VLLMRolloutEngine.load_weights

        def load_then_collect(self, named_tensors):
            load(self, named_tensors)
            t0 = time.perf_counter()
            gc.collect(1 if variant == "young" else 2)
            self.last_timings["collect_s"] = time.perf_counter() - t0

        VLLMRolloutEngine.load_weights = load_then_collect  # type: ignore[method-assign]
    vp._serve(conn, exported, cfg, env)


def run_variant(variant: str, procs: int, loads: int, source: str) -> list[dict[str, float]]:
    import torch

    import flowrl.engines.rollout.vllm_proc as vp
    from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
    from flowrl.models.loading import ModelConfig, load_model, load_tokenizer

    mcfg = ModelConfig(tiny=dict(QWEN05B), dtype="bfloat16")
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg).cuda()
    real = vp._serve
    vp._serve = functools.partial(serve_variant, variant=variant)  # the engines' process target
    try:
        eng = vp.VLLMProcessEngine(model, tok, VLLMRolloutConfig(
            engine_procs=procs, kv_cache_memory_gb=2.0, max_model_len=512,
            gpu_memory_utilization=0.3, enforce_eager=True), procs=procs)
    finally:
        vp._serve = real
    rows = []
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for i in range(loads):
            with torch.no_grad():  # a new version each time, as after an update
                for p in model.parameters():
                    p.add_(1e-3)
            t0 = time.perf_counter()
            if source == "copy":  # fresh full tensors, dropped after the load (a gather's)
                eng.load_weights((n, p.detach().clone()) for n, p in model.named_parameters())
            else:
                eng.load_weights((n, p.detach()) for n, p in model.named_parameters())
            wall = time.perf_counter() - t0
            torch.cuda.synchronize()
            t = eng.last_timings
            rows.append({"load": i + 1, "wall_s": wall,
                         "engine_reload_s": t.get("engine_load_weights_s", float("nan")),
                         "engine_gc_s": t.get("engine_collect_s", 0.0),
                         "ipc_collect_s": t.get("ipc_collect_s", float("nan")),
                         "parent_extra_gib": (torch.cuda.memory_allocated() - base) / 2**30,
                         "device_used_gib": (torch.cuda.mem_get_info()[1]
                                             - torch.cuda.mem_get_info()[0]) / 2**30})
    finally:
        eng.close()
        del model
        torch.cuda.empty_cache()
    return rows


def _plain_cpu_gemm() -> None:
    """vLLM-CPU: keep linear weights unpacked (vLLM's own ``F.linear`` fallback), as on CUDA."""
    import torch
    import vllm.model_executor.layers.utils as vutils

    def plain(layer, remove_weight):
        layer.cpu_linear = torch.nn.functional.linear

    vutils.dispatch_cpu_unquantized_gemm = plain


def _serve_plain_gemm(conn, exported, cfg, env) -> None:
    """An engine process's main loop with :func:`_plain_cpu_gemm` applied first (spawned)."""
    import flowrl.engines.rollout.vllm_proc as vp

    _plain_cpu_gemm()
    vp._serve(conn, exported, cfg, env)


def run_paths(paths: list[str], procs: int, rounds: int, shape: str, in_process: bool,
              plain_gemm: bool) -> tuple[list[dict], dict[str, str]]:
    """Interleaved syncs into one engine (set) per load path; returns (rows, resolved paths)."""
    import torch

    import flowrl.engines.rollout.vllm_proc as vp
    from flowrl.engines.rollout.vllm import VLLMRolloutEngine
    from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
    from flowrl.models.loading import ModelConfig, load_model, load_tokenizer

    cuda = torch.cuda.is_available()
    mcfg = ModelConfig(tiny=dict(SHAPES[shape]), dtype="bfloat16")
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg)
    if cuda:
        model = model.cuda()
    if plain_gemm:
        _plain_cpu_gemm()
    engines: dict[str, Any] = {}
    real = vp._serve
    if plain_gemm:
        vp._serve = _serve_plain_gemm
    try:
        for path in paths:
            cfg = VLLMRolloutConfig(engine_procs=procs, kv_cache_memory_gb=2.0 if cuda else 0.25,
                                    max_model_len=512, max_num_seqs=64,
                                    gpu_memory_utilization=0.3, enforce_eager=True,
                                    weight_load=path)
            engines[path] = (VLLMRolloutEngine(model, tok, cfg) if in_process
                             else vp.VLLMProcessEngine(model, tok, cfg, procs=procs))
    finally:
        vp._serve = real
    resolved = {p: e.weight_load_path for p, e in engines.items()}
    rows: list[dict] = []
    index = {n: torch.arange(0, dict(model.named_parameters())[n].numel(), 997)
             for n in READBACK if n in dict(model.named_parameters())}
    try:
        for r in range(rounds):
            with torch.no_grad():  # a new version each round, as after an update
                for p in model.parameters():
                    p.add_(1e-2 * torch.randn_like(p))
            order = paths if r % 2 == 0 else paths[::-1]
            for path in order:
                eng = engines[path]
                named = {n: p for n, p in model.named_parameters()}
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                # fresh full tensors, dropped after the load (a gather's)
                eng.load_weights((n, p.detach().clone()) for n, p in named.items())
                wall = time.perf_counter() - t0
                t = eng.last_timings
                engine_s = t.get("engine_load_weights_s", t.get("load_weights_s", float("nan")))
                got = eng.weight_samples(index)
                for n, idx in index.items():
                    want = named[n].detach().reshape(-1)[idx.to(named[n].device)].cpu()
                    if n in got and not torch.equal(got[n], want):
                        raise AssertionError(f"{path}: {n} read back differs from what was sent "
                                             f"(max |d| {float((got[n] - want).abs().max()):.3g})")
                rows.append({"round": r + 1, "path": path, "wall_s": wall, "engine_s": engine_s,
                             "other_s": wall - engine_s, "checked": len(got)})
    finally:
        for e in engines.values():
            e.close()
    return rows, resolved


def main_paths(args) -> None:
    import torch

    paths = args.paths.split(",")
    rows, resolved = run_paths(paths, args.procs, args.rounds, args.shape, args.in_process,
                               args.cpu_plain_gemm)
    headers = ["path (asked -> resolved)", "syncs timed", "sync wall s (median)",
               "slowest engine load s", "handles + round trips s", "min / max wall s",
               "params read back / sync"]
    table = []
    for p in paths:
        mine = [r for r in rows if r["path"] == p]
        timed = mine[1:] or mine  # the first sync warms the path
        table.append([f"{p} -> {resolved[p]}", len(timed), f"{_median(timed, 'wall_s'):.4f}",
                      f"{_median(timed, 'engine_s'):.4f}", f"{_median(timed, 'other_s'):.4f}",
                      f"{min(r['wall_s'] for r in timed):.4f} / "
                      f"{max(r['wall_s'] for r in timed):.4f}", mine[0]["checked"]])
    print(text_table(headers, table))
    mach = machine_info()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (indicative only)"
    where = "in process" if args.in_process else f"{args.procs} engine processes"
    md = [f"# Weight sync per load path ({args.shape} shape, bf16, {where})", "",
          "Produced by `benchmarks/weight_sync.py --paths` (see its docstring).", "",
          f"- command: `{command_line()}`",
          f"- date: {utc_now()}; flowrl commit {git_revision()}",
          f"- machine: {dev}; {mach['cpu']}, {mach['logical_cpus']} logical CPUs, {mach['memory']}",
          f"- versions: {', '.join(f'{k} {v}' for k, v in versions(['torch', 'vllm']).items())}",
          "", "Medians over the syncs after each path's first, rounds interleaved:", "",
          markdown_table(headers, table), "", "Every sync:", "",
          markdown_table(["round", "path", "wall s", "engine load s", "other s"],
                         [[r["round"], r["path"], f"{r['wall_s']:.4f}", f"{r['engine_s']:.4f}",
                           f"{r['other_s']:.4f}"] for r in rows]), ""]
    args.out.write_text("\n".join(md))
    print(f"wrote {args.out}")


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="none,full")
    ap.add_argument("--procs", type=int, default=4, help="engine processes (the e2e run's 4)")
    ap.add_argument("--loads", type=int, default=6)
    ap.add_argument("--source", choices=("copy", "params"), default="copy")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/weight_sync_h200.md")
    ap.add_argument("--paths", default=None,
                    help="compare load paths instead, e.g. reload,direct (see the docstring)")
    ap.add_argument("--rounds", type=int, default=8, help="--paths: interleaved rounds")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen05b")
    ap.add_argument("--in-process", action="store_true",
                    help="--paths: one in-process engine per path (no engine processes)")
    ap.add_argument("--cpu-plain-gemm", action="store_true",
                    help="--paths on vLLM-CPU: keep linear weights unpacked so direct can run")
    args = ap.parse_args()
    if args.paths:
        main_paths(args)
        return
    import torch

    headers = ["variant", "loads timed", "load wall s", "engine reload s", "engine gc s",
               "parent ipc_collect s", "parent extra GiB after first / last load",
               "device used GiB first / last"]
    table, detail = [], []
    for v in args.variants.split(","):
        rows = run_variant(v, args.procs, args.loads, args.source)
        timed = rows[1:] or rows  # the first load warms vLLM's reload path
        med = functools.partial(_median, timed)
        table.append([v, len(timed), f"{med('wall_s'):.3f}", f"{med('engine_reload_s'):.3f}",
                      f"{med('engine_gc_s'):.3f}", f"{med('ipc_collect_s'):.3f}",
                      f"{rows[0]['parent_extra_gib']:.2f} / {rows[-1]['parent_extra_gib']:.2f}",
                      f"{rows[0]['device_used_gib']:.1f} / {rows[-1]['device_used_gib']:.1f}"])
        detail += [[v, r["load"], f"{r['wall_s']:.3f}", f"{r['engine_reload_s']:.3f}",
                    f"{r['engine_gc_s']:.3f}", f"{r['ipc_collect_s']:.3f}",
                    f"{r['parent_extra_gib']:.2f}", f"{r['device_used_gib']:.1f}"] for r in rows]
    print(text_table(headers, table))
    mach = machine_info()
    gpu = torch.cuda.get_device_name()
    md = [f"# Weight sync into {args.procs} vLLM engine processes (Qwen2.5-0.5B shape, bf16)", "",
          "Produced by `benchmarks/weight_sync.py` (see its docstring for the variants).", "",
          f"- command: `{command_line()}`",
          f"- date: {utc_now()}; flowrl commit {git_revision()}",
          f"- machine: {gpu}; {mach['cpu']}, {mach['logical_cpus']} logical CPUs, {mach['memory']}",
          f"- versions: {', '.join(f'{k} {v}' for k, v in versions(['torch', 'vllm']).items())}",
          f"- source: `{args.source}`", "",
          "Medians over the loads after the first (its reload warms vLLM's path):", "",
          markdown_table(headers, table), "", "Every load:", "",
          markdown_table(["variant", "load", "wall s", "engine reload s", "engine gc s",
                          "ipc_collect s", "parent extra GiB", "device used GiB"], detail), ""]
    args.out.write_text("\n".join(md))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
