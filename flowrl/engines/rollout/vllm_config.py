"""Configuration of the vLLM rollout engine, importable without vLLM (``rollout.vllm`` section).

The engine itself is ``flowrl/engines/rollout/vllm.py``.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from flowrl.engines.base import SamplingConfig

if TYPE_CHECKING:  # the run config reads this module before torch loads (models.lora imports it)
    from flowrl.models.lora import LoraAdapterSpec

VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
LOGPROBS_MODES = ("tempered", "processed")
WEIGHT_LOADS = ("auto", "direct", "reload")
LORA_SYNCS = ("auto", "merged", "adapter")
# what lora_sync="auto" picks where the adapter path can run: merged, the faster one measured. On
# the H200 (2026-12-03, benchmarks/lora_sync.py, SmolLM2-135M, rank 16, 64 x 8 samples, 4 engine
# processes, benchmarks/results/lora_sync_h200.md): merged sync 0.067 s and step 3.26 s (generate
# 0.47 s) against adapter 0.174 s and 3.89 s (generate 0.99 s: vLLM's LoRA kernels run in every
# decode step), the same rollout-vs-trainer mismatch (3.45e-2 nats); the adapter moves 18.6 MiB per
# update against 513 MiB. The adapter path (lora_sync=adapter) pays where the weights are large and
# decode is short; it runs on the GPU tier (an engine process, level-1 sleep between syncs).
AUTO_LORA_SYNC = "merged"
# the modules whose adapters vLLM's LoRA layers apply to a llama-family model (its fused qkv_proj
# and gate_up_proj take the per-projection adapters): flowrl refuses the adapter path elsewhere
VLLM_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# vLLM's LoRAConfig.max_lora_rank accepts only these (vllm/config/lora.py MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# head sizes vLLM 0.32's CPU attention kernel accepts (vllm/v1/attention/backends/cpu_attn.py)
# KV cache per rank on CPU when rollout.vllm.kv_cache_memory_gb is null: vLLM-CPU would otherwise
# take gpu_memory_utilization x the host's RAM per engine, and 2 ranks x 2 engines on one host asked
# for all of it (OOM-killed). 1 GiB holds ~23k tokens of SmolLM2-135M in fp32.
CPU_KV_CACHE_GB = 1.0
# engine processes per device when rollout.vllm.engine_procs is null and the weights are small
# (benchmarks/results/rollout_h200.md: 4 beat 2 and 8 on a 0.5B model at 2,048 sequences)
AUTO_ENGINE_PROCS = 4
# ... but only when the job keeps each engine busy: sequences in flight per engine and decode step
# before one more engine pays (issue 24, one H200: at 32 sequences per step one engine steps twice
# as fast as four; at 256 (e2e_vs_trl, 0.5B) four engines generate in 1.49 s against ~2.1 s for one
# in-process engine, benchmarks/results/rollout_h200.md). Fewer engines also start sooner.
SEQS_PER_ENGINE_PROC = 64
# device memory an engine process takes besides its KV cache and weights (profiling activations,
# the sampler's logits, CUDA graphs) when flowrl fixes the cache size up front
ENGINE_OVERHEAD_BYTES = 3 << 30
# the job-sized KV cache (rollout.vllm.kv_cache_memory_gb null on CUDA): the job's largest generate
# call at its longest (every prompt at data.max_prompt_tokens, every response at its full width)
# times this, for the block rounding, a chat template's tools in the prompt and prefix blocks not
# yet freed. Before it (through ce93b88) the engines took the whole budget: at the e2e pair's 0.5B
# shape 256 x 512 tokens need 1.5 GiB, and flowrl's process tree held 1.24x TRL's device memory
# with a fixed 8 GiB cache. Too small costs time, never a result: vLLM preempts and recomputes.
KV_HEADROOM = 2.0
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# decode steps of a whole job (RolloutJob.decode_steps) from which vLLM's torch.compile is turned on
# when rollout.vllm.torch_compile is null. Compiling costs start-up on every run: on the H200 the
# default job's in-process engine spent 8 s in Dynamo, 12 s in Inductor (a cache miss) and 15.5 s in
# Inductor's once-per-process pattern-matcher init (the gap between the CUDA-graph capture and
# vLLM's "Kernel JIT monitor" line), 36 of its 60 s (benchmarks/results/first_step_h200.md); the
# decode it speeds up is already a CUDA graph without it. A job this long amortises that.
TORCH_COMPILE_MIN_DECODE_STEPS = 50_000


@dataclass(frozen=True)
class RolloutJob:
    """What a run will ask of one rank's rollout engine, known before the engine is built
    (``flowrl.runtime.step.resources.rollout_job``); sizes the job-sized defaults of
    :class:`VLLMRolloutConfig` (:meth:`VLLMRolloutConfig.sized_for`).

    Attributes:
        seqs_per_step: sequences of one training step's generate call on this rank
            (``prompts_per_step × algorithm.n`` / rollout ranks).
        eval_seqs: sequences of one eval generate call on this rank (0 = no eval).
        decode_steps: decode steps of the whole job (training steps × ``max_new_tokens`` +
            eval passes × their ``max_new_tokens``): the longest row sets a call's decode steps.
        ranks: ranks running a rollout engine (1: the engine may live in the trainer's process).
        seq_tokens: tokens of a training generate call's longest sequence (``data.max_prompt_tokens``
            + the response width: ``max_new_tokens``, a multi-turn stage's ``max_total_tokens``);
            0 = not known (the KV cache is then not sized to the job).
        eval_seq_tokens: the same for an eval call (its ``max_new_tokens``).
    """

    seqs_per_step: int
    eval_seqs: int = 0
    decode_steps: int = 0
    ranks: int = 1
    seq_tokens: int = 0
    eval_seq_tokens: int = 0

    def kv_tokens(self) -> int:
        """Tokens of KV cache the largest generate call holds at its longest (0: unknown)."""
        if not self.seq_tokens:
            return 0
        return max(self.seqs_per_step * self.seq_tokens, self.eval_seqs * self.eval_seq_tokens)


@dataclass(frozen=True)
class KVShape:
    """What the policy's KV cache costs in vLLM, from its config (``engines/rollout/vllm.kv_shape``).

    Attributes:
        bytes_per_token: KV-cache bytes of one token over all layers (2 × layers × KV heads ×
            head dim × the engine dtype's bytes; an upper bound for sliding-window layers).
        max_model_len: the longest sequence vLLM will admit (``rollout.vllm.max_model_len``, else
            the config's ``max_position_embeddings``): vLLM refuses a cache that cannot hold one.
    """

    bytes_per_token: int
    max_model_len: int

    @classmethod
    def of(cls, layers: int, kv_heads: int, head_dim: int, elem_bytes: int,
           max_model_len: int) -> "KVShape":
        """2 (K and V) × ``layers`` × ``kv_heads`` × ``head_dim`` × ``elem_bytes`` per token."""
        return cls(2 * layers * kv_heads * head_dim * elem_bytes, max_model_len)


@dataclass
class VLLMRolloutConfig:
    """Configuration of :class:`VLLMRolloutEngine` (``conf/rollout/vllm.yaml``, ``rollout.vllm``).

    Attributes:
        gpu_memory_utilization: fraction of the device memory vLLM may take for weights, activations
            and KV cache (CUDA). Colocated with a trainer, keep it well below 1.
        kv_cache_memory_gb: fixed KV-cache size in GiB per rank; overrides
            ``gpu_memory_utilization`` for the cache. None on CUDA = sized to the job where it
            fits the budget (:meth:`sized_for`), else vLLM's own sizing;
            ``CPU_KV_CACHE_GB`` (1 GiB) on CPU unless ``VLLM_CPU_KVCACHE_SPACE`` is set.
        tensor_parallel_size: ranks one engine spans (the placement compiler sizes the rollout
            pool by it). Only 1 runs today (one whole engine per rank or engine process).
        max_num_seqs: most sequences vLLM runs in one engine step.
        max_num_batched_tokens: most tokens in one engine step (None = vLLM's default).
        max_model_len: longest prompt + response in tokens (None = the model config's
            ``max_position_embeddings``). A request longer than this finishes as truncated.
        enforce_eager: True = no CUDA graphs (slower decode, less memory). False (default): CUDA
            graphs, captured only up to the job's largest generate call. Eager does not start
            faster once the capture is sized to the job: on the H200 the default job's in-process
            engine was ready in 40.5 s eager and 40.4 s with graphs up to 64 sequences, and
            stepped in 1.30 s vs 0.49 s (median; benchmarks/results/first_step_h200.md).
        torch_compile: vLLM's torch.compile of the model (Dynamo + Inductor, piecewise CUDA graphs).
            False = no compile: the model runs vLLM's eager kernels and decode steps replay full
            CUDA graphs (``cudagraph_mode=FULL_DECODE_ONLY``), which skips ~36 s of an H200
            engine's start-up (see ``TORCH_COMPILE_MIN_DECODE_STEPS``). True = compile (vLLM's
            default). None (default) = job-sized (:meth:`sized_for`): compile only when the job
            decodes at least ``TORCH_COMPILE_MIN_DECODE_STEPS`` steps. CUDA only; ignored on CPU
            and with ``enforce_eager``.
        max_cudagraph_capture_size: largest decode batch captured as a CUDA graph; None = the
            job's sequences per generate call (:meth:`sized_for`, rounded up to 8 per engine), or
            ``max_num_seqs`` without job information. Every captured size costs start-up: on the
            H200 capturing up to 2,048 took 54 s of vLLM's init against 22 s up to 512
            (benchmarks/results/rollout_h200.md). vLLM's own default stops at 512, and a larger decode batch then runs
            eagerly: on the H200 benchmark that cap alone cost 1.6x at 2,048 sequences
            (benchmarks/results/rollout_h200.md). Ignored on CPU and with ``enforce_eager``.
        dtype: weights/activations dtype: ``auto`` (= the exported model's dtype), ``float32``,
            ``bfloat16``, ``float16``.
        enable_prefix_caching: the ``n`` samples of a prompt (one request with ``n`` children)
            share the prompt's KV blocks instead of each prefilling it.
        sleep_level: what a colocated swap point does: 0 = never sleep, 1 = weights to host memory +
            KV cache dropped, 2 = weights and KV cache dropped (refilled by the next weight load).
        logprobs_mode: what ``rollout_logprobs`` holds, as ``HFRolloutConfig.logprobs_mode``:
            "tempered" = log softmax(logits / T) over the full vocabulary (what the trainer
            recomputes); "processed" = under the top-k/top-p truncated, renormalised distribution.
            Both read vLLM's ``processed_logprobs``; without truncation they are the same number,
            so "tempered" refuses sampling settings that truncate (see :meth:`check_sampling`).
        seed: vLLM's engine seed (requests without a generator).
        model_dir: where the HF export of the initial model is written; None = a temporary
            directory removed by :meth:`VLLMRolloutEngine.close`.
        engine_procs: where the engine runs. 0 = in the trainer's process (in-place weight loads
            with no copy). N >= 1 = N vLLM engines in child processes on this rank's device
            (``engines/rollout/vllm_proc.py``), each with its own one-process torch world, the batch
            split between them; the memory and concurrency settings above are then the rank's
            totals, divided evenly. None (default) = :meth:`engine_procs_for` decides: on CUDA,
            ``AUTO_ENGINE_PROCS`` (4) engines when 4 copies of the weights fit in a quarter of the
            memory budget, else 1; on CPU, in process. vLLM spends ~20 µs of host Python per
            running request per decode step, so a small model's rollout is host bound: on an H200
            4 engine processes generate 2.99x the tokens/s of one in-process engine (0.5B model,
            2,048 sequences; 2 engines 1.78x, 8 engines 2.54x; benchmarks/results/rollout_h200.md).
            A partitioned rollout pool always uses child processes (an in-process engine would
            build its process groups over the whole world): 0 there means 1.
        weight_load: how a weight sync enters the engine: "direct" = the vLLM model's own
            ``load_weights`` (each tensor copied into its fused parameter in place), "reload" =
            vLLM's ``reload_weights`` (adds each layer's post-load processing: needed by quantized
            or repacked layers), "auto" = direct when ``vllm.direct_load_blocker`` finds no quantized
            layer, repacked parameter or linear/embedding parameter without its loader
            (unquantized CUDA layers), else reload (vLLM-CPU repacks its GEMM weights after
            loading and drops them).
        lora_sync: how a LoRA policy (``model.lora``) reaches the engine at each sync: "merged" =
            ``W0 + (alpha/r) B A`` of every layer merged by the trainer and loaded as full
            weights (the whole weight set, every sync); "adapter" = the engine is built with
            vLLM's LoRA support (``enable_lora``, ``max_loras=1``) on the base weights, which are
            never re-sent, and each sync writes only the adapters (PEFT format, to
            ``/dev/shm``) and switches generation to a new ``LoRARequest`` (the previous adapter
            is removed); "auto" = ``AUTO_LORA_SYNC`` where the adapter path can run
            (targets among ``VLLM_LORA_MODULES``, no ``modules_to_save``, rank <= 512,
            ``sleep_level`` < 2), else merged (:meth:`lora_sync_for`). Ignored without LoRA.
        serve_threads: torch's intra-op CPU threads in an engine *process* on CUDA once its
            engine is built (the build keeps torch's default: weight loading does use threads).
            1 (default): nothing in a GPU engine's decode loop gains from intra-op threads, and
            each multi-threaded CPU op wakes a pool of OpenMP workers (16 per process on a
            16-core host before this, in each of 4 engines beside the trainer's 16; flowrl's
            ``OMP_WAIT_POLICY=PASSIVE`` keeps them from spinning, not from waking); vLLM sets
            its own GPU workers to 1 thread in later releases, but not its in-process (UniProc)
            engine, which is what each flowrl engine process runs. Not measured yet
            (``session.sh decode_ab``). None = leave torch's default (OMP_NUM_THREADS, else the
            core count). Not applied to an
            in-process engine (``engine_procs=0``: the trainer's threads are the trainer's) or
            on CPU (vLLM-CPU computes with them).
        max_images_per_prompt: a vision-language policy's most images in one prompt (vLLM's
            ``limit_mm_per_prompt``: it sizes the vision encoder's start-up profiling by it, and
            refuses a request with more). Ignored for a text model.
    """

    gpu_memory_utilization: float = 0.5
    kv_cache_memory_gb: Optional[float] = None
    tensor_parallel_size: int = 1
    max_num_seqs: int = 2048  # benchmarks/results/rollout_h200.md: a whole RL step in flight at once
    max_num_batched_tokens: Optional[int] = 32768
    max_model_len: Optional[int] = None
    enforce_eager: bool = False
    torch_compile: Optional[bool] = None
    max_cudagraph_capture_size: Optional[int] = None
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    sleep_level: int = 1
    logprobs_mode: str = "tempered"  # "tempered" | "processed" (OmegaConf has no Literal)
    seed: int = 0
    model_dir: Optional[str] = None
    engine_procs: Optional[int] = None
    weight_load: str = "auto"  # "auto" | "direct" | "reload" (OmegaConf has no Literal)
    serve_threads: Optional[int] = 1
    max_images_per_prompt: int = 1
    lora_sync: str = "auto"  # "auto" | "merged" | "adapter" (OmegaConf has no Literal)

    def __post_init__(self) -> None:
        if self.engine_procs is not None and self.engine_procs < 0:
            raise ValueError(f"rollout.vllm.engine_procs must be >= 0 or null, got {self.engine_procs}")
        if self.engine_procs is not None and self.max_num_seqs < self.engine_procs:
            raise ValueError(f"rollout.vllm.max_num_seqs ({self.max_num_seqs}) must be >= "
                             f"rollout.vllm.engine_procs ({self.engine_procs}): each engine gets "
                             "an even share")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"rollout.vllm.gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"rollout.vllm.kv_cache_memory_gb must be > 0 or null, "
                             f"got {self.kv_cache_memory_gb}")
        if self.tensor_parallel_size != 1:
            # every rank (or engine process) runs a whole one-device engine: data parallel only;
            # a TP group spanning ranks would need vLLM's external launcher over those ranks
            raise ValueError(f"rollout.vllm.tensor_parallel_size must be 1 (engines are data "
                             f"parallel, one per rank or engine process), got "
                             f"{self.tensor_parallel_size}")
        if self.serve_threads is not None and self.serve_threads < 1:
            raise ValueError(f"rollout.vllm.serve_threads must be >= 1 or null, "
                             f"got {self.serve_threads}")
        if self.max_num_seqs < 1:
            raise ValueError(f"rollout.vllm.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_images_per_prompt < 1:
            raise ValueError(f"rollout.vllm.max_images_per_prompt must be >= 1, got "
                             f"{self.max_images_per_prompt}")
        for name in ("max_num_batched_tokens", "max_model_len", "max_cudagraph_capture_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"rollout.vllm.{name} must be >= 1 or null, got {v}")
        if self.dtype not in VLLM_DTYPES:
            raise ValueError(f"rollout.vllm.dtype must be one of {VLLM_DTYPES}, got {self.dtype!r}")
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"rollout.vllm.sleep_level must be 0, 1 or 2, got {self.sleep_level}")
        if self.weight_load not in WEIGHT_LOADS:
            raise ValueError(f"rollout.vllm.weight_load must be one of {WEIGHT_LOADS}, "
                             f"got {self.weight_load!r}")
        if self.lora_sync not in LORA_SYNCS:
            raise ValueError(f"rollout.vllm.lora_sync must be one of {LORA_SYNCS}, "
                             f"got {self.lora_sync!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"rollout.vllm.logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")

    def engine_procs_for(self, weight_bytes: int, device_memory: Optional[int], *,
                         own_process: bool = False, job: Optional["RolloutJob"] = None) -> int:
        """Engine processes this rank runs (0 = in process), see ``engine_procs``.

        Args:
            weight_bytes: the policy's parameter bytes (one engine's copy of the weights).
            device_memory: the rank's device memory in bytes; None on CPU.
            own_process: the engine must not join this process's torch world (partitioned pool).
            job: what the run asks of the engine; None = the rule without it (4 or 1 on CUDA).
        """
        if self.engine_procs is not None:
            n = self.engine_procs
        elif device_memory is None:  # vLLM-CPU engines would compete with the trainer for cores
            n = 0
        else:
            budget = self.gpu_memory_utilization * device_memory
            n = AUTO_ENGINE_PROCS if AUTO_ENGINE_PROCS * weight_bytes <= budget / 4 else 1
            if job is not None:
                busy = max(job.seqs_per_step, 1) // SEQS_PER_ENGINE_PROC
                n = max(1, min(n, busy))
                if n == 1 and job.ranks == 1:
                    # one engine on a one-rank job: in process (no child start-up, weights loaded
                    # in place); on several ranks a child keeps vLLM off the job's torch world
                    n = 0
        return max(n, 1) if own_process else n

    def sized_for(self, job: "RolloutJob", weight_bytes: int, device_memory: Optional[int], *,
                  own_process: bool = False, kv: Optional[KVShape] = None
                  ) -> tuple[int, "VLLMRolloutConfig", list[str]]:
        """This rank's engine sized to the job: (engine processes, the configuration with every
        job-sized ``None`` filled in, one reason per filled setting for the console).

        Filled (each only where the field is None, on CUDA):
        ``engine_procs`` (:meth:`engine_procs_for`); ``torch_compile`` (on from
        ``TORCH_COMPILE_MIN_DECODE_STEPS`` decode steps); ``max_cudagraph_capture_size``
        (the job's largest generate call, rounded up to 8 sequences per engine, at most
        ``max_num_seqs``); ``kv_cache_memory_gb``: the job's KV demand
        (:meth:`RolloutJob.kv_tokens` × ``kv.bytes_per_token`` × ``KV_HEADROOM``, at least one
        ``max_model_len`` sequence per engine) where it fits the budget less each engine's
        weights and ``ENGINE_OVERHEAD_BYTES``; else, with several engines, that whole remainder
        (fixed either way, so several engines start side by side instead of one after the
        other, and a fixed cache skips vLLM's memory profiling); else vLLM's own sizing.

        Args:
            job: the run's rollout demand per rank (:class:`RolloutJob`).
            weight_bytes: parameter bytes of the policy (its master copy: an upper bound on
                vLLM's copy). device_memory: the device's total bytes; None on CPU (nothing but
                ``engine_procs`` is filled there).
            own_process: as in :meth:`engine_procs_for`.
            kv: the policy's KV cost in the engine (None: the cache is not sized to the job).
        """
        procs = self.engine_procs_for(weight_bytes, device_memory, own_process=own_process, job=job)
        why: list[str] = []
        if self.engine_procs is None:
            rule = (f"{job.seqs_per_step} sequences per step: one engine per "
                    f"{SEQS_PER_ENGINE_PROC}, at most {AUTO_ENGINE_PROCS}")
            why.append(f"rollout.vllm.engine_procs={procs} (" + (
                f"one engine, in the trainer's process: {rule}; a one-rank job's only engine "
                "needs no process of its own" if procs == 0 else
                f"{procs} engine process(es): {rule}") + ")")
        if device_memory is None:
            return procs, self, why
        cfg = self
        engines = max(procs, 1)
        if not cfg.enforce_eager and cfg.max_cudagraph_capture_size is None:
            per_engine = -(-max(job.seqs_per_step, job.eval_seqs, 1) // engines)
            per_engine = min(-(-per_engine // 8) * 8, -(-cfg.max_num_seqs // engines))
            cfg = dataclasses.replace(cfg, max_cudagraph_capture_size=per_engine * engines)
            why.append(f"rollout.vllm.max_cudagraph_capture_size={per_engine * engines} (the job's "
                       f"largest generate call; each captured size costs start-up)")
        if not cfg.enforce_eager and cfg.torch_compile is None:
            compile_ = job.decode_steps >= TORCH_COMPILE_MIN_DECODE_STEPS
            cfg = dataclasses.replace(cfg, torch_compile=compile_)
            why.append(f"rollout.vllm.torch_compile={str(compile_).lower()} ({job.decode_steps:,} "
                       f"decode steps in the job, {'>=' if compile_ else '<'} "
                       f"{TORCH_COMPILE_MIN_DECODE_STEPS:,}: compiling costs ~36 s of start-up)")
        if cfg.kv_cache_memory_gb is None:
            budget = cfg.gpu_memory_utilization * device_memory
            room = (budget - engines * (weight_bytes + ENGINE_OVERHEAD_BYTES)) / 2**30
            sized = _job_kv_gb(job, kv, engines)
            left = f"the budget leaves {math.floor(room * 4) / 4:g} GiB"
            if sized is not None and sized[0] <= room:
                cfg = dataclasses.replace(cfg, kv_cache_memory_gb=sized[0])
                why.append(f"rollout.vllm.kv_cache_memory_gb={sized[0]:g} ({sized[1]}; {left})")
            elif engines > 1 and room >= engines * 0.5:  # else vLLM's profiling, one at a time
                room = math.floor(room * 4) / 4
                cfg = dataclasses.replace(cfg, kv_cache_memory_gb=room)
                why.append(f"rollout.vllm.kv_cache_memory_gb={room:g} (the rank's budget less "
                           f"{engines} engines' weights and overhead: they start side by side)")
            elif sized is not None:
                why.append(f"rollout.vllm.kv_cache_memory_gb=null ({sized[1]}: {sized[0]:g} GiB, "
                           f"more than {left}: vLLM sizes it)")
        return procs, cfg, why

    def lora_sync_for(self, lora: Optional["LoraAdapterSpec"]) -> str:
        """The sync path this engine runs for the policy's adapters: "merged" or "adapter"
        (``lora_sync`` resolved; "merged" without LoRA: nothing to choose).

        Raises:
            ValueError: ``lora_sync="adapter"`` where vLLM's LoRA cannot serve the adapters (one
                line naming the ``model.lora`` or ``rollout.vllm`` field).
        """
        if lora is None or self.lora_sync == "merged":
            return "merged"
        reasons = []
        bad = [t for t in lora.target_modules if t not in VLLM_LORA_MODULES]
        if bad:
            reasons.append(f"model.lora.target_modules has {bad}: vLLM's adapter path takes "
                           f"only {list(VLLM_LORA_MODULES)}")
        if lora.modules_to_save:
            reasons.append(f"model.lora.modules_to_save={list(lora.modules_to_save)} (fully "
                           "trained modules are not adapters)")
        if lora.rank > VLLM_LORA_RANKS[-1]:
            reasons.append(f"model.lora.rank={lora.rank} is above vLLM's max_lora_rank "
                           f"{VLLM_LORA_RANKS[-1]}")
        if self.sleep_level == 2:
            reasons.append("rollout.vllm.sleep_level=2 discards the base weights, which the "
                           "adapter path never re-sends (use sleep_level 1)")
        if not reasons:
            return AUTO_LORA_SYNC if self.lora_sync == "auto" else "adapter"
        if self.lora_sync == "adapter":
            raise ValueError(f"rollout.vllm.lora_sync=adapter: {'; '.join(reasons)}; or set "
                             "rollout.vllm.lora_sync=merged")
        return "merged"

    def kv_cache_gb_on(self, on_cpu: bool) -> Optional[float]:
        """The rank's KV-cache size to request (GiB), None = let vLLM size it (see the field)."""
        if self.kv_cache_memory_gb is None and on_cpu and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            return CPU_KV_CACHE_GB
        return self.kv_cache_memory_gb

    def check_sampling(self, params: SamplingConfig) -> None:
        """Reject sampling settings whose "tempered" logprobs vLLM cannot return.

        vLLM's processed logprobs are taken after top-k/top-p masking; with truncation they are
        log p_tempered − log(kept mass), not the trainer's tempered value.

        Raises:
            ValueError: ``logprobs_mode="tempered"`` with ``temperature > 0`` and ``top_p < 1`` or
                ``top_k > 0``.
        """
        truncates = params.temperature > 0 and (params.top_p < 1.0 or params.top_k > 0)
        if self.logprobs_mode == "tempered" and truncates:
            raise ValueError(
                "rollout.vllm.logprobs_mode='tempered' needs untruncated sampling (rollout.sampling."
                f"top_p=1, top_k=0; got top_p={params.top_p}, top_k={params.top_k}): vLLM returns "
                "logprobs of the truncated distribution. Set rollout.vllm.logprobs_mode=processed.")


def check_model_for_vllm(hf_config, on_cpu: bool) -> None:
    """Fail before vLLM starts when its CPU attention kernel cannot run this model.

    Raises:
        ValueError: on CPU, a head size (``head_dim`` or hidden/heads) vLLM's CPU kernel lacks.
    """
    if not on_cpu:
        return
    # a vision-language config keeps the language model's shape in its text config
    hf_config = hf_config.get_text_config()
    heads = getattr(hf_config, "num_attention_heads", None)
    head = getattr(hf_config, "head_dim", None) or (hf_config.hidden_size // heads if heads else None)
    if head is not None and head not in CPU_HEAD_SIZES:
        raise ValueError(f"vLLM's CPU backend supports head sizes {CPU_HEAD_SIZES}; the model has "
                         f"{head}. For a tiny model set e.g. model.tiny.num_attention_heads=2 "
                         "model.tiny.num_key_value_heads=1 (hidden 64 / 2 heads = 32)")


def _job_kv_gb(job: RolloutJob, kv: Optional[KVShape], engines: int
               ) -> Optional[tuple[float, str]]:
    """The rank's KV cache for ``job`` in GiB, rounded up to 0.25, and how it was reached, for
    the console (None: the job's sequence length or the model's KV cost is unknown):
    :meth:`RolloutJob.kv_tokens` × bytes per token × ``KV_HEADROOM``, and at least 1.1 × one
    ``max_model_len`` sequence per engine (vLLM refuses a cache that cannot hold one)."""
    tokens = job.kv_tokens()
    if kv is None or not tokens or kv.bytes_per_token <= 0:
        return None
    demand = tokens * kv.bytes_per_token * KV_HEADROOM
    floor = engines * 1.1 * kv.max_model_len * kv.bytes_per_token
    how = (f"the job's largest call: {tokens:,} tokens x {kv.bytes_per_token:,} B x "
           f"{KV_HEADROOM:g} headroom over {engines} engine(s)")
    if floor > demand:
        how = (f"{engines} engine(s) x 1.1 x one {kv.max_model_len:,}-token sequence, vLLM's "
               f"least (the job's largest call needs {demand / 2**30:.2f} GiB with headroom)")
    return math.ceil(max(demand, floor) / 2**30 * 4) / 4, how
