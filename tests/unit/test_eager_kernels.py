"""``eager_kernels`` (flowrl/models/kernels.py): inside it, a model patched with liger's kernels
runs transformers' own RMSNorm / MLP / RoPE code; outside, liger's. The HF rollout engine decodes
inside it (liger's per-call host cost exceeds its GPU saving at one token a row). liger itself
needs CUDA (tests/gpu/test_liger_gpu.py runs the real patch): here a stand-in binds a forward to
the instance exactly as liger's ``_bind_method_to_module`` does."""
from __future__ import annotations

import torch
import transformers
from test_engines import TOKENIZER_DIR, tiny_llama
from torch import nn
from transformers.models.llama import modeling_llama

from flowrl.engines.base import SamplingConfig
from flowrl.engines.config import HFRolloutConfig
from flowrl.engines.rollout.hf import HFRolloutEngine
from flowrl.models import kernels
from flowrl.models.kernels import _eager_when_asked, eager_kernels, rope_over_one_row


class _Norm(nn.Module):
    def forward(self, x):
        return x + 1  # "transformers' own"


def _fused(self, x):
    return x + 100  # "liger's"


def _patched() -> _Norm:
    m = _Norm()
    m.__dict__["forward"] = _fused.__get__(m, type(m))  # liger's _bind_method_to_module
    _eager_when_asked(m)
    return m


def test_patched_module_runs_eager_only_inside():
    m, x = _patched(), torch.zeros(2)
    assert m(x).tolist() == [100.0, 100.0]
    with eager_kernels():
        assert m(x).tolist() == [1.0, 1.0]
        with eager_kernels():  # nested
            assert m(x).tolist() == [1.0, 1.0]
        assert m(x).tolist() == [1.0, 1.0]
    assert m(x).tolist() == [100.0, 100.0]


def test_rope_runs_transformers_own_inside():
    calls = []

    def inner(q, k, cos, sin):
        calls.append("liger")
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)

    def eager(q, k, cos, sin, *a, **kw):
        calls.append("eager")
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, *a, **kw)

    rope = rope_over_one_row(inner, eager=eager)
    assert rope.eager is eager  # a re-install finds transformers' own through it
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8)
    cos, sin = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    out = rope(q, k, cos, sin)
    with eager_kernels():
        out_eager = rope(q, k, cos, sin)
    assert calls == ["liger", "eager"]
    assert torch.equal(out[0], out_eager[0]) and torch.equal(out[1], out_eager[1])


def test_hf_generate_decodes_eager_unless_compiled():
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    seen: list[bool] = []
    for compile_ in (None, True):
        model = tiny_llama()
        model.register_forward_pre_hook(lambda m, a: seen.append(kernels._EAGER.get()))
        eng = HFRolloutEngine(model, tok, HFRolloutConfig(compile=compile_))
        ids = torch.tensor([[5, 6, 7]])
        eng.generate(ids, torch.ones_like(ids, dtype=torch.bool),
                     SamplingConfig(temperature=0.0, max_new_tokens=3))
    # eager: prefill and two decode steps inside; compile=true (a no-op on CPU): outside
    assert seen == [True] * 3 + [False] * 3
    assert kernels._EAGER.get() is False
