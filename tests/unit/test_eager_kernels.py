"""``eager_kernels`` (flowrl/models/kernels.py): inside it, a model patched with liger's kernels
runs transformers' own RMSNorm / MLP / RoPE code; outside, liger's. The HF rollout engine decodes
inside it (liger's per-call host cost exceeds its GPU saving at one token a row).

liger itself needs CUDA (tests/gpu/test_liger_gpu.py runs the real patch). Here a stand-in
liger package patches a tiny Llama the way liger-kernel 0.8.5 does (a forward bound to each
RMSNorm and MLP instance, ``_bind_method_to_module``), with the same math plus a call count, and
the real ``apply_liger_kernels`` installs it."""
from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch._dynamo.testing
import transformers
from test_engines import TOKENIZER_DIR, tiny_llama
from transformers.models.llama import modeling_llama

from flowrl.engines.base import SamplingConfig
from flowrl.engines.config import HFRolloutConfig, TrainEngineConfig
from flowrl.engines.rollout.hf import HFRolloutEngine
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.models.kernels import apply_liger_kernels, eager_kernels

CALLS: list[str] = []


def _fused_norm(self, x):
    CALLS.append("norm")
    return modeling_llama.LlamaRMSNorm.forward(self, x)


def _fused_mlp(self, x):
    CALLS.append("mlp")
    return modeling_llama.LlamaMLP.forward(self, x)


def _fused_rope(q, k, cos, sin):
    CALLS.append("rope")
    return modeling_llama.apply_rotary_pos_emb.eager(q, k, cos, sin)


def _apply_fake_liger(model=None, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                      fused_linear_cross_entropy=False):
    for m in model.modules():  # liger's _bind_method_to_module
        if isinstance(m, modeling_llama.LlamaRMSNorm):
            m.__dict__["forward"] = _fused_norm.__get__(m, type(m))
        elif isinstance(m, modeling_llama.LlamaMLP):
            m.__dict__["forward"] = _fused_mlp.__get__(m, type(m))


@pytest.fixture
def fake_liger(monkeypatch):
    """A liger-kernel package whose llama patch is the stand-in above; transformers' llama
    module back as it was at teardown (the patch replaces its RoPE function)."""
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    pkg = {n: types.ModuleType(n) for n in ("liger_kernel", "liger_kernel.transformers",
                                             "liger_kernel.transformers.monkey_patch",
                                             "liger_kernel.transformers.rope")}
    pkg["liger_kernel.transformers.monkey_patch"].MODEL_TYPE_TO_APPLY_LIGER_FN = {
        "llama": _apply_fake_liger}
    pkg["liger_kernel.transformers.rope"].liger_rotary_pos_emb = _fused_rope
    for name, mod in pkg.items():
        monkeypatch.setitem(sys.modules, name, mod)
    CALLS.clear()
    yield


def _patched():
    model = tiny_llama()
    eager = copy.deepcopy(model)
    assert apply_liger_kernels(model) == "llama"
    return model, eager


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_eager_inside_liger_outside_same_values(fake_liger):
    model, eager = _patched()
    installed = modeling_llama.apply_rotary_pos_emb
    ids = torch.tensor([[5, 6, 7, 8]])
    want = _logits(eager, ids)
    got = _logits(model, ids)
    assert {"norm", "mlp", "rope"} <= set(CALLS)
    CALLS.clear()
    with eager_kernels(model):
        assert modeling_llama.apply_rotary_pos_emb is installed.eager
        with eager_kernels(model):  # nested
            inside = _logits(model, ids)
        assert _logits(model, ids).shape == inside.shape
    assert CALLS == []  # no fused call inside
    assert modeling_llama.apply_rotary_pos_emb is installed
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(inside, want)
    _logits(model, ids)
    assert {"norm", "mlp", "rope"} <= set(CALLS)  # liger's again after


def test_a_model_without_liger_is_left_alone(fake_liger):
    model = tiny_llama()
    before = dict(vars(modeling_llama))
    with eager_kernels(model):
        assert modeling_llama.apply_rotary_pos_emb is before["apply_rotary_pos_emb"]
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_deep_copy_computes_with_its_own_weights(fake_liger):
    """The frozen reference is a deep copy of the patched actor: each runs on its own weights,
    liger's way and eagerly."""
    model, _ = _patched()
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
    ids = torch.tensor([[5, 6, 7]])
    a, b = _logits(model, ids), _logits(ref, ids)
    assert not torch.allclose(a, b)
    with eager_kernels(ref):
        torch.testing.assert_close(_logits(ref, ids), b)
    torch.testing.assert_close(_logits(model, ids), a)


def test_no_per_call_flag_for_torch_compile(fake_liger):
    """Nothing in the patched forward reads a flag per call: dynamo traces the whole model in
    one graph (a context-variable check broke it at every module)."""
    model, _ = _patched()
    explained = torch._dynamo.explain(model)(input_ids=torch.tensor([[5, 6, 7]]))
    assert explained.graph_break_count == 0, [r.reason[:120] for r in explained.break_reasons]


def test_hf_generate_decodes_eager_and_training_keeps_liger(fake_liger):
    model, _ = _patched()
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    ids = torch.tensor([[5, 6, 7]])
    out = HFRolloutEngine(model, tok, HFRolloutConfig()).generate(
        ids, torch.ones_like(ids, dtype=torch.bool), SamplingConfig(temperature=0.0, max_new_tokens=3))
    assert out.response_ids.shape[1] >= 1
    assert CALLS == []  # prefill and decode: transformers' own code
    eng = LocalTrainEngine(model, TrainEngineConfig(logprob_chunk_size=None))
    batch = dict(prompt_ids=ids, prompt_mask=torch.ones_like(ids, dtype=torch.bool),
                 response_ids=torch.tensor([[8, 9]]), response_mask=torch.tensor([[True, True]]))
    eng.logprobs(batch, temperature=1.0)
    assert {"norm", "mlp", "rope"} <= set(CALLS)  # the trainer's forward: liger's
    CALLS.clear()
    # rollout.hf.compile=true decodes eager too: dynamo compiles transformers' own modules
    # instead of liger's Triton kernels, which broke its graph (hf_generate_compile_h100.md)
    HFRolloutEngine(model, tok, HFRolloutConfig(compile=True)).generate(
        ids, torch.ones_like(ids, dtype=torch.bool), SamplingConfig(temperature=0.0, max_new_tokens=2))
    assert CALLS == []


def test_the_eager_modules_trace_in_one_graph(fake_liger):
    """What a compiled decode traces inside ``eager_kernels``: transformers' own modules, one
    graph, and the same graph on the next call (no recompile from the swap)."""
    model, _ = _patched()
    ids = torch.tensor([[5, 6, 7]])
    with eager_kernels(model):
        explained = torch._dynamo.explain(model)(input_ids=ids)
    assert explained.graph_break_count == 0, [r.reason[:120] for r in explained.break_reasons]
    assert CALLS == []
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(model, backend=counter)
    for _ in range(3):  # as the engine enters it: once per generate call
        with eager_kernels(model), torch.no_grad():
            compiled(input_ids=ids)
        _logits(model, ids)  # the trainer's pass between calls: liger's modules back
    assert counter.frame_count == 1
    assert CALLS and set(CALLS) <= {"norm", "mlp", "rope"}  # only from the passes between


def test_the_compiled_decode_in_the_training_loop_compiles_once(fake_liger, monkeypatch):
    """``rollout.hf.compile=true`` as the loop runs it: an update on the liger-patched actor
    (liger's modules), then a generate on the same module, again and again, prompts of new
    lengths each time. transformers' compiled decode (dynamo's eager backend here: transformers
    compiles on CPU only when told to) must trace one graph, no break, and reuse it every call:
    on an H100 the decode with liger's kernels in it broke 7 times and ran slower than eager
    (benchmarks/results/hf_generate_compile_h100.md)."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    import flowrl.engines.rollout.hf as hf

    torch._dynamo.reset()
    counters.clear()
    model, _ = _patched()
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    eng = hf.HFRolloutEngine(model, tok, HFRolloutConfig(compile=True, batch_size=4), shared=True)
    own = eng._generation_config

    def compiled_on_cpu(*args, **kwargs):
        cfg = own(*args, **kwargs)
        assert cfg.disable_compile is False
        cfg.compile_config = CompileConfig(backend="eager", mode=None)
        cfg.compile_config._compile_all_devices = True  # transformers' switch for CPU tests
        return cfg

    monkeypatch.setattr(eng, "_generation_config", compiled_on_cpu)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    graphs = []
    for width in (6, 9, 5, 12):
        model.train()  # the update: liger's modules
        ids = torch.randint(5, 100, (4, width), generator=g)
        CALLS.clear()
        model(input_ids=ids).logits.float().mean().backward()
        opt.step()
        opt.zero_grad()
        assert {"norm", "mlp", "rope"} <= set(CALLS)
        CALLS.clear()
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[0, :width // 2] = False  # a left-padded row
        out = eng.generate(ids, mask, SamplingConfig(temperature=1.0, max_new_tokens=6),
                           generator=torch.Generator().manual_seed(width))
        assert out.response_ids.shape == (4, 6)
        assert CALLS == []  # the decode: transformers' own modules
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1, 1, 1]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
