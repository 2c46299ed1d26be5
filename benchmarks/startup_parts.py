"""Seconds of three parts of ``flowrl train``'s start-up, measured apart (issue 24).

    python benchmarks/startup_parts.py data            # the "setup: data" phase: tokenizer + PromptSource
    python benchmarks/startup_parts.py export-key      # hashing a SmolLM2-135M-shaped policy for its vLLM export
    python benchmarks/startup_parts.py overlap {import,setup,both}   # import vllm in a thread vs set-up work

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
        thread = threading.Thread(target=lambda: __import__("vllm"), daemon=True)
        thread.start()
    if mode in ("setup", "both"):
        tok = load_tokenizer(ModelConfig())
        PromptSource(DataConfig(name="arith"), tok).sample(8, 8)
        _smollm2_shaped()
    setup_s = time.perf_counter() - t0
    if thread is not None:
        thread.join()
    print(f"overlap {mode}: set-up {setup_s:.2f} s, all done {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "data"
    if what == "data":
        data()
    elif what == "export-key":
        export_key_time()
    elif what == "overlap" and len(sys.argv) > 2 and sys.argv[2] in ("import", "setup", "both"):
        overlap(sys.argv[2])
    else:
        sys.exit("usage: startup_parts.py data | export-key | overlap {import,setup,both}")
