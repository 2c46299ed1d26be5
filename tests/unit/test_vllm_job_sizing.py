"""The job-sized vLLM defaults (``VLLMRolloutConfig.sized_for``, issue 24): engine processes,
eager vs CUDA graphs, capture sizes and a fixed KV cache, from what the run asks (no vLLM needed)."""
from __future__ import annotations

import math

import pytest

from flowrl.engines.rollout.vllm_config import (
    ENGINE_OVERHEAD_BYTES,
    KVShape,
    RolloutJob,
    VLLMRolloutConfig,
)

GiB = 2**30
H200 = 141 * GiB
SMOL = 135_000_000 * 4  # fp32 master weights of a 135M model


def test_small_job_runs_one_engine_in_process_with_graphs_for_its_batch():
    # the default job: 8 prompts x 8, evals of 32 prompts per call
    job = RolloutJob(seqs_per_step=64, eval_seqs=32, decode_steps=30 * 64 + 5 * 4 * 64, ranks=1)
    procs, cfg, why = VLLMRolloutConfig().sized_for(job, SMOL, H200)
    assert procs == 0
    assert cfg.enforce_eager is False
    assert cfg.max_cudagraph_capture_size == 64  # not max_num_seqs (2,048): start-up
    assert cfg.kv_cache_memory_gb is None  # one engine: vLLM sizes its own cache
    assert cfg.torch_compile is False  # 3,200 decode steps cannot pay ~36 s of compiling
    assert [w.split("=")[0] for w in why] == ["rollout.vllm.engine_procs",
                                              "rollout.vllm.max_cudagraph_capture_size",
                                              "rollout.vllm.torch_compile"]
    assert why[2] == ("rollout.vllm.torch_compile=false (3,200 decode steps in the job, < 50,000: "
                      "compiling costs ~36 s of start-up)")
    assert why[0] == ("rollout.vllm.engine_procs=0 (one engine, in the trainer's process: 64 "
                      "sequences per step: one engine per 64, at most 4; a one-rank job's only "
                      "engine needs no process of its own)")


def test_small_job_on_two_ranks_keeps_a_child_process():
    job = RolloutJob(seqs_per_step=32, eval_seqs=32, decode_steps=100, ranks=2)
    procs, _, _ = VLLMRolloutConfig().sized_for(job, SMOL, H200)
    assert procs == 1


def test_large_job_gets_four_engines_graphs_sized_to_the_batch_and_a_fixed_cache():
    # 256 sequences per step (e2e_vs_trl's 32 x 8), 60 steps x 320 tokens: graphs pay
    job = RolloutJob(seqs_per_step=256, eval_seqs=64, decode_steps=60 * 320, ranks=1)
    procs, cfg, why = VLLMRolloutConfig().sized_for(job, SMOL, H200)
    assert procs == 4
    assert cfg.enforce_eager is False
    assert cfg.max_cudagraph_capture_size == 256  # 64 per engine (a multiple of 8) x 4
    # 0.5 x 141 GiB - 4 x (weights + overhead), floored to 0.25 GiB
    kv = (0.5 * H200 - 4 * (SMOL + ENGINE_OVERHEAD_BYTES)) / GiB
    assert cfg.kv_cache_memory_gb == pytest.approx(int(kv * 4) / 4)
    assert cfg.kv_cache_memory_gb == 56.25
    assert cfg.torch_compile is False  # 19,200 decode steps
    assert len(why) == 4
    assert why[0] == ("rollout.vllm.engine_procs=4 (4 engine process(es): 256 sequences per step: "
                      "one engine per 64, at most 4)")


@pytest.mark.parametrize("decode_steps, expected", [(49_999, False), (50_000, True), (10**6, True)])
def test_torch_compile_turns_on_for_long_jobs_only(decode_steps, expected):
    job = RolloutJob(seqs_per_step=64, eval_seqs=0, decode_steps=decode_steps, ranks=1)
    _, cfg, _ = VLLMRolloutConfig().sized_for(job, SMOL, H200)
    assert cfg.torch_compile is expected
    # an explicit choice, or eager, is left alone
    _, cfg, _ = VLLMRolloutConfig(torch_compile=True).sized_for(job, SMOL, H200)
    assert cfg.torch_compile is True
    _, cfg, _ = VLLMRolloutConfig(enforce_eager=True).sized_for(job, SMOL, H200)
    assert cfg.torch_compile is None


def test_engines_scale_with_sequences_per_step():
    cfg = VLLMRolloutConfig()
    got = [cfg.engine_procs_for(SMOL, H200, job=RolloutJob(seqs_per_step=s, ranks=1))
           for s in (8, 63, 64, 127, 128, 200, 256, 4096)]
    assert got == [0, 0, 0, 0, 2, 3, 4, 4]


def test_capture_size_rounds_up_per_engine_and_stops_at_max_num_seqs():
    job = RolloutJob(seqs_per_step=100, eval_seqs=0, decode_steps=10**6, ranks=1)
    _, cfg, _ = VLLMRolloutConfig(engine_procs=0).sized_for(job, SMOL, H200)
    assert cfg.max_cudagraph_capture_size == 104
    _, cfg, _ = VLLMRolloutConfig(engine_procs=0, max_num_seqs=64).sized_for(job, SMOL, H200)
    assert cfg.max_cudagraph_capture_size == 64


def test_explicit_settings_win():
    job = RolloutJob(seqs_per_step=32, eval_seqs=32, decode_steps=100, ranks=1)
    base = VLLMRolloutConfig(engine_procs=4, max_cudagraph_capture_size=512, kv_cache_memory_gb=20,
                             torch_compile=True)
    procs, cfg, why = base.sized_for(job, SMOL, H200)
    assert procs == 4 and cfg == base and why == []


def test_cpu_fills_nothing_but_the_process_choice():
    job = RolloutJob(seqs_per_step=256, eval_seqs=32, decode_steps=10**6, ranks=1)
    procs, cfg, _ = VLLMRolloutConfig().sized_for(job, SMOL, None)
    assert procs == 0 and cfg.kv_cache_memory_gb is None
    assert cfg.max_cudagraph_capture_size is None


def test_a_model_too_large_for_four_copies_keeps_one_engine():
    job = RolloutJob(seqs_per_step=2048, eval_seqs=0, decode_steps=10**6, ranks=1)
    big = 20 * GiB  # 4 copies > a quarter of 0.5 x 141 GiB
    procs, cfg, _ = VLLMRolloutConfig().sized_for(job, big, H200)
    assert procs == 0 and cfg.kv_cache_memory_gb is None


def test_rollout_job_from_the_default_config():
    from flowrl.config import TrainConfig
    from flowrl.runtime.step.resources import rollout_job

    cfg = TrainConfig()
    cfg.rollout.sampling.max_new_tokens = 200
    cfg.trainer.total_steps, cfg.trainer.eval.every = 30, 10
    cfg.trainer.eval.limit, cfg.trainer.eval.batch_size, cfg.trainer.eval.max_new_tokens = 128, 32, 64
    cfg.data.max_prompt_tokens = 100
    job = rollout_job(cfg, world_size=1)
    # 30 steps x 200 + (before, after, steps 10/20/30) x 4 calls of 32 x 64 tokens; a sequence is
    # at most the prompt's skip limit + the response width
    assert job == RolloutJob(seqs_per_step=cfg.trainer.prompts_per_step * cfg.algorithm.n,
                             eval_seqs=32, decode_steps=30 * 200 + 5 * 4 * 64, ranks=1,
                             seq_tokens=300, eval_seq_tokens=164)
    # a multi-turn stage's response region, where wider than max_new_tokens
    assert rollout_job(cfg, world_size=1, response_tokens=512).seq_tokens == 612
    assert rollout_job(cfg, world_size=1, response_tokens=150).seq_tokens == 300


# the KV cost of the two models of the GPU suite in bf16 (2 x layers x KV heads x head dim x 2 B)
QWEN05B_KV = KVShape(bytes_per_token=2 * 24 * 2 * 64 * 2, max_model_len=32768)  # 12,288 B
SMOL_KV = KVShape(bytes_per_token=2 * 30 * 3 * 64 * 2, max_model_len=8192)  # 23,040 B
QWEN05B = 494_032_768 * 2


def test_the_kv_cache_is_sized_to_the_jobs_largest_call():
    # e2e_vs_trl's pair: 32 prompts x 8, prompts up to 256 tokens + 256 new, 4 engines:
    # 256 x 512 tokens x 12,288 B = 1.5 GiB, x 2 headroom = 3 GiB (the budget-filling rule
    # gave 0.5 x 141 GiB less 4 engines' weights and overhead: 56.25)
    job = RolloutJob(seqs_per_step=256, eval_seqs=64, decode_steps=60 * 320, ranks=1,
                     seq_tokens=512, eval_seq_tokens=512)
    procs, cfg, why = VLLMRolloutConfig().sized_for(job, QWEN05B, H200, kv=QWEN05B_KV)
    assert procs == 4
    assert cfg.kv_cache_memory_gb == 3.0
    assert why[-1] == ("rollout.vllm.kv_cache_memory_gb=3 (the job's largest call: 131,072 tokens "
                       "x 12,288 B x 2 headroom over 4 engine(s); the budget leaves 54.75 GiB)")


def test_one_engine_gets_a_job_sized_cache_too():
    # the default job: 8 x 8 sequences of up to 256 + 256 tokens, evals of 32 x (256 + 256):
    # 32,768 tokens x 23,040 B x 2 = 1.41 GiB, rounded up to 1.5 (vLLM's own sizing took the rest
    # of 0.5 x 141 GiB)
    job = RolloutJob(seqs_per_step=64, eval_seqs=32, decode_steps=3200, ranks=1, seq_tokens=512,
                     eval_seq_tokens=512)
    procs, cfg, _ = VLLMRolloutConfig().sized_for(job, SMOL, H200, kv=SMOL_KV)
    assert procs == 0 and cfg.kv_cache_memory_gb == 1.5


def test_a_tiny_job_still_holds_one_longest_sequence_per_engine():
    # vLLM refuses a cache that cannot hold one max_model_len sequence: 1.1 x 32,768 x 12,288 B
    # per engine = 0.41 GiB, x 4 engines = 1.65 GiB, rounded up to 1.75
    job = RolloutJob(seqs_per_step=256, eval_seqs=0, decode_steps=100, ranks=1, seq_tokens=16)
    _, cfg, why = VLLMRolloutConfig().sized_for(job, QWEN05B, H200, kv=QWEN05B_KV)
    assert cfg.kv_cache_memory_gb == 1.75
    assert why[-1] == ("rollout.vllm.kv_cache_memory_gb=1.75 (4 engine(s) x 1.1 x one 32,768-token "
                       "sequence, vLLM's least (the job's largest call needs 0.09 GiB with "
                       "headroom); the budget leaves 54.75 GiB)")


def test_a_job_too_large_for_the_budget_falls_back():
    job = RolloutJob(seqs_per_step=4096, eval_seqs=0, decode_steps=100, ranks=1,
                     seq_tokens=32768)  # 4,096 x 32,768 x 12,288 B x 2 = 3 TiB
    procs, cfg, why = VLLMRolloutConfig().sized_for(job, QWEN05B, H200, kv=QWEN05B_KV)
    assert procs == 4 and cfg.kv_cache_memory_gb == math.floor(
        (0.5 * H200 - 4 * (QWEN05B + ENGINE_OVERHEAD_BYTES)) / GiB * 4) / 4
    assert "they start side by side" in why[-1]
    one = RolloutJob(seqs_per_step=32, eval_seqs=0, decode_steps=100, ranks=1, seq_tokens=1 << 24)
    procs, cfg, why = VLLMRolloutConfig().sized_for(one, QWEN05B, H200, kv=QWEN05B_KV)
    assert procs == 0 and cfg.kv_cache_memory_gb is None  # one engine: vLLM's own sizing
    assert why[-1] == ("rollout.vllm.kv_cache_memory_gb=null (the job's largest call: 536,870,912 "
                       "tokens x 12,288 B x 2 headroom over 1 engine(s): 12288 GiB, more than the "
                       "budget leaves 66.5 GiB: vLLM sizes it)")


def test_unknown_sequence_length_or_kv_cost_leaves_the_old_rules():
    job = RolloutJob(seqs_per_step=64, eval_seqs=0, decode_steps=100, ranks=1)  # seq_tokens 0
    _, cfg, _ = VLLMRolloutConfig().sized_for(job, SMOL, H200, kv=SMOL_KV)
    assert cfg.kv_cache_memory_gb is None
    job = RolloutJob(seqs_per_step=64, eval_seqs=0, decode_steps=100, ranks=1, seq_tokens=512)
    _, cfg, _ = VLLMRolloutConfig().sized_for(job, SMOL, H200, kv=None)
    assert cfg.kv_cache_memory_gb is None
    _, cfg, _ = VLLMRolloutConfig(kv_cache_memory_gb=8).sized_for(job, SMOL, H200, kv=SMOL_KV)
    assert cfg.kv_cache_memory_gb == 8  # given by hand: kept


def test_kv_shape_from_the_models_config():
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from flowrl.engines.rollout.vllm import kv_shape

    config = LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         hidden_size=64, intermediate_size=64, vocab_size=32,
                         max_position_embeddings=128)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    # 2 x 3 layers x 2 KV heads x 16 dims x 2 B
    assert kv_shape(model, VLLMRolloutConfig()) == KVShape(bytes_per_token=384, max_model_len=128)
    assert kv_shape(model, VLLMRolloutConfig(dtype="float32", max_model_len=64)) == \
        KVShape(bytes_per_token=768, max_model_len=64)
    model.config.num_key_value_heads = None  # multi-head attention: K/V heads = heads
    assert kv_shape(model, VLLMRolloutConfig()).bytes_per_token == 768

    class NoLayers:  # a custom config without num_hidden_layers
        def get_text_config(self):
            return SimpleNamespace(num_attention_heads=4, hidden_size=64, max_position_embeddings=8)

    custom = torch.nn.Linear(2, 2)
    custom.config = NoLayers()
    assert kv_shape(custom, VLLMRolloutConfig()) is None


def test_response_tokens_of_a_multi_turn_plan():
    from types import SimpleNamespace

    from flowrl.envs.config import MultiTurnConfig
    from flowrl.runtime.step.resources import response_tokens

    plan = SimpleNamespace(stages=[SimpleNamespace(config=None),
                                   SimpleNamespace(config=MultiTurnConfig(max_total_tokens=900))])
    assert response_tokens(plan) == 900
    assert response_tokens(SimpleNamespace(stages=[SimpleNamespace(config=None)])) == 0
