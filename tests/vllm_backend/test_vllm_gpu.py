"""Opt-in CUDA checks of the vLLM engine (``pytest -m "vllm and gpu"`` where ``vllm`` and a GPU
exist): real sleep levels and bf16 logprob agreement. Skipped without CUDA.

bf16 tolerance: the rollout (vLLM, bf16) and the trainer recomputation (HF, bf16) round every
matmul/softmax input to an 8-bit mantissa (~4e-3 relative). ``initializer_range=0.5`` gives the
random model peaked distributions with logits of tens of nats (a stale policy is off by ~33 nats
per token), so a weight change moves logprobs by O(10) and not only by noise, and the rounding is
~4e-3 x tens of nats: measured on an H200 (2026-11-29) a mean |Δ| of 0.094 (in-process) and 0.111
(two engine processes) nats against 32.6 / 33.6 stale. Held to: mean < 0.25 and stale > 50x fresh
(fp32 on CPU: max 1e-4, tests/vllm_backend/test_vllm_engine.py).
"""
import pytest
import torch
from vllm_helpers import in_fresh_process, mean_mismatch, trainer_logprobs

from flowrl.engines.base import SamplingConfig
from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.models.loading import ModelConfig, load_model, load_tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TINY = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 512, "initializer_range": 0.5}
MEAN_TOL = 0.25


@pytest.mark.parametrize("weight_load", ["auto", "reload"])
def test_bf16_sleep_levels_and_weight_load_on_cuda(weight_load):
    # one sleep-mode engine per process (vLLM's CuMem allocator): each parameter in its own
    in_fresh_process(_sleep_levels_and_weight_load, weight_load)


def _sleep_levels_and_weight_load(weight_load):
    from flowrl.engines.rollout.vllm import VLLMRolloutEngine
    from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig

    mcfg = ModelConfig(tiny=TINY, dtype="bfloat16")
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg).cuda()
    eng = VLLMRolloutEngine(model, tok, VLLMRolloutConfig(kv_cache_memory_gb=1.0, max_model_len=256,
                                                          gpu_memory_utilization=0.3,
                                                          weight_load=weight_load))
    try:
        assert eng.sleep_supported
        # unquantized CUDA layers keep their loaded layout: auto is the direct load (the rule
        # before direct_load_blocker refused it for the RMSNorm weights, which never had a loader)
        assert eng.weight_load_path == ("direct" if weight_load == "auto" else "reload")
        enc = tok(["Hello world", "What is 2+2?"], return_tensors="pt", padding=True,
                  padding_side="left")
        ids, mask = enc.input_ids.cuda(), enc.attention_mask.bool().cuda()
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=16)
        before = eng.generate(ids, mask, greedy)

        free0 = torch.cuda.mem_get_info()[0]
        eng.sleep(1)
        assert torch.cuda.mem_get_info()[0] > free0  # weights + KV cache left the device
        eng.wake()
        assert torch.equal(eng.generate(ids, mask, greedy).response_ids, before.response_ids)

        new = load_model(ModelConfig(tiny=TINY, dtype="bfloat16", seed=1)).cuda()
        params = SamplingConfig(temperature=1.0, max_new_tokens=16)
        trainer = LocalTrainEngine(new, TrainEngineConfig(), trainable=False)

        def gap(out):
            return mean_mismatch(out.rollout_logprobs,
                                 trainer_logprobs(trainer, ids, mask, out, temperature=1.0),
                                 out.response_mask)

        stale = gap(eng.generate(ids, mask, params, generator=torch.Generator().manual_seed(0)))
        eng.sleep(2)  # weights discarded: the load refills them
        eng.load_weights((n, p.detach()) for n, p in new.named_parameters())
        eng.wake()
        fresh = gap(eng.generate(ids, mask, params, generator=torch.Generator().manual_seed(0)))
        assert fresh < MEAN_TOL and stale > 50 * fresh, (fresh, stale)
    finally:
        eng.close()


@pytest.mark.parametrize("index", [0, 1])
def test_engine_processes_load_over_cuda_ipc_and_sleep(index):
    """Two engine processes on GPU ``index``: weights travel as CUDA IPC handles to both (from
    cuda:1, re-addressed to the engines' only device); a stale engine (before the load) shows in
    the mismatch; sleep frees device memory in both."""
    if index >= torch.cuda.device_count():
        pytest.skip(f"needs {index + 1} GPUs")
    torch.cuda.set_device(index)
    from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
    from flowrl.engines.rollout.vllm_proc import VLLMProcessEngine

    mcfg = ModelConfig(tiny=TINY, dtype="bfloat16")
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg).cuda(index)
    eng = VLLMProcessEngine(model, tok, VLLMRolloutConfig(
        kv_cache_memory_gb=2.0, max_model_len=256, gpu_memory_utilization=0.3, engine_procs=2))
    try:
        assert eng.sleep_supported
        assert eng.serve_threads == [1, 1]  # rollout.vllm.serve_threads's default, on CUDA
        enc = tok(["Hello world", "What is 2+2?", "Natalia sold clips", "Tom has 3 apples"],
                  return_tensors="pt", padding=True, padding_side="left")
        ids, mask = enc.input_ids.cuda(index), enc.attention_mask.bool().cuda(index)
        new = load_model(ModelConfig(tiny=TINY, dtype="bfloat16", seed=1)).cuda(index)
        trainer = LocalTrainEngine(new, TrainEngineConfig(), trainable=False)
        params = SamplingConfig(temperature=1.0, max_new_tokens=16)

        def gap(out):
            return mean_mismatch(out.rollout_logprobs,
                                 trainer_logprobs(trainer, ids, mask, out, temperature=1.0),
                                 out.response_mask)

        stale = gap(eng.generate(ids, mask, params, generator=torch.Generator().manual_seed(0)))
        free0 = torch.cuda.mem_get_info()[0]
        eng.sleep(1)
        assert torch.cuda.mem_get_info()[0] > free0 + 2**30  # both engines' KV caches left
        eng.load_weights((n, p.detach()) for n, p in new.named_parameters())
        eng.wake()
        fresh = gap(eng.generate(ids, mask, params, generator=torch.Generator().manual_seed(0)))
        assert fresh < MEAN_TOL and stale > 50 * fresh, (fresh, stale)
        assert eng.last_load_counts["tensors"] == sum(1 for _ in new.named_parameters())
    finally:
        eng.close()
