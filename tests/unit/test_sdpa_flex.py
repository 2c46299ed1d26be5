"""``sdpa_flex`` (flowrl/models/attention.py): packed micro-batches equal padded ones.

On tiny random Llama and Qwen2 (RoPE, grouped-query heads) in fp32 on CPU: the train engine's
packed layout (one row, per-document masks) gives the per-token logprobs, loss and gradients of
the padded layout within 1e-5; the flex_attention kernel itself (BlockMask, the CUDA path; on
CPU torch runs it without a backward) gives the packed forward's logprobs; outside a packed
forward the model is SDPA bit for bit (generate, padded forwards). The CUDA run of the same
checks: benchmarks/packing_gpu_check.py.
"""
from __future__ import annotations

import copy

import pytest
import torch

from flowrl.algorithms.logprobs import token_logprobs
from flowrl.algorithms.packing import pack
from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.models.attention import SDPA_FLEX, packed_attention
from flowrl.models.loading import ModelConfig, build_tiny, tiny_model_config

TOL = dict(atol=1e-5, rtol=1e-5)


def _tiny(kind: str, attn: str):
    tiny = {**tiny_model_config("llama"), "vocab_size": 512, "num_attention_heads": 4,
            "num_key_value_heads": 2, "model_type": kind}
    return build_tiny(ModelConfig(tiny=tiny, attn_implementation=attn), torch.float32)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    return _tiny(request.param, SDPA_FLEX)


def _batch(vocab: int) -> dict:
    """Left-padded prompts of 2..5 tokens, right-padded responses of 1..7 tokens."""
    g = torch.Generator().manual_seed(1)
    p_len, r_len = [5, 2, 4, 3], [7, 3, 1, 6]
    p_mask = torch.tensor([[i >= 5 - n for i in range(5)] for n in p_len])
    r_mask = torch.tensor([[i < n for i in range(7)] for n in r_len])
    return dict(prompt_ids=torch.randint(3, vocab, (4, 5), generator=g), prompt_mask=p_mask,
                response_ids=torch.randint(3, vocab, (4, 7), generator=g), response_mask=r_mask,
                advantages=torch.tensor([1.0, -0.5, 2.0, -1.5])[:, None].expand(4, 7).clone())


def _loss(batch):
    denom = batch["response_mask"].sum()

    def loss_fn(mb, lp, ent):
        pg = -(lp * mb["advantages"] * mb["response_mask"]).sum() / denom
        return pg, {"pg_loss": pg.item()}
    return loss_fn


def test_packed_equals_padded_logprobs_and_grads(tiny):
    batch = _batch(tiny.config.vocab_size)
    out = {}
    for pf in ("false", "true"):
        eng = LocalTrainEngine(copy.deepcopy(tiny), TrainEngineConfig(
            lr=1e-3, logprob_chunk_size=None, padding_free=pf, micro_batch_size=4))
        assert eng._padding_free == (pf == "true")
        lp, _ = eng._logprobs(batch, 0.7, with_entropy=False)
        _loss(batch)(batch, lp, None)[0].backward()
        out[pf] = (lp.detach(), {n: p.grad.clone() for n, p in eng.model.named_parameters()})
    (lp_pad, g_pad), (lp_pack, g_pack) = out["false"], out["true"]
    assert_packed_equals_padded(batch["response_mask"], lp_pad, g_pad, lp_pack, g_pack)


def assert_packed_equals_padded(mask, lp_pad, g_pad, lp_pack, g_pack) -> None:
    """Packed and padded forwards' logprobs (valid tokens negative, masked ones 0) and every
    parameter's gradient agree within ``TOL``; the gradients are not all zero."""
    assert (lp_pad[mask] < 0).all() and (lp_pad[~mask] == 0).all()
    torch.testing.assert_close(lp_pack, lp_pad, **TOL)
    assert len(g_pad) == len(g_pack) and any(g.abs().max() > 0 for g in g_pad.values())
    for n, g in g_pad.items():
        torch.testing.assert_close(g_pack[n], g, **TOL, msg=n)


def test_flex_kernel_packed_forward_equals_padded(tiny):
    """The BlockMask path (CUDA's) on CPU, forward only: per-token logprobs of a packed row."""
    b = _batch(tiny.config.vocab_size)
    p_mask, r_mask = b["prompt_mask"], b["response_mask"]
    pk = pack(b["prompt_ids"], p_mask, b["response_ids"], r_mask)
    with torch.no_grad():
        with packed_attention(kernel=True):
            packed = tiny(input_ids=pk.input_ids, position_ids=pk.position_ids,
                          use_cache=False).logits[0][pk.predictor_index]
        eng = LocalTrainEngine(tiny, TrainEngineConfig(logprob_chunk_size=None, padding_free="false"),
                               trainable=False)
        ref, _ = eng._logprobs(b, 1.0, with_entropy=False)
    lp = token_logprobs(packed, b["response_ids"][r_mask], 1.0)
    torch.testing.assert_close(lp, ref[r_mask], **TOL)


def assert_runs_as_sdpa(sdpa, mine, b) -> None:
    """Padded forwards and greedy generate of ``mine`` equal ``sdpa``'s, bit for bit (``b``: a
    batch of left-padded prompts and right-padded responses)."""
    ids = torch.cat([b["prompt_ids"], b["response_ids"]], 1)
    attn = torch.cat([b["prompt_mask"], b["response_mask"]], 1).long()
    with torch.no_grad():
        assert torch.equal(sdpa(input_ids=ids, attention_mask=attn).logits,
                           mine(input_ids=ids, attention_mask=attn).logits)
        gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(sdpa.generate(input_ids=ids[:, :5], attention_mask=attn[:, :5], **gen),
                           mine.generate(input_ids=ids[:, :5], attention_mask=attn[:, :5], **gen))


def test_outside_packing_sdpa_flex_is_sdpa():
    """Padded forwards (and so generate) run SDPA unchanged: equal logits, bit for bit."""
    sdpa, mine = _tiny("qwen2", "sdpa"), _tiny("qwen2", SDPA_FLEX)
    assert mine.config._attn_implementation == SDPA_FLEX
    assert_runs_as_sdpa(sdpa, mine, _batch(512))


def test_padding_free_auto_turns_on_for_sdpa_flex_on_cuda_only():
    from flowrl.engines.train.local import _resolve_padding_free

    m = _tiny("llama", SDPA_FLEX)
    assert _resolve_padding_free(m, "auto", torch.device("cuda"))
    assert not _resolve_padding_free(m, "auto", torch.device("cpu"))
    assert not _resolve_padding_free(_tiny("llama", "sdpa"), "auto", torch.device("cuda"))


def test_packed_forward_refuses_attention_dropout():
    m = _tiny("llama", SDPA_FLEX)
    m.config.attention_dropout = 0.1
    for layer in m.model.layers:
        layer.self_attn.attention_dropout = 0.1
    m.train()
    pk = pack(torch.tensor([[5, 6]]), torch.tensor([[True, True]]), torch.tensor([[7, 8]]),
              torch.tensor([[True, True]]))
    with packed_attention(kernel=True), torch.no_grad(), pytest.raises(ValueError, match="dropout"):
        m(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False)
