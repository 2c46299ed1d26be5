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
