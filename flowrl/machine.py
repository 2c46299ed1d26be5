"""GPU defaults: the ``auto`` settings of a run, resolved from the machine before any model loads.

The same command runs on a laptop CPU and on a GPU node; what differs is decided here, once, and
printed (``flowrl plan`` and a run's first lines), so a run never silently does something else:

====================================  ===========================================================
setting (``auto``)                    CUDA visible                          / CPU only
====================================  ===========================================================
``trainer.device``                    ``cuda`` (``cuda:LOCAL_RANK`` under torchrun) / ``cpu``
``model.dtype`` (master weights)      ``float32``; compute in bf16 through the train engine's
                                      mixed precision (FSDP2 ``MixedPrecisionPolicy``: bf16
                                      parameters in forward/backward, fp32 gradient reduction)
                                                                            / ``float32``
``trainer.engine.strategy``           ``fsdp`` also on one rank, so world size 1 has exactly the
                                      numerics of world size N              / ``local`` (1 rank)
``rollout.backend``                   ``vllm`` when the package imports (engine processes,
                                      ``benchmarks/results/rollout_h200.md``), else ``hf``
                                                                            / ``hf``
``rollout.hf.dtype``, ``.vllm.dtype`` ``bfloat16`` (the trainer's compute dtype) / the model's
``model.attn_implementation``         ``flash_attention_2`` when ``flash_attn`` imports, else
                                      ``sdpa`` (``sdpa_varlen``, packed micro-batches under torch's
                                      varlen_attn, is opt-in: ``AUTO_SDPA_VARLEN``; with it on, it
                                      is picked when torch has varlen_attn, the GPU is sm80+,
                                      compute is bf16/fp16 and the prompts have no images)
                                                                            / ``sdpa``
``trainer.engine.max_tokens_per_      16384 tokens per micro-batch (packed: valid tokens;
micro_batch`` (null)                  padded: rows x longest row)           / null (rows)
``rollout.sampling.logprobs``        ``all`` when ``algorithm.rollout_is`` is set or the
                                      backend is hf; else ``sampled`` (steps 1, 9, 17, ...: vLLM
                                      decodes ~8% faster without them) / the same rule
``model.liger_kernel``                ``true`` when liger-kernel imports, the model is a
                                      llama/qwen2/qwen3/mistral (fused Triton RMSNorm, SwiGLU,
                                      RoPE: the update 0.85x on the H200,
                                      ``benchmarks/results/update_step_h200.md``) and the job's
                                      updates come to ``LIGER_MIN_JOB_PFLOP`` (10 PFLOP: liger's
                                      import takes ~10 s)                   / ``false``
====================================  ===========================================================

An explicit setting always wins. ``trainer.offload`` (``auto``) is resolved when the models are
built, from their sizes (:func:`keep_resident`).
"""
from __future__ import annotations

import importlib.util
import os

# trainer.offload=auto is decided where the engines are built (runtime/step/resources.py)
from flowrl.engines.base import LOGPROB_SAMPLE_EVERY
from flowrl.models.bundled import SMOLLM2
from flowrl.models.kernels import (
    AUTO_MODEL_TYPES,
    LIGER_MIN_JOB_PFLOP,
    job_update_pflop,
    liger_importable,
    liger_supported_types,
    model_type_of,
)
from flowrl.runtime.control.preflight import ConfigError
from flowrl.runtime.control.spec import Resolved

# the token budget of a GPU micro-batch: the scaling benchmark's bins (benchmarks/results/scaling.md)
GPU_TOKENS_PER_MICRO_BATCH = 16384
# (not larger for small models: 32,768 made the 0.5B shape's update 0.80 s against 0.88 s on an
# H100 but its peak device memory 35.7 GiB against 25.2, the process tree's 66 GiB against TRL's
# 35: benchmarks/results/e2e_vs_trl_h100.md; the memory goal is <= TRL's)
# whether model.attn_implementation=auto picks sdpa_varlen (packed micro-batches) on CUDA. Off:
# on the H200 (torch 2.11, whose varlen_attn has no enable_gqa, so key/value heads are repeated)
# the e2e benchmark's update took 1.22 s with it against 1.07-1.10 s padded under sdpa in the
# earlier runs (update MFU 16.1 % vs 18-19 %; benchmarks/results/e2e_vs_trl_h200.md), on a job
# whose responses nearly all reach max_new_tokens (little padding to remove). It passed the GPU
# tier's mismatch bounds; opt in with model.attn_implementation=sdpa_varlen, and turn this on
# once benchmarks/packing_gpu_check.py measures it faster on variable-length batches.
AUTO_SDPA_VARLEN = False


# device nodes a CUDA (or ROCm/HIP, which torch.cuda also drives) runtime needs: NVIDIA, WSL, AMD
_GPU_DEVICE_NODES = ("nvidiactl", "nvidia0", "dxg", "kfd")


def cuda_available() -> bool:
    """torch sees a CUDA device. On a machine with no GPU device node this answers without
    importing torch (seconds on a small CPU box), so a rejected config or graph is reported
    before torch loads; elsewhere torch is asked."""
    if not any(os.path.exists(f"/dev/{n}") for n in _GPU_DEVICE_NODES):
        return False
    import torch

    return torch.cuda.is_available()


def vllm_importable() -> bool:
    """vLLM is installed (found without importing it: importing vLLM takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def flash_attn_importable() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def varlen_attn_usable() -> bool:
    """torch's variable-length FlashAttention (``torch.nn.attention.varlen.varlen_attn``) runs on
    this machine's CUDA device: torch has it and the GPU is sm80+ (imports torch)."""
    from flowrl.models.attention import varlen_attn_supported

    return varlen_attn_supported()


def resolve_machine_defaults(cfg, *, cuda: bool | None = None, vllm: bool | None = None,
                             flash_attn: bool | None = None, varlen: bool | None = None,
                             liger: bool | None = None) -> list[Resolved]:
    """Replace every ``auto`` of ``cfg`` (a ``flowrl.config.TrainConfig``) by its value on this
    machine, in place; returns what was resolved and why (explicit settings are left alone).

    ``cuda`` / ``vllm`` / ``flash_attn`` / ``varlen`` (:func:`varlen_attn_usable`, asked only with
    a CUDA device visible) / ``liger`` (liger-kernel installed) override what is detected (tests;
    None = detect).

    An explicit ``trainer.device=cuda`` resolves as a GPU run even without a visible device (so a
    GPU job can be planned anywhere); ``flowrl train`` refuses to start it.

    What this machine cannot run (vLLM missing, ...) still plans: :func:`machine_problems`
    lists it, and ``flowrl train`` refuses to start.
    """
    cuda = cuda_available() if cuda is None else cuda
    vllm = vllm_importable() if vllm is None else vllm
    flash_attn = flash_attn_importable() if flash_attn is None else flash_attn
    out: list[Resolved] = []
    t, m, r = cfg.trainer, cfg.model, cfg.rollout
    # an explicit trainer.device=cuda on a CPU-only machine still plans (a GPU job inspected from a
    # laptop: flowrl plan); a run refuses it before anything loads (train.check_device)
    if t.device == "auto":
        t.device = "cuda" if cuda else "cpu"
        out.append(Resolved("trainer.device", t.device,
                            "a CUDA device is visible" if cuda else "no CUDA device"))
    on_gpu = t.device == "cuda"
    if m.dtype == "auto":
        m.dtype = "float32"
        out.append(Resolved("model.dtype", m.dtype, "fp32 master weights; bf16 compute by "
                            "trainer.engine.mixed_precision" if on_gpu else "fp32 on CPU"))
    e = t.engine
    bf16 = e.mixed_precision == "bf16" or (e.mixed_precision == "auto" and on_gpu)
    if e.strategy == "auto" and on_gpu:
        e.strategy = "fsdp"
        out.append(Resolved("trainer.engine.strategy", "fsdp", "on CUDA even at one rank: the "
                            "numerics of world size 1 are those of N (bf16 compute, fp32 reduce)"))
    if e.max_tokens_per_micro_batch is None and on_gpu:
        e.max_tokens_per_micro_batch = GPU_TOKENS_PER_MICRO_BATCH
        out.append(Resolved("trainer.engine.max_tokens_per_micro_batch", GPU_TOKENS_PER_MICRO_BATCH,
                            "token-budget micro-batches on GPU"))
    if r.backend == "auto":
        # vLLM takes images (multi_modal_data) but has not been measured on them on the GPU
        # yet (tests/gpu/test_vlm_vllm_gpu.py): ask for it with rollout=vllm
        images = cfg.data.has_images
        r.backend = "vllm" if on_gpu and vllm and not images else "hf"
        out.append(Resolved("rollout.backend", r.backend,
                            "CUDA and vLLM installed" if r.backend == "vllm" else
                            "prompts with images (rollout=vllm takes them too)" if images and on_gpu else
                            ("vLLM is not installed" if on_gpu else "CPU run: transformers generate")))
        if r.backend == "vllm":
            r.vllm.check_sampling(r.sampling)
    if r.sampling.logprobs == "auto":
        reads = cfg.algorithm.rollout_is != "none"
        r.sampling.logprobs = "all" if reads or r.backend != "vllm" else "sampled"
        out.append(Resolved("rollout.sampling.logprobs", r.sampling.logprobs,
                            f"algorithm.rollout_is={cfg.algorithm.rollout_is} weighs every token by it"
                            if reads else "transformers' logprobs cost nothing" if r.backend != "vllm"
                            else f"nothing in the loss reads them: steps 1, "
                                 f"{1 + LOGPROB_SAMPLE_EVERY}, {1 + 2 * LOGPROB_SAMPLE_EVERY}, ... "
                                 "ask vLLM for them and log rollout/logprob_mismatch; the others "
                                 "decode ~8% faster without"))
    compute = "bfloat16" if bf16 and m.dtype == "float32" else m.dtype
    for name, sec in (("rollout.hf.dtype", r.hf), ("rollout.vllm.dtype", r.vllm)):
        if sec.dtype == "auto":
            sec.dtype = compute
            if name.split(".")[1] == r.backend:
                out.append(Resolved(name, compute, "the trainer's compute dtype"))
    if m.liger_kernel == "auto":
        liger = liger_importable() if liger is None else liger
        kind = model_type_of(m.path, m.tiny, SMOLLM2)
        supported = on_gpu and liger and kind in AUTO_MODEL_TYPES
        pflop = _liger_job_pflop(cfg) if supported else None
        on = supported and (pflop is None or pflop >= LIGER_MIN_JOB_PFLOP)
        m.liger_kernel = "true" if on else "false"
        job = "" if pflop is None else f"; the job's updates ~{pflop:.3g} PFLOP"
        out.append(Resolved("model.liger_kernel", m.liger_kernel,
                            "CPU: liger's Triton kernels need a GPU" if not on_gpu else
                            "liger-kernel is not installed (pip install liger-kernel)" if not liger else
                            f"fused RMSNorm/SwiGLU/RoPE for the {kind} model{job}" if on else
                            f"the job's updates ~{pflop:.3g} PFLOP, < {LIGER_MIN_JOB_PFLOP:g}: "
                            "liger's import (~10 s) would cost more than its kernels save; "
                            "model.liger_kernel=true turns it on" if supported else
                            f"model type {kind!r}: not one auto turns liger on for "
                            f"({', '.join(AUTO_MODEL_TYPES)}; model.liger_kernel=true tries it)"))
    if m.attn_implementation == "auto":
        # sdpa_varlen packs micro-batches (padding_free=auto) with nothing to compile; not
        # sdpa_flex: on the H200 its first compile made step 1 of the default job take 50-70 s
        # (benchmarks/results/first_step_h200.md). varlen_attn is FlashAttention: bf16/fp16 only;
        # a vision-language model's micro-batches run padded anyway (engines/train/local.py)
        # the train engine's compute dtype: bf16/fp16 weights, or fp32 ones under FSDP's bf16
        # mixed precision (a local engine computes in its weights' dtype)
        half = m.dtype in ("bfloat16", "float16") or (bf16 and e.strategy == "fsdp")
        images = cfg.data.has_images
        wanted = AUTO_SDPA_VARLEN and on_gpu and not flash_attn and half and not images
        if wanted and varlen is None:
            varlen = cuda and varlen_attn_usable()
        if on_gpu and flash_attn:
            m.attn_implementation, why = "flash_attention_2", "flash-attn installed"
        elif wanted and varlen:
            m.attn_implementation, why = "sdpa_varlen", ("flash-attn not installed; torch's "
                                                         "varlen_attn packs micro-batches")
        else:
            m.attn_implementation = "sdpa"
            why = ("CPU" if not on_gpu else "flash-attn not installed; " + (
                "sdpa_varlen measured no faster on the H200: opt-in" if not AUTO_SDPA_VARLEN else
                "fp32 compute (varlen_attn takes bf16/fp16)" if not half else
                "prompts with images" if images else
                "no torch varlen_attn or an sm80+ GPU" if cuda else
                "no CUDA device here to check for varlen_attn"))
        out.append(Resolved("model.attn_implementation", m.attn_implementation, why))
    return out


def machine_problems(cfg, *, cuda: bool | None = None, vllm: bool | None = None,
                     flash_attn: bool | None = None, varlen: bool | None = None) -> list[str]:
    """What a resolved ``cfg`` asks that this machine cannot run, one line each (empty: runnable).
    ``flowrl train`` refuses to start on any (before anything loads); ``flowrl plan`` prints them,
    since a GPU job may be planned from a laptop."""
    cuda = cuda_available() if cuda is None else cuda
    vllm = vllm_importable() if vllm is None else vllm
    flash_attn = flash_attn_importable() if flash_attn is None else flash_attn
    on_gpu = cfg.trainer.device == "cuda"
    attn = cfg.model.attn_implementation
    out = []
    if on_gpu and not cuda:
        out.append("trainer.device=cuda but no CUDA device is visible (use trainer.device=auto or cpu)")
    if cfg.rollout.backend == "vllm" and not vllm:
        out.append("rollout=vllm but vLLM is not installed here (GPU: pip install vllm; CPU: the "
                   ".venv-vllm of scripts/install.sh --vllm), or use rollout=hf")
    if attn == "flash_attention_2" and not (on_gpu and flash_attn):
        out.append("model.attn_implementation=flash_attention_2 needs CUDA and the flash-attn "
                   "package; use auto or sdpa")
    if attn == "sdpa_varlen" and on_gpu and not (
            (cuda and varlen_attn_usable()) if varlen is None else varlen):
        out.append("model.attn_implementation=sdpa_varlen on CUDA needs torch's "
                   "torch.nn.attention.varlen.varlen_attn (torch >= 2.10) and an sm80+ GPU; use "
                   "auto, sdpa_flex or sdpa")
    if cfg.model.liger_kernel == "true":
        if not on_gpu:
            out.append("model.liger_kernel=true needs trainer.device=cuda (liger-kernel's Triton "
                       "kernels run on a GPU); use auto or false")
        elif not liger_importable():
            out.append("model.liger_kernel=true but liger-kernel is not installed here "
                       "(pip install liger-kernel); use auto or false")
        else:
            kind = model_type_of(cfg.model.path, cfg.model.tiny, SMOLLM2)
            if kind is not None and kind not in liger_supported_types():
                out.append(f"model.liger_kernel=true: liger-kernel has no kernels for model type "
                           f"{kind!r}; use auto or false")
    if attn == "flex_attention" and not on_gpu:
        out.append("model.attn_implementation=flex_attention runs on CUDA only (on CPU its kernels "
                   "fail to compile); use auto or sdpa")
    return out


def _liger_job_pflop(cfg) -> float | None:
    """:func:`flowrl.models.kernels.job_update_pflop` of the run (None where the model's size
    cannot be read without loading it: auto then keeps liger on, as before the job rule)."""
    from flowrl.models.size import model_size

    try:
        n_params = model_size(cfg.model).n_params
    except (OSError, ValueError, KeyError):
        return None
    t = cfg.trainer
    rows = t.total_steps * t.prompts_per_step * cfg.algorithm.n
    return job_update_pflop(n_params, rows,
                            cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens,
                            cfg.algorithm.ppo_epochs)


def check_machine(cfg) -> None:
    """Refuse a resolved ``cfg`` this machine cannot run (``flowrl train``, before anything
    loads; ``flowrl plan`` only prints :func:`machine_problems`).

    Raises:
        ConfigError: naming the first problem (vLLM missing, no CUDA, ...).
    """
    problems = machine_problems(cfg)
    if problems:
        raise ConfigError(problems[0])
