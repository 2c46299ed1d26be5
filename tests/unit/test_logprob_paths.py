"""The train engine's fast forward paths equal the plain one (fp32, CPU, within 1e-5).

Paths: plain (full (b, R, V) logits, then ``token_logprobs``), chunked (fused LM head + fp32
log-softmax over chunks, ``linear_logprobs``), packed (padding-free one-row micro-batches with
per-sequence position ids), packed + chunked. Compared on logprobs, entropy, loss, gradients of
every parameter and the train_step metrics (loss, grad norm), on tiny random Llama (RoPE, GQA, untied head)
and GPT-2 (absolute positions, tied head) with left padding, ragged lengths, T != 1 and chunk
sizes that do not divide the token count.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from flowrl.algorithms.logprobs import entropy_from_logits, linear_logprobs, token_logprobs
from flowrl.algorithms.packing import pack, packable, unpack
from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.models.loading import ModelConfig, build_tiny, tiny_model_config

TOL = dict(atol=1e-5, rtol=1e-5)
PATHS = {  # name -> (logprob_chunk_size, padding_free)
    "plain": (None, "false"),
    "chunked": (7, "false"),
    "packed": (None, "true"),
    "packed_chunked": (5, "true"),
}


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny(request):
    # a 1k vocabulary keeps the 16 forward/backward passes fast (the paths do not depend on V)
    return build_tiny(ModelConfig(tiny={**tiny_model_config(request.param), "vocab_size": 1024}),
                      torch.float32)


def ragged_batch(vocab: int) -> dict:
    """Left-padded prompts of 1..4 tokens, right-padded responses of 0..6 tokens (one row has no
    valid response token, as a lockstep dummy micro-batch), 20 valid response tokens in all."""
    g = torch.Generator().manual_seed(0)
    p_len, r_len = [4, 2, 1, 3, 4], [6, 3, 6, 0, 5]
    p_mask = torch.tensor([[i >= 4 - n for i in range(4)] for n in p_len])
    r_mask = torch.tensor([[i < n for i in range(6)] for n in r_len])
    adv = torch.tensor([1.0, -0.5, 2.0, 0.3, -1.5])[:, None].expand(5, 6).clone()
    return dict(prompt_ids=torch.randint(3, vocab, (5, 4), generator=g), prompt_mask=p_mask,
                response_ids=torch.randint(3, vocab, (5, 6), generator=g), response_mask=r_mask,
                advantages=adv)


def loss_fn_of(batch: dict):
    """PG token-mean loss with an entropy bonus (both terms carry gradient)."""
    denom = batch["response_mask"].sum()

    def loss_fn(mb, lp, ent):
        m = mb["response_mask"]
        pg = -(lp * mb["advantages"] * m).sum() / denom
        ent_term = -0.1 * (ent * m).sum() / denom
        return pg + ent_term, {"pg_loss": pg.item(), "entropy": ((ent * m).sum() / denom).item()}
    return loss_fn


def engine(model, path: str, **cfg) -> LocalTrainEngine:
    chunk, pf = PATHS[path]
    return LocalTrainEngine(copy.deepcopy(model), TrainEngineConfig(
        lr=1e-3, logprob_chunk_size=chunk, padding_free=pf, **cfg))


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_paths_give_the_same_logprobs_entropy_loss_and_grads(tiny, temperature):
    batch = ragged_batch(tiny.config.vocab_size)
    loss_fn = loss_fn_of(batch)
    out = {}
    for path in PATHS:
        eng = engine(tiny, path, micro_batch_size=2)
        assert eng._padding_free == (PATHS[path][1] == "true")
        assert (eng._head is not None) == (PATHS[path][0] is not None)
        old = eng.logprobs(batch, temperature, with_entropy=True)
        # one micro-batch by hand: gradients of every parameter
        lp, ent = eng._logprobs(batch, temperature, with_entropy=True, entropy_grad=True)
        loss, _ = loss_fn(batch, lp, ent)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in eng.model.named_parameters()}
        eng.optimizer.zero_grad(set_to_none=True)
        metrics = eng.train_step(batch, loss_fn, temperature, with_entropy=True)
        # (weights after the step are not compared: AdamW's first step is about lr * sign(grad),
        # so a gradient within 1e-9 of 0 may flip sign between two float summation orders)
        out[path] = dict(old=old, lp=lp.detach(), ent=ent.detach(), loss=loss.item(), grads=grads,
                         metrics=metrics)
    ref = out["plain"]
    mask = batch["response_mask"]
    assert (ref["old"].logprobs[~mask] == 0).all() and (ref["old"].logprobs[mask] < 0).all()
    assert ref["old"].entropy.shape == (5, 6) and ref["metrics"]["grad_norm"] > 0
    for path, o in out.items():
        torch.testing.assert_close(o["old"].logprobs, ref["old"].logprobs, **TOL, msg=path)
        torch.testing.assert_close(o["old"].entropy, ref["old"].entropy, **TOL, msg=path)
        torch.testing.assert_close(o["lp"], ref["lp"], **TOL, msg=path)
        torch.testing.assert_close(o["ent"], ref["ent"], **TOL, msg=path)
        assert o["loss"] == pytest.approx(ref["loss"], abs=1e-5), path
        for n, g in ref["grads"].items():
            torch.testing.assert_close(o["grads"][n], g, **TOL, msg=f"{path} {n}")
        for k in ("loss", "grad_norm", "pg_loss", "entropy"):
            assert o["metrics"][k] == pytest.approx(ref["metrics"][k], abs=1e-5), (path, k)


def test_entropy_as_metric_has_no_graph(tiny):
    batch = ragged_batch(tiny.config.vocab_size)
    for path in PATHS:
        eng = engine(tiny, path)
        lp, ent = eng._logprobs(batch, 1.0, with_entropy=True, entropy_grad=False)
        assert lp.requires_grad and not ent.requires_grad, path


class _OutputShapes(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[torch.Size] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append(t.shape)
        return out


def _max_vocab_rows(eng, batch, vocab: int) -> int:
    """Most token rows of any (…, V) tensor created in a forward + backward of one micro-batch
    (the (H, V) transposed LM-head weight and its gradient are not token rows)."""
    weight_t = torch.Size([eng.model.config.hidden_size if hasattr(eng.model.config, "hidden_size")
                           else eng.model.config.n_embd, vocab])
    with _OutputShapes() as rec:
        lp, ent = eng._logprobs(batch, 0.7, with_entropy=True, entropy_grad=True)
        loss_fn_of(batch)(batch, lp, ent)[0].backward()
    return max(math.prod(s[:-1]) for s in rec.shapes if len(s) and s[-1] == vocab and s != weight_t)


def test_chunked_path_never_holds_more_than_a_chunk_of_logits(tiny):
    """Structural peak-memory check (CPU has no reliable allocator peak): no (…, V) tensor of more
    than ``logprob_chunk_size`` token rows exists at any point, in forward or backward. The model's
    own LM head still runs on one position per row (5 rows here)."""
    batch = ragged_batch(tiny.config.vocab_size)
    V = tiny.config.vocab_size
    assert _max_vocab_rows(engine(tiny, "chunked"), batch, V) == 7
    assert _max_vocab_rows(engine(tiny, "packed_chunked"), batch, V) == 5
    # the check has teeth: the plain path holds (b, R, V) = 5 x 6 rows, the packed one N = 20 rows
    assert _max_vocab_rows(engine(tiny, "plain"), batch, V) >= 30
    assert _max_vocab_rows(engine(tiny, "packed"), batch, V) == 20


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_linear_logprobs_matches_logits_path_with_bias(temperature):
    torch.manual_seed(0)
    N, H, V = 23, 16, 40
    h, w, b = torch.randn(N, H), torch.randn(V, H) * 0.3, torch.randn(V)
    y = torch.randint(0, V, (N,))
    g_lp, g_ent = torch.randn(N), torch.randn(N)
    grads = []
    for fused in (True, False):
        hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
        if fused:
            lp, ent = linear_logprobs(hh, ww, y, temperature, bias=bb, chunk_size=6,
                                      with_entropy=True)
        else:
            logits = torch.nn.functional.linear(hh, ww, bb)
            lp, ent = token_logprobs(logits, y, temperature), entropy_from_logits(logits, temperature)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        grads.append((lp.detach(), ent.detach(), hh.grad, ww.grad, bb.grad))
    for a, b_ in zip(*grads):
        torch.testing.assert_close(a, b_, **TOL)
    # C08 through the fused head: vocabulary of 2, logits [2, 0], T = 0.5, token 0
    lp, ent = linear_logprobs(torch.tensor([[1.0]]), torch.tensor([[2.0], [0.0]]),
                              torch.tensor([0]), 0.5, with_entropy=True)
    assert lp.item() == pytest.approx(-0.018150, abs=1e-6)
    assert ent.item() == pytest.approx(0.090095, abs=1e-6)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_logprobs(h, w, y, chunk_size=0)


@pytest.mark.slow
def test_compiled_chunk_math_matches_eager():
    """``logprob_compile``: the same per-chunk math through torch.compile (~30 s on CPU)."""
    torch.manual_seed(0)
    h, w, y = torch.randn(37, 16), torch.randn(50, 16), torch.randint(0, 50, (37,))
    res = []
    for compile_ in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = linear_logprobs(hh, ww, y, 0.7, chunk_size=10, with_entropy=True,
                                  compile=compile_)
        (lp.sum() + 0.3 * ent.sum()).backward()
        res.append((lp.detach(), ent.detach(), hh.grad, ww.grad))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, **TOL)


def test_pack_layout_and_unpack():
    p_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 0, 0, 11]])
    p_mask = p_ids != 0
    r_ids = torch.tensor([[20, 21, 0], [22, 0, 0], [23, 24, 25]])
    r_mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    assert packable(p_mask, r_mask)
    pk = pack(p_ids, p_mask, r_ids, r_mask)
    assert pk.input_ids.tolist() == [[5, 6, 20, 21, 7, 8, 9, 10, 11, 23, 24, 25]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]]
    # predictors: 20 <- 6, 21 <- 20, 23 <- 11, 24 <- 23, 25 <- 24
    assert pk.predictor_index.tolist() == [1, 2, 8, 9, 10]
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert unpack(vals, r_mask).tolist() == [[1, 2, 0], [0, 0, 0], [3, 4, 5]]
    # a hole inside a response (a multi-turn row: environment tokens, mask False) is attended
    # context: packed with its row, only the valid tokens get predictors
    hole = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    assert packable(p_mask, hole)
    pk = pack(p_ids, p_mask, r_ids, hole)
    assert pk.input_ids.tolist() == [[5, 6, 20, 21, 0, 7, 8, 9, 10, 11, 23, 24, 25]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert pk.predictor_index.tolist() == [1, 3, 9, 10, 11]  # 20 <- 6, 0 <- 21, 23 <- 11, ...
    # a hole inside a prompt, or a response after an all-pad prompt, stays padded
    assert not packable(torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]], dtype=torch.bool),
                        r_mask)
    assert not packable(torch.tensor([[0, 0, 0, 0]], dtype=torch.bool), torch.tensor([[True]]))
    assert packable(torch.tensor([[0, 0, 0, 0]], dtype=torch.bool), torch.tensor([[False]]))


def test_response_hole_is_context_in_every_layout(tiny):
    """A hole in a response mask (multi-turn: environment tokens between policy turns) is not
    scored but still attended: packed and padded layouts agree."""
    batch = ragged_batch(tiny.config.vocab_size)
    batch["response_mask"] = batch["response_mask"].clone()
    batch["response_mask"][0, 2] = False
    ref = engine(tiny, "plain").logprobs(batch, 1.0).logprobs
    assert ref[0, 2] == 0
    eng = engine(tiny, "packed_chunked")
    assert eng._model_inputs(batch)[2]  # packed
    torch.testing.assert_close(eng.logprobs(batch, 1.0).logprobs, ref, **TOL)
    # a hole in a prompt cannot be packed: padded layout, same numbers as the plain engine
    batch["prompt_mask"] = batch["prompt_mask"].clone()
    row = int(batch["prompt_mask"][1].nonzero()[1])  # the second real prompt token of row 1
    batch["prompt_mask"][1, row] = False
    assert not eng._model_inputs(batch)[2]
    torch.testing.assert_close(eng.logprobs(batch, 1.0).logprobs,
                               engine(tiny, "plain").logprobs(batch, 1.0).logprobs, **TOL)


def test_softcapped_head_falls_back_to_plain_path(caplog):
    """Gemma-2 caps logits after the LM head: the one-position check sees it and the engine keeps
    the model's own logits from then on."""
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, final_logit_softcapping=2.0)
    model = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)  # logits of a few units: the cap at 2 bites
    batch = ragged_batch(64)
    ref = engine(model, "plain").logprobs(batch, 0.7, with_entropy=True)
    eng = engine(model, "chunked")
    assert eng._head is not None
    out = eng.logprobs(batch, 0.7, with_entropy=True)
    assert eng._head is None and "plain logprob path" in caplog.text
    torch.testing.assert_close(out.logprobs, ref.logprobs, **TOL)
    torch.testing.assert_close(out.entropy, ref.entropy, **TOL)


def test_padding_free_config():
    assert TrainEngineConfig().padding_free == "auto"
    assert TrainEngineConfig(padding_free=True).padding_free == "true"
    assert TrainEngineConfig(padding_free="False").padding_free == "false"  # OmegaConf's str(bool)
    with pytest.raises(ValueError, match="padding_free"):
        TrainEngineConfig(padding_free="yes")
    with pytest.raises(ValueError, match="logprob_chunk_size"):
        TrainEngineConfig(logprob_chunk_size=0)
    tiny = build_tiny(ModelConfig(tiny=tiny_model_config("llama")), torch.float32)
    # auto on CPU: off (and off for sdpa on CUDA: a dense (T, T) mask over the packed row)
    assert not LocalTrainEngine(tiny, TrainEngineConfig(), trainable=False)._padding_free

    class NotHF(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None):
            raise AssertionError

    assert not LocalTrainEngine(NotHF(), TrainEngineConfig(), trainable=False)._padding_free
    with pytest.raises(ValueError, match="transformers model"):
        LocalTrainEngine(NotHF(), TrainEngineConfig(padding_free="true"), trainable=False)
