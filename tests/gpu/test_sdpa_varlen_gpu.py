"""GPU tier: ``sdpa_varlen`` packed micro-batches through torch's real ``varlen_attn`` kernel.

Opt-in: ``pytest -m gpu tests/gpu/test_sdpa_varlen_gpu.py`` on an sm80+ CUDA device whose torch has
``torch.nn.attention.varlen.varlen_attn``. The CPU tests (tests/unit/test_sdpa_varlen.py) hold the
packed = padded equivalence to 1e-5 in fp32 with a reference kernel; FlashAttention takes bf16
only, so here both bf16 layouts are measured against one fp32 padded reference of the same weights:
the packed varlen layout must be no further from it than twice the bf16 padded (SDPA) layout plus
1e-2 nats, and one forward/backward's gradients must agree with the padded one's (cosine ≥ 0.99,
norms within 5%).

Model: a tiny random Llama, hidden 256, 4 query / 2 key-value heads (head size 64, grouped-query:
exercises ``enable_gqa`` or the key/value repeat), 2 layers; 8 sequences of 3-40 prompt and 1-60
response tokens.
"""
from __future__ import annotations

import copy

import pytest
import torch
from gpu_helpers import ragged_batch

from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.models import attention
from flowrl.models.loading import ModelConfig, build_tiny, tiny_model_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not attention.varlen_attn_supported(),
                                 reason="needs an sm80+ CUDA device and torch's varlen_attn")]


def _model(attn: str):
    tiny = {**tiny_model_config("llama"), "hidden_size": 256, "intermediate_size": 512,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}
    return build_tiny(ModelConfig(tiny=tiny, attn_implementation=attn), torch.float32,
                      device=torch.device("cuda"))


_batch = ragged_batch


def _run(model, padding_free: str, batch: dict, backward: bool):
    eng = LocalTrainEngine(model, TrainEngineConfig(lr=1e-5, padding_free=padding_free,
                                                    micro_batch_size=len(batch["prompt_ids"])))
    assert eng._padding_free == (padding_free == "true")
    with torch.set_grad_enabled(backward):
        lp, _ = eng._logprobs(batch, 1.0, with_entropy=False)
    grads = None
    if backward:
        m = batch["response_mask"].to(lp.device)
        (-(lp * m).sum() / m.sum()).backward()
        grads = torch.cat([p.grad.float().flatten() for p in eng.model.parameters()])
    return lp.detach().float(), grads


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the packed forwards that reach torch's kernel."""
    calls = []
    real = attention._varlen_kernel

    def counting(device):
        calls.append(device)
        return real(device)
    monkeypatch.setattr(attention, "_varlen_kernel", counting)
    return calls


@pytest.fixture
def no_tf32():
    """An fp32 reference in fp32 (TF32 matmuls off), restored after the test."""
    matmul = torch.backends.cuda.matmul
    old = getattr(matmul, "allow_tf32", False)
    matmul.allow_tf32 = False
    yield
    matmul.allow_tf32 = old


def test_bf16_packed_varlen_logprobs_match_padded(kernel_calls, no_tf32):
    ref_model = _model("sdpa_varlen")
    b = _batch()
    mask = b["response_mask"].cuda()
    ref, _ = _run(copy.deepcopy(ref_model), "false", b, backward=False)  # fp32, padded SDPA
    bf16 = copy.deepcopy(ref_model).to(torch.bfloat16)
    pad, _ = _run(copy.deepcopy(bf16), "false", b, backward=False)
    assert kernel_calls == []
    packed, _ = _run(copy.deepcopy(bf16), "true", b, backward=False)
    assert len(kernel_calls) == 1  # one mask per forward, every layer runs the kernel on it
    err_pad = (pad - ref)[mask].abs().max().item()
    err_packed = (packed - ref)[mask].abs().max().item()
    print(f"max |Δ logprob| vs fp32: padded bf16 {err_pad:.3e}, packed varlen bf16 {err_packed:.3e}")
    assert (packed[~mask] == 0).all()
    assert err_packed <= 2 * err_pad + 1e-2, (err_packed, err_pad)


def test_bf16_packed_varlen_forward_backward_matches_padded(kernel_calls):
    bf16 = _model("sdpa_varlen").to(torch.bfloat16)
    b = _batch(seed=1)
    lp_pad, g_pad = _run(copy.deepcopy(bf16), "false", b, backward=True)
    lp_packed, g_packed = _run(copy.deepcopy(bf16), "true", b, backward=True)
    assert len(kernel_calls) == 1
    assert torch.isfinite(g_packed).all() and g_packed.abs().max() > 0
    cos = torch.nn.functional.cosine_similarity(g_packed, g_pad, dim=0).item()
    ratio = (g_packed.norm() / g_pad.norm()).item()
    print(f"gradient cosine {cos:.5f}, norm ratio {ratio:.4f}")
    assert cos >= 0.99 and abs(ratio - 1) <= 0.05, (cos, ratio)
