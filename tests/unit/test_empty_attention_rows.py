"""Issue 25's NaN grad norm, its suspected cause reproduced on CPU: no forward of the train
engines has a query row that attends to nothing.

The hypothesis (not yet confirmed on the GPU: the old layout has not been run there against the
new one): in bf16 under PyTorch's default SDPA backend on Hopper (cuDNN attention) a query row
whose mask is empty — every left-padding column of a left-padded prompt — gets a finite forward
but a NaN ∂Q in the backward. The loss never reads those rows, so the loss is finite while
∂W_q = Xᵀ∂Q is NaN: "non-finite grad norm (nan); skipping the optimizer step". Here an attention
function behaves like that kernel (plain SDPA forward, NaN gradient at empty query rows) on a tiny
random Llama; the engines must not trip it (``algorithms/masks.left_align``) and must give the
plain-SDPA values and gradients. The old code fails the first three tests (skipped=1, NaN norm).
"""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flowrl.algorithms.masks import left_align, position_ids_from_mask
from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.engines.train.value import ValueTrainEngine, value_model_from_causal_lm
from flowrl.models.loading import ModelConfig, build_tiny, tiny_model_config

CUDNN_LIKE = "flowrl_test_nan_grad_on_empty_rows"


class _NaNGradOnEmptyRows(torch.autograd.Function):
    """Identity on the query; its gradient is NaN at query rows whose mask row is empty."""

    @staticmethod
    def forward(ctx, query, empty):
        ctx.save_for_backward(empty)
        return query.view_as(query)

    @staticmethod
    def backward(ctx, grad):
        (empty,) = ctx.saved_tensors
        return grad.masked_fill(empty[..., None], float("nan")), None


def _cudnn_like_attention(module, query, key, value, attention_mask, **kwargs):
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        empty = ~attention_mask.any(-1)  # (B, 1, q): rows that attend to no key
        query = _NaNGradOnEmptyRows.apply(query, empty.expand(-1, query.shape[1], -1))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


transformers.AttentionInterface.register(CUDNN_LIKE, _cudnn_like_attention)
AttentionMaskInterface.register(CUDNN_LIKE, sdpa_mask)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny(ModelConfig(tiny={**tiny_model_config("llama"), "vocab_size": 512}), torch.float32)


def _batch(vocab: int) -> dict:
    """Left-padded prompts of 2..5 tokens, right-padded responses of 1..4 tokens."""
    g = torch.Generator().manual_seed(0)
    p_len, r_len = [5, 2, 3, 4], [4, 1, 3, 2]
    return dict(prompt_ids=torch.randint(3, vocab, (4, 5), generator=g),
                prompt_mask=torch.tensor([[i >= 5 - n for i in range(5)] for n in p_len]),
                response_ids=torch.randint(3, vocab, (4, 4), generator=g),
                response_mask=torch.tensor([[i < n for i in range(4)] for n in r_len]),
                advantages=torch.tensor([1.0, -0.5, 2.0, -1.5])[:, None].expand(4, 4).clone())


def _loss_fn(batch):
    denom = batch["response_mask"].sum()

    def loss_fn(mb, lp, ent):
        return -(torch.where(mb["response_mask"], lp * mb["advantages"], 0.0)).sum() / denom, {}
    return loss_fn


def _with_attention(model, impl: str):
    m = copy.deepcopy(model)
    m.set_attn_implementation(impl)
    return m


@pytest.mark.parametrize("chunk", [None, 3], ids=["plain", "chunked"])
def test_a_left_padded_batch_trains_under_an_attention_that_nans_empty_rows(tiny, chunk):
    batch = _batch(tiny.config.vocab_size)
    out = {}
    for impl in ("sdpa", CUDNN_LIKE):
        eng = LocalTrainEngine(_with_attention(tiny, impl), TrainEngineConfig(
            lr=1e-3, logprob_chunk_size=chunk, padding_free="false", micro_batch_size=4))
        lp = eng.logprobs(batch, 1.0).logprobs
        m = eng.train_step(batch, _loss_fn(batch), 1.0)
        out[impl] = (lp, m)
    (lp_ref, m_ref), (lp, m) = out["sdpa"], out[CUDNN_LIKE]
    # old code: skipped=1.0, grad_norm=nan (the empty rows' NaN reached every q_proj weight)
    assert m["skipped"] == 0.0 and m_ref["skipped"] == 0.0
    assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-6) and m["grad_norm"] > 0
    torch.testing.assert_close(lp, lp_ref, atol=0, rtol=0)
    mask = batch["response_mask"]
    assert (lp[~mask] == 0).all() and (lp[mask] < 0).all()


def test_left_alignment_keeps_every_logprob_of_the_padded_layout(tiny):
    """The rotated layout gives the logprobs of the plain left-padded forward (fp32, 1e-5)."""
    batch = _batch(tiny.config.vocab_size)
    eng = LocalTrainEngine(copy.deepcopy(tiny), TrainEngineConfig(logprob_chunk_size=None,
                                                                  padding_free="false"),
                           trainable=False)
    P, R = 5, 4
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    with torch.no_grad():
        logits = tiny(input_ids=ids, attention_mask=attn.long(),
                      position_ids=position_ids_from_mask(attn)).logits[:, P - 1:P + R - 1]
    ref = torch.log_softmax(logits.float(), -1).gather(-1, batch["response_ids"][..., None])[..., 0]
    ref = torch.where(batch["response_mask"], ref, 0.0)
    torch.testing.assert_close(eng.logprobs(batch, 1.0).logprobs, ref, atol=1e-5, rtol=1e-5)


def test_the_critic_trains_under_an_attention_that_nans_empty_rows(tiny):
    batch = _batch(tiny.config.vocab_size)
    grads = {}
    for impl in ("sdpa", CUDNN_LIKE):
        torch.manual_seed(0)
        vm = value_model_from_causal_lm(_with_attention(tiny, impl))
        eng = ValueTrainEngine(vm, TrainEngineConfig(lr=1e-3, micro_batch_size=4))
        m = eng.train_step(batch, lambda mb, v, _: (torch.where(mb["response_mask"], v, 0.0).square()
                                                      .sum(), {}), 1.0)
        grads[impl] = m
    assert grads[CUDNN_LIKE]["skipped"] == 0.0
    assert grads[CUDNN_LIKE]["grad_norm"] == pytest.approx(grads["sdpa"]["grad_norm"], rel=1e-6)


def test_left_align_rotates_each_row_by_its_padding():
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]]).bool()
    new_ids, new_mask = left_align(ids, mask, torch.tensor([2, 0]))
    assert new_ids.tolist() == [[5, 6, 7, 0, 0], [8, 9, 10, 11, 0]]
    assert new_mask.tolist() == [[True, True, True, False, False], [True, True, True, True, False]]


def test_entropy_of_a_row_with_minus_inf_logits_is_finite_with_finite_gradients():
    """A -inf logit (vocabulary mask, top-k filtering) has p = 0; its entropy term is 0, not NaN
    (0·(−inf)), in the plain and the fused chunked path, forward and backward."""
    from flowrl.algorithms.logprobs import entropy_from_logits, linear_logprobs

    logits = torch.tensor([[[0.0, 0.0, -torch.inf, -torch.inf]]], requires_grad=True)
    ent = entropy_from_logits(logits)
    assert ent.item() == pytest.approx(0.6931471805599453)  # ln 2: two equally likely tokens
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()
    hidden = torch.tensor([[1.0, 0.0]], requires_grad=True)
    weight = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.3, 0.0], [0.5, 0.0]], requires_grad=True)
    bias = torch.tensor([0.0, 0.0, -torch.inf, -torch.inf])  # the same logits as above
    lp, ent = linear_logprobs(hidden, weight, torch.tensor([0]), bias=bias, with_entropy=True)
    assert ent.item() == pytest.approx(0.6931471805599453)
    assert torch.isfinite(ent).all() and torch.isfinite(lp).all()
    (lp + ent).sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
