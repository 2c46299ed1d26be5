"""``TrainEngineConfig.cudnn_attention`` (engines/train/local.py ``_padded_attention``): on CUDA a
padded micro-batch's forward runs with cuDNN attention left out of SDPA's choices (cuDNN builds a
graph per new shape), unless the option turns it back on; off CUDA nothing is restricted. The
flags SDPA dispatches on are read inside the model's forward, so this runs without a GPU; which
kernel a GPU then takes is checked in tests/gpu/test_train_gpu.py."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine


class _Probe(nn.Module):
    """Records SDPA's backend flags at forward time; a causal LM's output shape."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
        self.seen: list[tuple[bool, bool, bool, bool]] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        b = torch.backends.cuda
        self.seen.append((b.cudnn_sdp_enabled(), b.flash_sdp_enabled(),
                          b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()))
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 11) + self.w})()


def _engine(cudnn: bool, device: str) -> tuple[LocalTrainEngine, _Probe]:
    probe = _Probe()
    eng = LocalTrainEngine(probe, TrainEngineConfig(cudnn_attention=cudnn,
                                                    logprob_chunk_size=None))
    eng.device = torch.device(device)  # the flags, not a device, are under test
    return eng, probe


@pytest.mark.parametrize("cudnn,device,want", [
    (False, "cuda", (False, True, True, True)),  # cuDNN left out, the rest allowed
    (True, "cuda", (True, True, True, True)),
    (False, "cpu", (True, True, True, True)),    # CPU: nothing restricted
])
def test_padded_forward_runs_with_these_sdpa_backends(cudnn, device, want):
    eng, probe = _engine(cudnn, device)
    with eng._padded_attention():
        probe(torch.zeros(1, 3, dtype=torch.long))
    assert probe.seen == [want]
    # and the flags are back afterwards
    b = torch.backends.cuda
    assert (b.cudnn_sdp_enabled(), b.mem_efficient_sdp_enabled()) == (True, True)


def test_default_leaves_cudnn_out():
    assert TrainEngineConfig().cudnn_attention is False


def test_padded_logprobs_forward_goes_through_the_restriction(monkeypatch):
    eng, probe = _engine(False, "cpu")
    calls = []

    def counted():
        calls.append(1)
        return contextlib.nullcontext()

    monkeypatch.setattr(eng, "_padded_attention", counted)
    batch = dict(prompt_ids=torch.tensor([[0, 5, 6]]), prompt_mask=torch.tensor([[0, 1, 1]]),
                 response_ids=torch.tensor([[7, 8]]), response_mask=torch.tensor([[1, 1]]))
    eng._logprobs(batch, 1.0, with_entropy=False)
    assert calls == [1] and len(probe.seen) == 1


def _flags() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return (b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(),
            b.math_sdp_enabled())


@pytest.mark.parametrize("device,cudnn,want", [
    ("cuda", False, (False, True, True, True)),
    ("cuda", True, (True, True, True, True)),
    ("cpu", False, (True, True, True, True)),
])
def test_sdpa_without_cudnn_leaves_out_only_cudnn(device, cudnn, want):
    from flowrl.models.attention import sdpa_without_cudnn

    with sdpa_without_cudnn(torch.device(device), cudnn):
        assert _flags() == want
    assert _flags() == (True, True, True, True)


def test_sdpa_without_cudnn_keeps_a_users_own_restriction():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flowrl.models.attention import sdpa_without_cudnn

    with sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]):
        with sdpa_without_cudnn(torch.device("cuda")):
            assert _flags() == (False, False, False, True)


@pytest.mark.parametrize("cudnn,want", [(False, False), (True, True)])
def test_hf_generate_runs_without_cudnn_by_default(cudnn, want, monkeypatch):
    """``rollout.hf.cudnn_attention``: transformers' generate (prefill and every decode step)
    runs with cuDNN left out on CUDA unless the option turns it back on. The model runs on the
    CPU; the helper is handed "cuda" in its place, so the flags are those a GPU run gets."""
    import transformers
    from test_engines import TOKENIZER_DIR, tiny_llama

    from flowrl.engines.base import SamplingConfig
    from flowrl.engines.config import HFRolloutConfig
    from flowrl.engines.rollout import hf
    from flowrl.models import attention

    calls = []

    def as_on_cuda(device, cudnn=False):
        calls.append((device, cudnn))
        return attention.sdpa_without_cudnn(torch.device("cuda"), cudnn)

    monkeypatch.setattr(hf, "sdpa_without_cudnn", as_on_cuda)
    model = tiny_llama()
    seen: list[tuple[bool, bool, bool, bool]] = []
    model.register_forward_pre_hook(lambda m, a: seen.append(_flags()))
    eng = hf.HFRolloutEngine(model, transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR),
                             HFRolloutConfig(cudnn_attention=cudnn))
    ids = torch.tensor([[5, 6, 7]])
    eng.generate(ids, torch.ones_like(ids, dtype=torch.bool),
                 SamplingConfig(temperature=0.0, max_new_tokens=3))  # greedy: no early EOS draw
    assert calls == [(eng.device, cudnn)]
    assert len(seen) == 3  # prefill and two decode steps, all inside
    assert {s[0] for s in seen} == {want}
    assert all(s[2] for s in seen)  # the memory-efficient kernel stays allowed
    assert _flags() == (True, True, True, True)
