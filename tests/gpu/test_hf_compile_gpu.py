"""GPU tier: ``rollout.hf.compile`` (transformers' compiled decode over the static KV cache).

Opt-in: ``pytest -m gpu tests/gpu/test_hf_compile_gpu.py`` on a CUDA device. What a long GPU job
with HF rollout turns on (``HFRolloutConfig.sized_for``) must keep the rollout's logprobs the ones
the trainer recomputes, and must compile once per job, not once per call: three generate calls of
different prompt lengths (12-40 tokens + 32 new: one 256-token cache bucket) leave one Dynamo
graph. fp32 with TF32 off: max |rollout logprob - trainer logprob| <= 1e-3 nats over the valid
tokens (the compiled kernels reorder sums; eager is ~1e-6).
"""
from __future__ import annotations

import pytest
import torch

from flowrl.engines.base import SamplingConfig
from flowrl.engines.config import HFRolloutConfig, TrainEngineConfig
from flowrl.engines.rollout.hf import HFRolloutEngine
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.models.loading import ModelConfig, build_tiny, load_tokenizer, tiny_model_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = 1e-3


def _prompts(P: int, B: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (B, P), generator=g)
    lens = torch.randint(1, P + 1, (B,), generator=g)
    mask = torch.arange(P)[None] >= (P - lens)[:, None]
    return ids.masked_fill(~mask, 2), mask


def test_compiled_decode_matches_the_trainer_and_compiles_once(monkeypatch):
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    cfg = ModelConfig(tiny={**tiny_model_config("llama"), "model_type": "qwen2", "hidden_size": 256,
                            "intermediate_size": 512, "tie_word_embeddings": True},
                      attn_implementation="sdpa")
    model = build_tiny(cfg, torch.float32, device=torch.device("cuda"))
    tok = load_tokenizer(cfg)
    torch._dynamo.reset()
    counters.clear()
    eng = HFRolloutEngine(model, tok, HFRolloutConfig(batch_size=8, compile=True), shared=True)
    trainer = LocalTrainEngine(model, TrainEngineConfig(micro_batch_size=8), trainable=False)
    params = SamplingConfig(temperature=1.0, max_new_tokens=32)
    for P in (12, 40, 25):
        ids, mask = _prompts(P, seed=P)
        out = eng.generate(ids, mask, params, generator=torch.Generator().manual_seed(P))
        batch = dict(prompt_ids=ids, prompt_mask=mask, response_ids=out.response_ids,
                     response_mask=out.response_mask)
        lp = trainer.logprobs(batch, temperature=1.0).logprobs.cpu()
        m = out.response_mask.cpu()
        gap = (lp - out.rollout_logprobs.cpu()).abs()[m].max().item()
        assert gap <= TOL, (P, gap)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
