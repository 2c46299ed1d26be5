"""flowrl's own vLLM engines in ``benchmarks/rollout.py``, timed through the engine API.

Variants (``FLOWRL_VARIANTS``, name -> engine processes): ``flowrl-vllm`` is
:class:`~flowrl.engines.rollout.vllm.VLLMRolloutEngine` in the benchmark's process;
``flowrl-vllm-procsN`` is :class:`~flowrl.engines.rollout.vllm_proc.VLLMProcessEngine` with N engine
processes on the same device (``-threads``: each serving with torch's default threads instead of
``serve_threads=1``; ``-v1runner``: vLLM's V1 model runner), each with a slice of every batch and an even share of the same totals
(``engine_share``). Each engine gets the HF module built on the device and a minimal tokenizer and
exports them itself, as in a training run.

What is timed is what flowrl's rollout op runs: ``engine.generate`` with flat logprobs, GC frozen,
n-grouping and, by default (``--flowrl-rng seeded``), a ``torch.Generator`` (vLLM then samples every
row with its own per-request generator: one extra kernel launch per row per step). Rows may stop at
EOS (no ``ignore_eos`` in the engine); ``mean_response_len`` shows they ran ~full length.
"""
from __future__ import annotations

import dataclasses
import math
import time

FLOWRL_VARIANTS = {"flowrl-vllm": 0, "flowrl-vllm-procs2": 2, "flowrl-vllm-procs4": 4,
                   "flowrl-vllm-procs8": 8,  # name -> engine processes (0 = in process)
                   # A/B partners of flowrl-vllm-procs4 (FLOWRL_CONFIG / FLOWRL_ENV below)
                   "flowrl-vllm-procs4-threads": 4, "flowrl-vllm-procs4-v1runner": 4,
                   "flowrl-vllm-v1runner": 0}
# rollout.vllm fields a variant sets beyond engine_config's: serve_threads=None is torch's
# default thread count in each engine process (before 2026-12-07; the default is now 1)
FLOWRL_CONFIG: dict[str, dict] = {"flowrl-vllm-procs4-threads": {"serve_threads": None}}
# environment of a variant's worker process (its engine processes inherit it): vLLM 0.26's V1
# model runner instead of its default V2 one (whose Triton kernels JIT at a cold start)
FLOWRL_ENV: dict[str, dict[str, str]] = {
    "flowrl-vllm-procs4-v1runner": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
    "flowrl-vllm-v1runner": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
RNG = ("seeded", "unseeded")  # generate with a torch.Generator (what the rollout op does) or None
KV_MARGIN = 1.5   # KV cache = 1.5x the tokens of the largest batch: preemption never limits it
SMOKE_KV_GB = 0.25  # vLLM-CPU smoke (as tests/vllm_backend): the tiny model needs ~nothing


def bench_tokenizer(eos_token_id: int):
    """A two-token ``PreTrainedTokenizerFast`` (``<unk>`` = 0, ``<|endoftext|>`` = the model's EOS,
    also pad): the engines need EOS/pad ids and ``save_pretrained`` for their export, vLLM a
    tokenizer it can load offline; prompts and responses stay token ids (no detokenization)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    if eos_token_id == 0:
        raise ValueError("bench_tokenizer: EOS id 0 collides with <unk>")
    wl = models.WordLevel({"<unk>": 0, "<|endoftext|>": eos_token_id}, unk_token="<unk>")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(wl), unk_token="<unk>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def kv_cache_gb(batch: int, seq_len: int, model_cfg) -> float:
    """KV cache (GiB, rounded up to 1/4) for ``batch`` sequences of ``seq_len`` tokens in bf16, times
    ``KV_MARGIN``. Qwen2.5-0.5B shape: 12,288 B/token; B=2048, 384 tokens -> 13.5 GiB."""
    head = model_cfg.hidden_size // model_cfg.num_attention_heads
    per_token = 2 * model_cfg.num_hidden_layers * model_cfg.num_key_value_heads * head * 2
    return math.ceil(4 * KV_MARGIN * batch * seq_len * per_token / 2**30) / 4


def engine_config(args, model_cfg, on_cuda: bool):
    """flowrl's ``VLLMRolloutConfig()`` defaults plus what the workload fixes: max_model_len = P + R,
    bf16, an explicit KV cache size (no dependence on vLLM's memory profiling). On CPU (smoke): fp32,
    eager, ``SMOKE_KV_GB``, 16 sequences (the vLLM tier's settings)."""
    from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig

    seq = args.prompt_len + args.new_tokens
    if not on_cuda:
        return VLLMRolloutConfig(max_model_len=seq, dtype="float32", enforce_eager=True,
                                 kv_cache_memory_gb=SMOKE_KV_GB, max_num_seqs=16)
    return VLLMRolloutConfig(max_model_len=seq, dtype="bfloat16",
                             kv_cache_memory_gb=kv_cache_gb(max(args.batches), seq, model_cfg))


def make_engine(variant: str, model, tok, cfg):
    procs = FLOWRL_VARIANTS[variant]
    if procs == 0:
        from flowrl.engines.rollout.vllm import VLLMRolloutEngine
        return VLLMRolloutEngine(model, tok, cfg)
    from flowrl.engines.rollout.vllm_proc import VLLMProcessEngine
    return VLLMProcessEngine(model, tok, cfg, procs=procs)


def per_engine_settings(cfg, procs: int) -> dict:
    """What each vLLM engine was given (``engine_share`` of the totals when procs > 1)."""
    from flowrl.engines.rollout.vllm_proc import engine_share

    c = engine_share(cfg, procs, 0) if procs else cfg
    return dict(procs=max(1, procs), max_num_seqs=c.max_num_seqs,
                max_cudagraph_capture_size=(None if c.enforce_eager else
                                            c.max_cudagraph_capture_size or c.max_num_seqs),
                max_num_batched_tokens=c.max_num_batched_tokens, kv_cache_memory_gb=c.kv_cache_memory_gb,
                gpu_memory_utilization=round(c.gpu_memory_utilization, 4), dtype=c.dtype)


def run_flowrl(args, variant: str, build_model, prompts_for, sync) -> list[dict]:
    """Throughput rows (one per batch size and ``--flowrl-rng`` mode), then the switch row with
    ``--switch``. ``build_model(smoke, seed)`` / ``prompts_for(B, P, vocab)`` / ``sync()`` are
    ``benchmarks/rollout.py``'s."""
    import torch

    from flowrl.engines.base import SamplingConfig

    on_cuda = torch.cuda.is_available()
    model = build_model(args.smoke).to("cuda" if on_cuda else "cpu")
    tok = bench_tokenizer(model.config.eos_token_id)
    cfg = dataclasses.replace(engine_config(args, model.config, on_cuda),
                              **FLOWRL_CONFIG.get(variant, {}))
    procs = FLOWRL_VARIANTS[variant]
    t0 = time.perf_counter()
    eng = make_engine(variant, model, tok, cfg)
    init_s = time.perf_counter() - t0
    effective = {**per_engine_settings(cfg, procs), "init_s": round(init_s, 1)}
    print(f"{variant}: init {init_s:.1f} s, per engine {effective}", flush=True)
    rows = []
    try:
        for B in args.batches:
            ids = prompts_for(B, args.prompt_len, model.config.vocab_size)
            mask = torch.ones_like(ids, dtype=torch.bool)
            eng.generate(ids, mask, SamplingConfig(max_new_tokens=min(8, args.new_tokens)),
                         torch.Generator().manual_seed(1))
            # interleaved: round r times every (rng, logprobs) mode once, in the same order
            modes = [(rng, lp) for rng in args.flowrl_rng for lp in args.flowrl_logprobs]
            for r, (rng, lp) in ((r, m) for r in range(args.rounds) for m in modes):
                gen = torch.Generator().manual_seed(r) if rng == "seeded" else None
                sync()
                t0 = time.perf_counter()
                out = eng.generate(ids, mask, SamplingConfig(
                    temperature=1.0, max_new_tokens=args.new_tokens, logprobs=lp), gen)
                sync()
                dt = time.perf_counter() - t0
                n = int(out.response_mask.sum())
                valid = out.response_mask
                assert out.response_ids.shape[0] == B and bool(
                    (torch.isfinite(out.rollout_logprobs[valid]) if lp == "all"
                     else torch.isnan(out.rollout_logprobs[valid])).all())
                label = {"all": "lp-flat", "none": "nolp"}[lp]
                rows.append(dict(
                    variant=variant, batch=B, sampling=f"{label}+gc-freeze+{rng}", round=r + 1,
                    tokens=n,
                    seconds=dt, tokens_per_s=n / dt, mean_response_len=n / B,
                    truncated_frac=float(out.truncated.float().mean()),
                    engine_generate_s=eng.last_timings["generate_s"],
                    settings=dataclasses.asdict(cfg), effective=effective))
                print(f"{variant} B={B} {rng} logprobs={lp} round {r + 1}: {n / dt:,.0f} tok/s "
                      f"({dt:.2f} s, mean length {n / B:.1f})", flush=True)
        if args.switch:
            source = build_model(args.smoke, seed=1).to(next(model.parameters()).device)
            probe = prompts_for(min(256, max(args.batches)), args.prompt_len, model.config.vocab_size)
            rows.append(switch_cost(variant, eng, source, probe, sync))
    finally:
        eng.close()
    return rows


def switch_cost(variant: str, eng, source, probe, sync) -> dict:
    """Colocated switch through the engine API, 3 cycles per level, medians.

    Level 1: ``sleep(1)``, ``wake()``, ``load_weights(source.named_parameters())``. Level 2 (the
    weights are discarded, so the load comes before the wake, refilling them): ``sleep(2)``,
    ``load_weights``, ``wake()``. ``switch`` holds the engine's own ``last_timings`` (procs: the
    slowest engine; ``load_weights_s`` is the parent's wall time, CUDA IPC to every engine included),
    ``switch_wall`` the benchmark's wall time of each call. ``source`` has other weights than the
    engine's (seed 1): greedy responses to ``probe`` before and after must differ.
    """
    import torch

    from flowrl.engines.base import SamplingConfig

    mask = torch.ones_like(probe, dtype=torch.bool)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=4)
    before = eng.generate(probe, mask, greedy).response_ids
    times: dict[str, list[float]] = {}
    walls: dict[str, list[float]] = {}

    def timed(key, timing_key, fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        walls.setdefault(key, []).append(time.perf_counter() - t0)
        times.setdefault(key, []).append(eng.last_timings[timing_key])

    load = lambda: eng.load_weights(source.named_parameters())  # noqa: E731
    for _ in range(3):
        timed("sleep1_s", "sleep_s", lambda: eng.sleep(1))
        timed("wake1_s", "wake_s", eng.wake)
        timed("load1_s", "load_weights_s", load)
    for _ in range(3):
        timed("sleep2_s", "sleep_s", lambda: eng.sleep(2))
        timed("load2_s", "load_weights_s", load)
        timed("wake2_s", "wake_s", eng.wake)
    after = eng.generate(probe, mask, SamplingConfig(temperature=1.0, max_new_tokens=16),
                         torch.Generator().manual_seed(0))
    ok = after.response_ids.shape[0] == probe.shape[0] and bool(torch.isfinite(after.rollout_logprobs).all())
    changed = not torch.equal(eng.generate(probe, mask, greedy).response_ids, before)
    med = lambda d: {k: sorted(v)[len(v) // 2] for k, v in d.items()}  # noqa: E731
    print(f"{variant} switch: {med(times)} weights changed {changed} generate ok {ok}", flush=True)
    return dict(variant=variant, batch=0, sampling="", tokens=0, seconds=0.0, tokens_per_s=0.0,
                switch=med(times), switch_wall=med(walls), all_times=times,
                weights_changed=changed, generate_after_switch_ok=ok,
                sleep_supported=bool(getattr(eng, "sleep_supported", False)),
                weight_gb=sum(p.numel() * p.element_size() for p in source.parameters()) / 1e9)
