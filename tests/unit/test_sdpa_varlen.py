"""``sdpa_varlen`` (flowrl/models/attention.py): packed micro-batches through torch's varlen_attn.

torch's ``varlen_attn`` has no CPU kernel, so these tests put a CPU reference in its place (a loop
of causal ``F.scaled_dot_product_attention`` over the documents ``cu_seqlens`` delimits), in both
signatures the adapter meets: torch >= 2.11's (``window_size``, ``scale``; ``enable_gqa`` from 2.12)
and torch 2.10's (``is_causal``, no scale, no grouped-query heads). On a tiny random Llama with
grouped-query heads (4 query, 2 key/value heads) in fp32 the train engine's packed layout then gives
the padded layout's per-token logprobs and gradients within 1e-5; the document boundaries are
built on the host by ``pack``; ``model.attn_implementation=auto`` picks ``sdpa_varlen`` only on
CUDA sm80+ with varlen_attn present. The CUDA run (bf16, the real kernel):
tests/gpu/test_sdpa_varlen_gpu.py and benchmarks/packing_gpu_check.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from flowrl.algorithms.packing import pack
from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine, _resolve_padding_free
from flowrl.models import attention
from flowrl.models.attention import (
    SDPA_VARLEN,
    Documents,
    packed_attention,
    varlen_causal_attention,
)
from flowrl.models.loading import ModelConfig, build_tiny, tiny_model_config

TOL = dict(atol=1e-5, rtol=1e-5)
CALLS: list[tuple[list[int], int]] = []  # (cu_seqlens, max_seqlen) of every reference call


def _per_document(query, key, value, cu, scale=None, enable_gqa=False):
    """(T, H, D) causal attention inside each document [cu[i], cu[i+1])."""
    bounds = cu.tolist()
    CALLS.append((bounds, 0))
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[a:b].transpose(0, 1)[None] for t in (query, key, value))
        out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=enable_gqa)[0].transpose(0, 1))
    return torch.cat(out)


def varlen_211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
               scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch >= 2.12's signature (2.11's without enable_gqa)."""
    assert window_size == (-1, 0) and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    assert cu_seq_q.dtype == torch.int32
    out = _per_document(query, key, value, cu_seq_q, scale=scale, enable_gqa=enable_gqa)
    CALLS[-1] = (CALLS[-1][0], max_q)
    return out


def varlen_210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
               return_aux=None):
    """torch 2.10's signature: no scale, no grouped-query heads."""
    assert is_causal and key.shape[1] == query.shape[1], "2.10 takes equal head counts"
    out = _per_document(query, key, value, cu_seq_q)
    CALLS[-1] = (CALLS[-1][0], max_q)
    return out


@pytest.fixture(params=[varlen_211, varlen_210], ids=["torch2.11+", "torch2.10"])
def reference_kernel(request, monkeypatch):
    """The CPU reference as torch's varlen_attn, on any device."""
    CALLS.clear()
    monkeypatch.setattr(attention, "_varlen_kernel", lambda device: request.param)
    return request.param


def _tiny(attn: str = SDPA_VARLEN):
    tiny = {**tiny_model_config("llama"), "vocab_size": 512, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    return build_tiny(ModelConfig(tiny=tiny, attn_implementation=attn), torch.float32)


def _batch(vocab: int) -> dict:
    """test_sdpa_flex's batch: sequences of 12, 5, 5 and 9 tokens."""
    from test_sdpa_flex import _batch as flex_batch

    return flex_batch(vocab)


def _loss(lp, batch):
    m = batch["response_mask"]
    return -(lp * batch["advantages"] * m).sum() / m.sum()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-checkpointing"])
def test_packed_varlen_equals_padded_logprobs_and_grads(reference_kernel, checkpointing):
    model, batch = _tiny(), _batch(512)
    out = {}
    for pf in ("false", "true"):
        eng = LocalTrainEngine(copy.deepcopy(model), TrainEngineConfig(
            lr=1e-3, padding_free=pf, micro_batch_size=4, gradient_checkpointing=checkpointing))
        assert eng._padding_free == (pf == "true")
        CALLS.clear()
        lp, _ = eng._logprobs(batch, 0.7, with_entropy=False)
        _loss(lp, batch).backward()
        out[pf] = (lp.detach(), {n: p.grad.clone() for n, p in eng.model.named_parameters()},
                   list(CALLS))
    (lp_pad, g_pad, calls_pad), (lp_pack, g_pack, calls_pack) = out["false"], out["true"]
    # the padded forward never reaches the kernel; the packed one once per layer (2), again per
    # layer when the backward recomputes a checkpointed layer, every time with the host-built
    # boundaries of the 12-, 5-, 5- and 9-token sequences
    assert calls_pad == []
    assert calls_pack == [([0, 12, 17, 22, 31], 12)] * (4 if checkpointing else 2)
    from test_sdpa_flex import assert_packed_equals_padded

    assert_packed_equals_padded(batch["response_mask"], lp_pad, g_pad, lp_pack, g_pack)


def test_varlen_adapter_scale_and_gqa_in_both_signatures():
    """A non-default scale and 4 query / 2 key-value heads: SDPA per document, either way."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, h, 8, generator=g) for h in (4, 2, 2))
    docs = Documents(torch.tensor([0, 3, 8, 10], dtype=torch.int32), 5)
    want = _per_document(q, k, v, docs.cu_seqlens, scale=0.3, enable_gqa=True)
    for fn in (varlen_211, varlen_210):
        torch.testing.assert_close(varlen_causal_attention(fn, q, k, v, docs, scale=0.3), want, **TOL)


def test_pack_builds_cu_seqlens_on_the_host():
    """Sequences of 3, 5 and 2 attended tokens and an empty row (no document)."""
    p_mask = torch.tensor([[False, True, True], [True, True, True], [False, False, True],
                           [False, False, False]])
    r_mask = torch.tensor([[True, False], [True, True], [True, False], [False, False]])
    ids = torch.arange(12).view(4, 3)
    pk = pack(ids, p_mask, ids[:, :2] + 100, r_mask)
    assert pk.cu_seqlens.dtype == torch.int32 and pk.cu_seqlens.tolist() == [0, 3, 8, 10]
    assert pk.max_seqlen == 5 and isinstance(pk.max_seqlen, int)
    assert pk.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]


def test_outside_packing_sdpa_varlen_is_sdpa(monkeypatch):
    """Padded forwards and generate run SDPA unchanged (bit for bit), the kernel never."""
    CALLS.clear()
    monkeypatch.setattr(attention, "_varlen_kernel", lambda device: varlen_211)
    from test_sdpa_flex import assert_runs_as_sdpa

    sdpa, mine = _tiny("sdpa"), _tiny()
    assert mine.config._attn_implementation == SDPA_VARLEN
    assert_runs_as_sdpa(sdpa, mine, _batch(512))
    assert CALLS == []


def test_cpu_packed_forward_takes_the_dense_mask_and_refuses_a_forced_kernel():
    """Without a CUDA kernel: auto = SDPA's dense block-diagonal mask; kernel=True a clear error."""
    m, b = _tiny(), _batch(512)
    pk = pack(b["prompt_ids"], b["prompt_mask"], b["response_ids"], b["response_mask"])
    docs = Documents(pk.cu_seqlens, pk.max_seqlen)
    kw = dict(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False)
    with torch.no_grad():
        with packed_attention(documents=docs):
            dense = m(**kw).logits
        with packed_attention(kernel=False, documents=docs):
            assert torch.equal(m(**kw).logits, dense)
        with packed_attention(kernel=True, documents=docs), \
                pytest.raises(ValueError, match="varlen_attn runs on CUDA only"):
            m(**kw)


def test_packed_forward_needs_documents_and_refuses_dropout(reference_kernel):
    m, b = _tiny(), _batch(512)
    pk = pack(b["prompt_ids"], b["prompt_mask"], b["response_ids"], b["response_mask"])
    kw = dict(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False)
    with packed_attention(), torch.no_grad(), pytest.raises(ValueError, match="document boundaries"):
        m(**kw)
    m.train()
    for layer in m.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with packed_attention(documents=Documents(pk.cu_seqlens, pk.max_seqlen)), torch.no_grad(), \
            pytest.raises(ValueError, match="dropout"):
        m(**kw)


def test_cuda_without_varlen_attn_is_a_clear_error(monkeypatch):
    import torch.nn.attention.varlen as varlen

    monkeypatch.delattr(varlen, "varlen_attn")
    with pytest.raises(RuntimeError, match=r"needs torch.nn.attention.varlen.varlen_attn"):
        attention._varlen_kernel(torch.device("cuda"))
    assert attention._varlen_kernel(torch.device("cpu")) is None


def test_padding_free_auto_turns_on_for_sdpa_varlen_on_cuda_only(monkeypatch, caplog):
    from flowrl.engines.train import local

    probed: list[torch.device] = []
    monkeypatch.setattr(local, "varlen_probe", lambda d: probed.append(d))  # None: it works
    m = _tiny()
    assert _resolve_padding_free(m, "auto", torch.device("cuda"))
    assert probed == [torch.device("cuda")]  # checked on the device before it packs
    assert not _resolve_padding_free(m, "auto", torch.device("cpu"))
    assert not _resolve_padding_free(_tiny("sdpa"), "auto", torch.device("cuda"))
    # a kernel that fails its probe: packing off for the run, one warning saying why
    monkeypatch.setattr(local, "varlen_probe", lambda d: "varlen_attn failed: RuntimeError: x")
    with caplog.at_level("WARNING"):
        assert not _resolve_padding_free(m, "auto", torch.device("cuda"))
    assert "packing off (varlen_attn failed: RuntimeError: x)" in caplog.text
    assert _resolve_padding_free(m, "true", torch.device("cuda"))  # forced: not second-guessed
    caplog.clear()
    with caplog.at_level("INFO"):  # forced on CPU: packed, under the dense mask, and it says so
        assert _resolve_padding_free(m, "true", torch.device("cpu"))
    assert "packed micro-batches take SDPA's dense block-diagonal mask (sdpa_varlen's" in caplog.text


def _non_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                window_size=(-1, -1), enable_gqa=False):
    """A kernel that ignores the causal window: attends to the whole document."""
    out = []
    for a, b in zip(cu_seq_q.tolist()[:-1], cu_seq_q.tolist()[1:]):
        q, k, v = (t[a:b].transpose(0, 1)[None] for t in (query, key, value))
        out.append(F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)[0].transpose(0, 1))
    return torch.cat(out)


def _raises(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
            window_size=(-1, -1), enable_gqa=False):
    raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore")


@pytest.mark.parametrize("kernel, want", [
    (varlen_211, None), (varlen_210, None),
    (_non_causal, "varlen_attn disagrees with SDPA by "),
    (_raises, "varlen_attn failed: RuntimeError: FlashAttention only supports Ampere GPUs or newer."),
])
def test_varlen_probe_passes_a_right_kernel_and_names_a_wrong_one(monkeypatch, kernel, want):
    """The one-time probe of ``sdpa_varlen`` (bf16, 2 documents, GQA, forward and backward)
    against SDPA per document; run here on CPU with stand-in kernels."""
    monkeypatch.setattr(attention, "_varlen_kernel", lambda device: kernel)
    attention.varlen_probe.cache_clear()
    try:
        got = attention.varlen_probe(torch.device("cpu"))
    finally:
        attention.varlen_probe.cache_clear()
    if want is None:
        assert got is None
    else:
        assert got is not None and got.startswith(want) and "\n" not in got


def _gpu(monkeypatch, capability, has_varlen=True):
    """This CPU machine seen as a CUDA one of ``capability``."""
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if not has_varlen:
        monkeypatch.delattr(varlen, "varlen_attn")


@pytest.mark.parametrize("capability,has_varlen,want", [
    ((9, 0), True, True), ((8, 0), True, True), ((7, 5), True, False), ((9, 0), False, False)])
def test_varlen_attn_supported_needs_sm80_and_the_function(monkeypatch, capability, has_varlen, want):
    _gpu(monkeypatch, capability, has_varlen)
    assert attention.varlen_attn_supported() is want


def test_varlen_attn_supported_false_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert attention.varlen_attn_supported() is False


def _cfg(*overrides):
    from flowrl.config import compose, to_train_config

    return to_train_config(compose(["model=tiny", "trainer.output_dir=/tmp/unused", *overrides]))


@pytest.mark.parametrize("capability,has_varlen,overrides,want", [
    ((9, 0), True, (), "sdpa_varlen"),
    ((8, 6), True, (), "sdpa_varlen"),
    ((7, 5), True, (), "sdpa"),
    ((9, 0), False, (), "sdpa"),
    # fp32 compute: FlashAttention takes none (a local engine computes in its fp32 weights)
    ((9, 0), True, ("trainer.engine.mixed_precision=fp32",), "sdpa"),
    ((9, 0), True, ("trainer.engine.strategy=local",), "sdpa"),
    ((9, 0), True, ("trainer.engine.strategy=local", "model.dtype=bfloat16"), "sdpa_varlen"),
])
def test_auto_attention_resolves_to_sdpa_varlen_on_cuda_sm80_only(monkeypatch, capability,
                                                                  has_varlen, overrides, want):
    from flowrl import machine
    from flowrl.machine import resolve_machine_defaults

    _gpu(monkeypatch, capability, has_varlen)
    monkeypatch.setattr(machine, "AUTO_SDPA_VARLEN", True)  # opt-in by default: the rule when on
    cfg = _cfg(*overrides)
    got = resolve_machine_defaults(cfg, cuda=True, vllm=False, flash_attn=False)
    assert cfg.model.attn_implementation == want
    assert [r for r in got if r.field == "model.attn_implementation"][0].value == want


def test_auto_attention_keeps_cpu_and_flash_attn_defaults(monkeypatch):
    from flowrl.machine import resolve_machine_defaults

    _gpu(monkeypatch, (9, 0))
    cpu = _cfg()
    resolve_machine_defaults(cpu, cuda=False, vllm=False, flash_attn=False)
    assert (cpu.trainer.device, cpu.model.attn_implementation) == ("cpu", "sdpa")
    fa = _cfg()
    resolve_machine_defaults(fa, cuda=True, vllm=False, flash_attn=True)
    assert fa.model.attn_implementation == "flash_attention_2"
    explicit = _cfg("model.attn_implementation=sdpa")
    resolve_machine_defaults(explicit, cuda=True, vllm=False, flash_attn=False)
    assert explicit.model.attn_implementation == "sdpa"


def test_machine_problems_name_sdpa_varlen_without_the_kernel():
    from flowrl.machine import machine_problems

    cfg = _cfg("trainer.device=cuda", "rollout=hf", "model.attn_implementation=sdpa_varlen")
    assert machine_problems(cfg, cuda=True, vllm=False, flash_attn=False, varlen=True) == []
    got = machine_problems(cfg, cuda=True, vllm=False, flash_attn=False, varlen=False)
    assert len(got) == 1 and got[0].startswith("model.attn_implementation=sdpa_varlen on CUDA needs")
    cpu = _cfg("trainer.device=cpu", "rollout=hf", "model.attn_implementation=sdpa_varlen")
    assert machine_problems(cpu, cuda=False, vllm=False, flash_attn=False) == []
