"""GPU tier: a padded micro-batch's attention kernel (``TrainEngineConfig.cudnn_attention``).

Opt-in: ``pytest -m gpu tests/gpu/test_attention_backends_gpu.py`` on a CUDA device. By default the
train engine leaves cuDNN attention out of SDPA's choices for padded micro-batches (cuDNN builds a
graph per new shape, and token-budget micro-batches change shape every step): the forward and
backward must then run the memory-efficient kernel, and give the logprobs cuDNN (or whatever SDPA
picks with the option on) gives, up to bf16 rounding (tiny random Llama, 64-dim heads, 1,024 vocab:
≤ 0.1 nats, as tests/gpu/test_liger_gpu.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_helpers import ragged_batch

from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.models.loading import ModelConfig, build_tiny, tiny_model_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model():
    tiny = {**tiny_model_config("llama"), "hidden_size": 256, "intermediate_size": 512,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}
    return build_tiny(ModelConfig(tiny=tiny, attn_implementation="sdpa"), torch.bfloat16,
                      device=torch.device("cuda"))


def _step(model, **engine):
    """Logprobs of one padded micro-batch, its backward, and the ATen ops they ran
    (``engine``: TrainEngineConfig fields)."""
    eng = LocalTrainEngine(model, TrainEngineConfig(lr=1e-5, micro_batch_size=8, **engine))
    batch = ragged_batch(n=8, seed=3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        lp, _ = eng._logprobs(batch, 1.0, with_entropy=False)
        m = batch["response_mask"].to(lp.device)
        (-(lp * m).sum() / m.sum()).backward()
        torch.cuda.synchronize()
    return lp.detach().float(), m.bool(), {e.key for e in prof.key_averages()}


def test_padded_micro_batch_skips_cudnn_attention_by_default():
    model = _model()
    lp, m, ops = _step(model, cudnn_attention=False)
    assert not any("cudnn_attention" in k for k in ops), sorted(k for k in ops if "attention" in k)
    assert any("efficient_attention_forward" in k for k in ops), sorted(k for k in ops if "attention" in k)
    assert any("efficient_attention_backward" in k for k in ops)
    model.zero_grad(set_to_none=True)
    lp_on, _, _ = _step(model, cudnn_attention=True)
    assert (lp_on - lp)[m].abs().max().item() <= 0.1


def test_checkpointed_padded_micro_batch_recomputes_with_the_same_kernel():
    """With gradient checkpointing the layers recompute in the backward, after the forward's
    SDPA restriction has exited: the recompute must take the memory-efficient kernel again
    (models.attention.checkpoint_context_fn), else non-reentrant checkpointing raises."""
    model = _model()
    _, _, ops = _step(model, gradient_checkpointing=True)
    assert not any("cudnn_attention" in k for k in ops), sorted(k for k in ops if "attention" in k)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_hf_generate_skips_cudnn_attention_by_default():
    """``rollout.hf.cudnn_attention``: transformers' generate over left-padded prompts (masked
    prefill, then decode steps against a cache one key longer each time) runs no cuDNN
    attention by default, and samples what it samples with cuDNN allowed (greedy, so equal
    tokens up to bf16 ties: most of them)."""
    import transformers

    from flowrl.engines.base import SamplingConfig
    from flowrl.engines.config import HFRolloutConfig
    from flowrl.engines.rollout.hf import HFRolloutEngine

    tok = transformers.AutoTokenizer.from_pretrained(
        Path(__file__).resolve().parents[2] / "flowrl/models/assets/smollm2-tokenizer")
    model = _model()
    batch = ragged_batch(n=8, seed=3)

    def run(cudnn: bool):
        eng = HFRolloutEngine(model, tok, HFRolloutConfig(cudnn_attention=cudnn))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = eng.generate(batch["prompt_ids"], batch["prompt_mask"].bool(),
                               SamplingConfig(temperature=0.0, max_new_tokens=12))
            torch.cuda.synchronize()
        return out, {e.key for e in prof.key_averages()}

    out, ops = run(False)
    assert not any("cudnn_attention" in k for k in ops), sorted(k for k in ops if "attention" in k)
    assert any("efficient_attention" in k or "flash_attention" in k for k in ops), \
        sorted(k for k in ops if "attention" in k)
    out_on, _ = run(True)
    same = (out.response_ids == out_on.response_ids).float().mean().item()
    assert same >= 0.75, same
