"""``rollout.hf.compile``: the default (off, and why), the cache bucket that keeps one compiled shape, and
that the padded prompts generate what the unpadded ones do.

transformers compiles only on accelerators, so the CPU tests check the padding and the choice; the
slow test below forces transformers' compile on CPU (its device check patched) to show that the
bucket keeps one compiled graph over calls of different prompt lengths, where the unbucketed calls
compile twice. The GPU tier (tests/gpu/test_hf_compile_gpu.py) runs the real thing.
"""
from __future__ import annotations

import logging

import pytest
import torch
import transformers
from test_engines import EOS, TOKENIZER_DIR, tiny_llama

from flowrl.engines.base import SamplingConfig
from flowrl.engines.config import HF_CACHE_BUCKET, HFRolloutConfig
from flowrl.engines.rollout import build_rollout_engine
from flowrl.engines.rollout import hf as hf_engine
from flowrl.engines.rollout.hf import HFRolloutEngine, pad_to_cache_bucket
from flowrl.engines.rollout.vllm_config import RolloutJob

LONG = RolloutJob(seqs_per_step=256, decode_steps=1_000_000)
SHORT = RolloutJob(seqs_per_step=256, decode_steps=100)


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_pad_to_cache_bucket_left_pads_to_the_next_multiple():
    ids = torch.tensor([[EOS, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[False, True, True], [True, True, True]])
    # 3 + 5 = 8: already a multiple of 8, the inputs come back as they are
    same = pad_to_cache_bucket(ids, mask, max_new_tokens=5, pad_token_id=0, bucket=8)
    assert same[0] is ids and same[1] is mask
    # 3 + 6 = 9 -> 16: seven pad columns on the left, masked out
    p_ids, p_mask = pad_to_cache_bucket(ids, mask, max_new_tokens=6, pad_token_id=0, bucket=8)
    assert p_ids.tolist() == [[0] * 7 + [EOS, 5, 6], [0] * 7 + [7, 8, 9]]
    assert p_mask.tolist() == [[False] * 8 + [True, True], [False] * 7 + [True] * 3]
    # the default bucket: a 100-token prompt with 256 new tokens fills a 512-token cache
    wide = pad_to_cache_bucket(torch.ones(1, 100, dtype=torch.long), torch.ones(1, 100, dtype=torch.bool),
                               256, 0)
    assert HF_CACHE_BUCKET == 256 and wide[0].shape == (1, 512 - 256)


@pytest.mark.parametrize("on_cuda, job, cache, expected_cache, why", [
    # off on the GPU however long the job: compiled, it measured slower than eager in the loop
    (True, LONG, None, None, "measured slower than eager inside the training loop on the H200"),
    (True, SHORT, None, None, "measured slower than eager inside the training loop on the H200"),
    (True, LONG, "static", "static", "measured slower than eager"),  # the user's cache is kept
    (False, LONG, None, None, "not on CUDA: transformers compiles only on accelerators"),
])
def test_compile_defaults_to_off_and_says_why(on_cuda, job, cache, expected_cache, why):
    cfg, reasons = HFRolloutConfig(cache_implementation=cache).sized_for(job, on_cuda)
    assert (cfg.compile, cfg.cache_implementation) == (False, expected_cache)
    assert len(reasons) == 1 and reasons[0].startswith(f"rollout.hf.compile=false ({why}")


def test_explicit_compile_wins_and_says_nothing():
    for value, on_cuda in ((True, True), (False, True), (False, False)):
        cfg = HFRolloutConfig(compile=value)
        assert cfg.sized_for(LONG, on_cuda=on_cuda) == (cfg, [])


def test_explicit_compile_off_the_gpu_is_turned_off_and_says_why():
    """transformers does not compile on CPU: compile=true would only pad prompts for a static
    cache (2-3x slower steps on CPU in the fresh-user check)."""
    cfg, why = HFRolloutConfig(compile=True, batch_size=8).sized_for(LONG, on_cuda=False)
    assert cfg == HFRolloutConfig(compile=False, batch_size=8)
    assert why == ["rollout.hf.compile=false (true has no effect off the GPU, where transformers "
                   "does not compile; eager decoding runs with the default cache instead of the "
                   "padded static one compiling needs, which was 2-3x slower on CPU)"]


def test_the_builder_resolves_and_prints_compile(tokenizer, caplog):
    rollout_cfg = type("R", (), {"backend": "hf", "hf": HFRolloutConfig()})()
    with caplog.at_level(logging.INFO, logger="flowrl"):
        eng = build_rollout_engine(rollout_cfg, tiny_llama(), tokenizer, job=LONG)
    assert eng.cfg.compile is False  # a CPU model
    assert "resolved rollout.hf.compile=false (not on CUDA" in caplog.text


def _prompts(P: int, B: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.bool)
    mask[0, : P // 2] = False  # a shorter, left-padded row
    ids[~mask] = EOS
    return ids, mask


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bucketed_prompts_generate_what_unpadded_ones_do(tokenizer, temperature):
    """compile=True on CPU: transformers runs eager, so only the bucket padding differs from the
    plain static cache: the same tokens (greedy, and sampled from one seed) and logprobs."""
    model = tiny_llama()
    ids, mask = _prompts(P=11)
    params = SamplingConfig(temperature=temperature, max_new_tokens=7)
    outs = []
    for compile_ in (False, True):
        # batch_size = the rows: no row fill (it would draw other samples), the bucket alone
        eng = HFRolloutEngine(model, tokenizer, HFRolloutConfig(
            batch_size=3, cache_implementation="static", compile=compile_))
        outs.append(eng.generate(ids, mask, params, generator=torch.Generator().manual_seed(3)))
    plain, bucketed = outs
    assert torch.equal(plain.response_ids, bucketed.response_ids)
    assert torch.equal(plain.response_mask, bucketed.response_mask)
    torch.testing.assert_close(plain.rollout_logprobs, bucketed.rollout_logprobs, atol=1e-5, rtol=0)


def test_the_engine_pads_only_when_compiling(tokenizer, monkeypatch):
    seen: list[int] = []
    real = transformers.LlamaForCausalLM.generate

    def spy(self, *a, **k):
        seen.append(k["input_ids"].shape[1])
        return real(self, *a, **k)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "generate", spy)
    ids, mask = _prompts(P=11)
    params = SamplingConfig(temperature=0.0, max_new_tokens=7)
    for compile_ in (False, True):
        HFRolloutEngine(tiny_llama(), tokenizer, HFRolloutConfig(
            cache_implementation="static", compile=compile_)).generate(ids, mask, params)
    assert seen == [11, HF_CACHE_BUCKET - 7]


def test_a_short_chunk_runs_at_full_batch_size_and_returns_its_own_rows(tokenizer, monkeypatch):
    """compile on, batch_size 4: a 3-row call generates 4 rows (the 4th a copy of the first) and
    returns the 3 real rows, exactly what a 3-row call without the fill returns (greedy)."""
    seen: list[int] = []
    real = transformers.LlamaForCausalLM.generate

    def spy(self, *a, **k):
        seen.append(k["input_ids"].shape[0])
        return real(self, *a, **k)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "generate", spy)
    model = tiny_llama()
    ids, mask = _prompts(P=9)
    params = SamplingConfig(temperature=0.0, max_new_tokens=6)
    filled = HFRolloutEngine(model, tokenizer, HFRolloutConfig(batch_size=4, compile=True)
                             ).generate(ids, mask, params)
    plain = HFRolloutEngine(model, tokenizer, HFRolloutConfig(
        batch_size=4, cache_implementation="static")).generate(ids, mask, params)
    assert seen == [4, 3]
    assert filled.response_ids.shape == (3, 6)
    assert torch.equal(filled.response_ids, plain.response_ids)
    torch.testing.assert_close(filled.rollout_logprobs, plain.rollout_logprobs, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("bucket, graphs", [(HF_CACHE_BUCKET, 1), (1, 2)])
def test_the_bucket_keeps_one_compiled_graph(tokenizer, monkeypatch, bucket, graphs):
    """transformers' compile forced on CPU (its accelerator check patched): three calls whose
    prompt + new tokens span 18-37 tokens (the last of 2 rows, not 3) compile the decode step once
    with the bucket and the row fill; without the bucket (1) the second, longer call makes a second
    graph. Every call's tokens are eager's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setattr(transformers.GenerationMixin, "_valid_auto_compile_criteria",
                        lambda self, kw, cfg: not cfg.disable_compile)
    monkeypatch.setattr(hf_engine, "HF_CACHE_BUCKET", bucket)
    monkeypatch.setattr(hf_engine.pad_to_cache_bucket, "__defaults__", (bucket,))
    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama()
    eng = HFRolloutEngine(model, tokenizer, HFRolloutConfig(batch_size=3, compile=True))
    eager = HFRolloutEngine(model, tokenizer, HFRolloutConfig(batch_size=3, compile=False))
    params = SamplingConfig(temperature=0.0, max_new_tokens=7)
    for P, B in ((11, 3), (30, 3), (19, 2)):  # a shorter, a longer, and a smaller call
        got = eng.generate(*_prompts(P, B), params)
        assert torch.equal(got.response_ids, eager.generate(*_prompts(P, B), params).response_ids)
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()
