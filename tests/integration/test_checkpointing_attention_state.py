"""Gradient checkpointing recomputes each layer in the backward, after the forward's attention
contexts have exited. The train engine's padded forwards run under an SDPA kernel restriction on
CUDA (``TrainEngineConfig.cudnn_attention``) and packed ones under ``packed_attention``: the
recompute must see the same state (``models.attention.checkpoint_context_fn``), or non-reentrant
checkpointing raises ``CheckpointError`` (the recomputed layer saved another kernel's tensors).
On CPU the restriction is stood in for by MATH-only SDPA (CPU's default is its flash kernel), a
tiny random Llama, padded rows of ragged lengths."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.models.loading import ModelConfig, build_tiny, tiny_model_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from gpu_helpers import ragged_batch  # noqa: E402 (host tensors only: no GPU needed)

TINY = {**tiny_model_config("llama"), "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}


def _grads(checkpointing: bool, restrict: bool, monkeypatch) -> torch.Tensor:
    torch.manual_seed(0)
    model = build_tiny(ModelConfig(tiny=TINY, attn_implementation="sdpa"), torch.float32,
                       device=torch.device("cpu"))
    eng = LocalTrainEngine(model, TrainEngineConfig(lr=1e-5, micro_batch_size=8,
                                                    gradient_checkpointing=checkpointing))
    if restrict:  # what cuda + cudnn_attention=false does, in CPU terms
        monkeypatch.setattr(eng, "_padded_attention", lambda: sdpa_kernel([SDPBackend.MATH]))
    batch = ragged_batch(n=8, seed=3, vocab=1024)
    lp, _ = eng._logprobs(batch, 1.0, with_entropy=False)
    m = batch["response_mask"].to(lp.device)
    (-(lp * m).sum() / m.sum()).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_recompute_runs_under_the_forwards_sdpa_restriction(monkeypatch):
    plain = _grads(checkpointing=False, restrict=True, monkeypatch=monkeypatch)
    ckpt = _grads(checkpointing=True, restrict=True, monkeypatch=monkeypatch)  # raised before
    assert torch.allclose(ckpt, plain, rtol=1e-5, atol=1e-7)


def test_the_flags_are_back_after_the_step(monkeypatch):
    _grads(checkpointing=True, restrict=True, monkeypatch=monkeypatch)
    b = torch.backends.cuda
    assert (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(),
            b.cudnn_sdp_enabled()) == (True, True, True, True)


def test_packed_state_reaches_the_recompute():
    from flowrl.models import attention

    seen = []
    with attention.packed_attention(kernel=False):
        fwd, rec = attention.checkpoint_context_fn()
    assert attention._PACKED.get() is None  # the forward's context has exited
    with rec:
        seen.append(attention._PACKED.get())
    assert seen[0] is not None and seen[0].kernel is False
    assert attention._PACKED.get() is None


@pytest.mark.parametrize("restricted", [[SDPBackend.MATH], [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]])
def test_recompute_context_restores_exactly_the_forwards_kernels(restricted):
    from flowrl.models import attention

    with sdpa_kernel(restricted):
        _, rec = attention.checkpoint_context_fn()
    with rec:
        now = attention.sdpa_backends_enabled()
    assert sorted(now, key=str) == sorted(restricted, key=str)
