"""HF rollout engine and local train engine on tiny models (cases C04, C08, C09 + engine contracts)."""
from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import nn

from flowrl.engines.base import SamplingConfig
from flowrl.engines.config import HFRolloutConfig, TrainEngineConfig
from flowrl.engines.rollout.hf import HFRolloutEngine
from flowrl.engines.train.local import LocalTrainEngine

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "flowrl/models/assets/smollm2-tokenizer"
EOS = 2  # <|im_end|>: both EOS and pad of the SmolLM2 tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    assert tok.eos_token_id == EOS and tok.pad_token_id == EOS
    return tok


def tiny_llama(seed: int = 0, vocab: int = 512) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, bos_token_id=1, eos_token_id=EOS,
                                   pad_token_id=EOS)
    return transformers.LlamaForCausalLM(cfg)


class FixedLogits(nn.Module):
    """Causal-LM stand-in: logits = table[current token] at every position (HF-style output)."""

    def __init__(self, table: torch.Tensor, trainable: bool = False) -> None:
        super().__init__()
        self.table = nn.Parameter(table.clone(), requires_grad=trainable)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return SimpleNamespace(logits=self.table[input_ids])


PROMPTS = torch.tensor([[EOS, EOS, 5, 6], [7, 8, 9, 10], [EOS, EOS, EOS, 11]])
PROMPT_MASK = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)


def batch_of(rb, prompts=PROMPTS, mask=PROMPT_MASK) -> dict:
    return dict(prompt_ids=prompts, prompt_mask=mask, response_ids=rb.response_ids,
                response_mask=rb.response_mask)


# ---------------------------------------------------------------- C08 / C09 through the engine
def test_c08_temperature_in_recomputed_logprobs():
    eng = LocalTrainEngine(FixedLogits(torch.tensor([[2.0, 0.0], [2.0, 0.0]])), trainable=False)
    batch = dict(prompt_ids=torch.tensor([[1]]), prompt_mask=torch.tensor([[True]]),
                 response_ids=torch.tensor([[0]]), response_mask=torch.tensor([[True]]))
    out = eng.logprobs(batch, temperature=0.5, with_entropy=True)
    assert out.logprobs.dtype == torch.float32
    assert out.logprobs.item() == pytest.approx(-0.018150, abs=1e-6)
    assert out.entropy.item() == pytest.approx(0.090095, abs=1e-6)
    assert eng.logprobs(batch, 1.0).logprobs.item() == pytest.approx(-0.126928, abs=1e-6)


def test_c09_bigram_shift():
    rows = torch.tensor([[0.1, 0.7, 0.2], [0.3, 0.3, 0.4], [0.5, 0.1, 0.4]])
    eng = LocalTrainEngine(FixedLogits(rows.log()), trainable=False)
    batch = dict(prompt_ids=torch.tensor([[0]]), prompt_mask=torch.tensor([[True]]),
                 response_ids=torch.tensor([[1, 2]]), response_mask=torch.tensor([[True, True]]))
    lp = eng.logprobs(batch, 1.0).logprobs
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.7), math.log(0.4)]]))
    assert lp.sum().item() == pytest.approx(-1.2730, abs=1e-4)


def test_c09_left_padding_absolute_positions_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=16, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(cfg)
    eng = LocalTrainEngine(model, TrainEngineConfig(lr=1e-3), trainable=True)
    resp = dict(response_ids=torch.tensor([[1, 2]]), response_mask=torch.tensor([[True, True]]))
    plain = dict(prompt_ids=torch.tensor([[0]]), prompt_mask=torch.tensor([[True]]), **resp)
    padded = dict(prompt_ids=torch.tensor([[7, 7, 0]]),
                  prompt_mask=torch.tensor([[False, False, True]]), **resp)
    lp_plain = eng.logprobs(plain, 1.0).logprobs
    lp_padded = eng.logprobs(padded, 1.0).logprobs
    assert (lp_plain - lp_padded).abs().max().item() < 1e-5
    # the check has teeth: positions counted from the pads shift GPT-2's absolute embeddings
    with torch.no_grad():
        naive = model(input_ids=torch.tensor([[7, 7, 0, 1, 2]]),
                      attention_mask=torch.tensor([[0, 0, 1, 1, 1]])).logits
    naive_lp = torch.log_softmax(naive[0, 2:4], -1).gather(-1, torch.tensor([[1], [2]])).T
    assert (naive_lp - lp_plain).abs().max().item() > 1e-3
    # step-0 PPO ratio exactly 1: the train-mode forward (dropout disabled) equals old logprobs
    ratios = []

    def loss_fn(mb, lp, ent):
        ratios.append(torch.exp(lp - lp_padded).detach())
        return -(lp * mb["response_mask"]).sum() / 2, {}

    eng.train_step(padded, loss_fn, 1.0)
    assert torch.equal(ratios[0], torch.ones(1, 2))


# ---------------------------------------------------------------- rollout engine
def test_rollout_logprobs_match_trainer(tokenizer):
    model = tiny_llama()
    train = LocalTrainEngine(model, TrainEngineConfig(micro_batch_size=2))
    roll = HFRolloutEngine(model, tokenizer, HFRolloutConfig(batch_size=2), shared=True)
    params = SamplingConfig(temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=12)
    rb = roll.generate(PROMPTS, PROMPT_MASK, params, torch.Generator().manual_seed(1))
    assert rb.response_ids.shape == (3, 12) and rb.rollout_logprobs.dtype == torch.float32
    assert model.training  # train mode restored after generate
    old = train.logprobs(batch_of(rb), temperature=0.7, with_entropy=True)
    assert (old.logprobs - rb.rollout_logprobs).abs().max().item() < 1e-4
    assert torch.equal(old.logprobs == 0, ~rb.response_mask)
    # scoring at the wrong temperature is visibly different (the check is sensitive)
    assert (train.logprobs(batch_of(rb), 1.0).logprobs - rb.rollout_logprobs).abs().max() > 1e-2


def test_rollout_seeding_is_reproducible_and_leaves_global_rng(tokenizer):
    roll = HFRolloutEngine(tiny_llama(), tokenizer, HFRolloutConfig(batch_size=4))
    params = SamplingConfig(temperature=1.0, max_new_tokens=8)
    state = torch.get_rng_state()
    a = roll.generate(PROMPTS, PROMPT_MASK, params, torch.Generator().manual_seed(3))
    b = roll.generate(PROMPTS, PROMPT_MASK, params, torch.Generator().manual_seed(3))
    c = roll.generate(PROMPTS, PROMPT_MASK, params, torch.Generator().manual_seed(4))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_rollout_mask_and_truncation_with_pad_equal_eos(tokenizer):
    model = tiny_llama(seed=0)
    with torch.no_grad():  # make EOS the greedy choice in some contexts only
        model.lm_head.weight[EOS] *= 5.0
    roll = HFRolloutEngine(model, tokenizer, HFRolloutConfig())
    prompts = torch.tensor([[EOS, 5, 6], [7, 8, 9], [EOS, EOS, 11], [EOS, 30, 31]])
    pmask = prompts != EOS  # fine here: no EOS inside these prompts' text
    pmask[1] = True
    rb = roll.generate(prompts, pmask, SamplingConfig(temperature=0.0, max_new_tokens=6))
    ids, mask = rb.response_ids, rb.response_mask
    R = ids.shape[1]
    stopped = 0
    for row in range(len(prompts)):
        hits = (ids[row] == EOS).nonzero().flatten().tolist()
        n = hits[0] + 1 if hits else R
        assert mask[row].tolist() == [True] * n + [False] * (R - n)
        assert bool(rb.truncated[row]) == (not hits)
        assert ids[row, n:].tolist() == [EOS] * (R - n)  # right-padded with pad (= eos)
        assert (rb.rollout_logprobs[row, n:] == 0).all() and (rb.rollout_logprobs[row, :n] < 0).all()
        stopped += bool(hits)
    # rows 0-1 hit max_new_tokens; row 2 is C04's shape [x, EOS, EOS, ...] → mask [1, 1, 0, ...];
    # the real EOS is kept in the mask (a mask from `ids != pad` would drop it)
    assert mask.sum(1).tolist() == [6, 6, 2, 1] and rb.truncated.tolist() == [True, True, False, False]
    assert ids[2, 0] != EOS and ids[2, 1:].tolist() == [EOS] * 5
    assert ((ids == EOS) & mask).sum().item() == stopped
    # each row equals its own unbatched greedy run (left padding changes nothing)
    for row in range(len(prompts)):
        keep = pmask[row]
        one = roll.generate(prompts[row:row + 1, keep], pmask[row:row + 1, keep],
                            SamplingConfig(temperature=0.0, max_new_tokens=6))
        n = one.response_ids.shape[1]
        assert torch.equal(one.response_ids[0], ids[row, :n])


def test_load_weights_copy_and_zero_copy(tokenizer):
    actor = tiny_llama(seed=0)
    train = LocalTrainEngine(actor, TrainEngineConfig())
    shared = HFRolloutEngine(actor, tokenizer, shared=True)
    separate = HFRolloutEngine(tiny_llama(seed=1), tokenizer)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    want = shared.generate(PROMPTS, PROMPT_MASK, greedy).response_ids
    assert not torch.equal(separate.generate(PROMPTS, PROMPT_MASK, greedy).response_ids, want)
    n_params = len(list(actor.named_parameters()))
    separate.load_weights(train.named_weights())
    assert separate.last_load_counts == {"copied": n_params, "shared": 0}
    assert torch.equal(separate.generate(PROMPTS, PROMPT_MASK, greedy).response_ids, want)
    shared.load_weights(train.named_weights())
    assert shared.last_load_counts == {"copied": 0, "shared": n_params}
    for eng in (shared, separate):
        eng.offload()
        eng.onload()
        assert set(eng.last_timings) == {"onload_s"}
    with pytest.raises(KeyError, match="nope"):
        separate.load_weights([("nope", torch.zeros(1))])


# ---------------------------------------------------------------- train engine
def _train_batch(vocab: int = 512) -> dict:
    g = torch.Generator().manual_seed(0)
    resp_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]],
                             dtype=torch.bool)
    return dict(prompt_ids=torch.randint(3, vocab, (4, 3), generator=g),
                prompt_mask=torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1]], dtype=torch.bool),
                response_ids=torch.randint(3, vocab, (4, 5), generator=g), response_mask=resp_mask,
                advantages=torch.tensor([1.0, -1.0, 0.5, 2.0]).unsqueeze(1).expand(4, 5).clone())


def token_mean_loss(batch: dict):
    """Policy-gradient token-mean loss with the *global* valid-token count as denominator."""
    denom = batch["response_mask"].sum()

    def loss_fn(mb, lp, ent):
        loss = -(lp * mb["advantages"] * mb["response_mask"]).sum() / denom
        return loss, {"pg_loss": loss.item()}
    return loss_fn


def test_gradient_accumulation_sums_micro_batches():
    batch = _train_batch()
    weights = []
    for mbs in (1, 4):
        eng = LocalTrainEngine(tiny_llama(), TrainEngineConfig(lr=1e-4, micro_batch_size=mbs))
        m = eng.train_step(batch, token_mean_loss(batch), temperature=1.0)
        assert m["skipped"] == 0.0 and m["lr"] == 1e-4 and m["grad_norm"] > 0
        # the step's time breakdown: 4 rows cut into micro-batches of mbs, parts non-negative
        assert m["perf/update/micro_batches"] == 4 / mbs
        assert min(m[f"perf/update/{k}_s"] for k in ("prepare", "fwd_bwd", "optimizer")) >= 0
        weights.append((m, [p.detach().clone() for p in eng.model.parameters()]))
    (m1, w1), (m4, w4) = weights
    assert m1["loss"] == pytest.approx(m4["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m4["grad_norm"], rel=1e-5)
    assert max((a - b).abs().max().item() for a, b in zip(w1, w4)) < 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(w1, tiny_llama().parameters())) > 1e-5


@pytest.mark.parametrize("fault", ["nan_loss", "inf_grad"])
def test_non_finite_step_is_skipped(fault, caplog):
    batch = _train_batch()
    eng = LocalTrainEngine(tiny_llama(), TrainEngineConfig(lr=1e-3, micro_batch_size=2))
    before = [p.detach().clone() for p in eng.model.parameters()]
    base = token_mean_loss(batch)
    if fault == "nan_loss":
        def loss_fn(mb, lp, ent):
            loss, m = base(mb, lp, ent)
            return loss * float("nan"), m
    else:
        loss_fn = base
        hook = eng.model.lm_head.weight.register_hook(lambda g: g * float("inf"))
    m = eng.train_step(batch, loss_fn, 1.0)
    assert m["skipped"] == 1.0 and "skipping the optimizer step" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, eng.model.parameters()))
    assert all(p.grad is None for p in eng.model.parameters())
    assert all(st["step"].item() == 0 for st in eng.optimizer.state.values())
    assert eng.scheduler.last_epoch == 0
    if fault == "inf_grad":
        hook.remove()
    assert eng.train_step(batch, base, 1.0)["skipped"] == 0.0


def test_state_dict_round_trip_continues_identically():
    batch = _train_batch()
    loss_fn = token_mean_loss(batch)
    cfg = TrainEngineConfig(lr=1e-3, micro_batch_size=2, lr_scheduler="linear", warmup_steps=1,
                            total_steps=4, weight_decay=0.1)
    a = LocalTrainEngine(tiny_llama(), cfg)
    a.state_dict()  # a checkpoint before the first step must not perturb AdamW's step count
    untouched = LocalTrainEngine(tiny_llama(), cfg)
    for eng in (a, untouched):
        eng.train_step(batch, loss_fn, 1.0)
    saved = copy.deepcopy(a.state_dict())
    assert set(saved) == {"model", "optimizer", "scheduler"}
    b = LocalTrainEngine(tiny_llama(seed=7), cfg)
    b.load_state_dict(copy.deepcopy(saved))
    for _ in range(2):
        ma, mb_, mu = (e.train_step(batch, loss_fn, 1.0) for e in (a, b, untouched))
        assert ma["lr"] == mb_["lr"] == mu["lr"]
    for pa, pb, pu in zip(a.model.parameters(), b.model.parameters(), untouched.model.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pu)
    # scheduler position restored: 3rd step of linear(warmup 1, total 4) uses lr * (4 - 2) / (4 - 1)
    assert ma["lr"] == pytest.approx(1e-3 * 2 / 3, rel=1e-12)


def test_frozen_engine_and_timings():
    ref = LocalTrainEngine(tiny_llama(), trainable=False)
    assert ref.optimizer is None and not ref.model.training
    assert not any(p.requires_grad for p in ref.model.parameters())
    with pytest.raises(RuntimeError, match="frozen"):
        ref.train_step(_train_batch(), token_mean_loss(_train_batch()), 1.0)
    ref.offload()
    ref.onload()
    assert set(ref.last_timings) == {"onload_s"}


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="total_steps"):
        TrainEngineConfig(lr_scheduler="cosine")
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainEngineConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match="rollout.hf.cache_implementation=static"):
        HFRolloutConfig(compile=True, cache_implementation="dynamic")
    # compile needs the static cache: an unset cache kind means static
    assert HFRolloutConfig(compile=True).cache_implementation == "static"
    with pytest.raises(ValueError, match="batch_size"):
        HFRolloutConfig(batch_size=0)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 0.0])
def test_logprob_recorder_equals_token_logprobs_bit_for_bit(temperature):
    """The recorder splits token_logprobs over two decoding steps (scores / T and their logsumexp
    at step t, the pick at t+1) and keeps no copy of the scores: same values, bit for bit, and
    an in-place change of the scores after the recorder (a later processor) changes nothing."""
    from flowrl.algorithms.logprobs import token_logprobs
    from flowrl.engines.rollout.hf import _LogprobRecorder

    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(3, 50, generator=g) * 4 for _ in range(4)]
    tokens = torch.randint(0, 50, (3, 4), generator=g)
    rec = _LogprobRecorder(temperature)
    for t, scores in enumerate(steps):
        ids = tokens[:, :t] if t else torch.zeros(3, 1, dtype=torch.long)
        rec(ids, scores.clone()).mul_(0.0)  # the copy of a later in-place processor
    got = rec.finish(tokens)
    want = token_logprobs(torch.stack(steps, 1), tokens, temperature)
    assert torch.equal(got, want)


def test_padded_token_budget_bins_and_a_row_over_it_warns_once(caplog):
    """Padded micro-batches fit max_tokens_per_micro_batch in padded positions; a row longer than
    the budget runs alone and is said once; the step equals the row-wise one."""
    batch = _train_batch()
    lengths = (batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)).tolist()
    ref = LocalTrainEngine(tiny_llama(), TrainEngineConfig(lr=1e-4, micro_batch_size=1))
    m_ref = ref.train_step(batch, token_mean_loss(batch), temperature=1.0)
    eng = LocalTrainEngine(tiny_llama(), TrainEngineConfig(lr=1e-4, max_tokens_per_micro_batch=2))
    with caplog.at_level("WARNING"):
        m = eng.train_step(batch, token_mean_loss(batch), temperature=1.0)
        eng._partitions(batch)
    said = [r.getMessage() for r in caplog.records if "max_tokens_per_micro_batch=2" in r.getMessage()]
    assert said == [f"trainer.engine.max_tokens_per_micro_batch=2 is below the longest row "
                    f"({max(lengths)} tokens): each such row runs as a micro-batch of its own, "
                    "over the budget"]
    assert m["perf/update/micro_batches"] == 4
    assert m["loss"] == pytest.approx(m_ref["loss"], abs=1e-6)
    assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
    # budget 16 padded positions: rows (prompt, response) (3,3) (2,1) (1,5) (3,2) -> [0, 2] runs
    # 2 x (3 + 5) = 16, [1, 3] runs 2 x (3 + 2) = 10
    eng16 = LocalTrainEngine(tiny_llama(), TrainEngineConfig(lr=1e-4, max_tokens_per_micro_batch=16))
    assert eng16._partitions(batch) == [[0, 2], [1, 3]]
    m16 = eng16.train_step(batch, token_mean_loss(batch), temperature=1.0)
    assert m16["perf/update/micro_batches"] == 2
    assert m16["loss"] == pytest.approx(m_ref["loss"], abs=1e-6)
    assert m16["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
