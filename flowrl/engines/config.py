"""The engines' settings as the run config holds them: ``rollout.hf`` (:class:`HFRolloutConfig`),
``trainer.engine`` (:class:`TrainEngineConfig`), ``reward.model`` (:class:`RewardModelConfig`).

No torch or transformers here: ``flowrl/config.py`` composes these into the run config, which is
validated before anything heavy is imported (a mistyped field answers at once). The engines
import their section from here (``rollout.vllm``: ``engines/rollout/vllm_config.py``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

from flowrl.models.bundled import SMOLLM2
from flowrl.models.loading import ModelConfig

if TYPE_CHECKING:
    from flowrl.engines.rollout.vllm_config import RolloutJob

_CACHE_IMPLEMENTATIONS = (None, "static", "dynamic")
# rollout.hf.compile=null stays off: transformers' compiled decode over the static KV cache measured
# 3x eager in isolation (24.3k against 8.0k tok/s static, 256 sequences of a 0.5B model on the H200,
# benchmarks/results/rollout_h200.md), but inside the training loop it was slower than eager: the
# e2e HF pair at 876beea (2026-12-06, rollout.hf.compile=true) generated 256 x 256 tokens in 7.77 s
# [7.72-7.98] against TRL's 5.85 s in the same interleaved call, where eager had 6.10 s against
# TRL's 6.04 s on 2026-12-04 (benchmarks/results/e2e_vs_trl_h200.md). Until an interleaved in-loop
# run shows it faster, it is opt-in.
# tokens: with the compiled decode, prompt + max_new_tokens is padded up to a multiple of this, so
# the static cache (and the compiled graph) keep one shape across calls; transformers keeps the
# largest cache length it has seen (its _previous_max_cache_length), so one bucket per job
HF_CACHE_BUCKET = 256


@dataclass
class HFRolloutConfig:
    """Configuration of :class:`HFRolloutEngine`.

    Attributes:
        batch_size: most sequences per ``generate`` call; larger batches are cut into chunks.
        cache_implementation: KV cache kind handed to transformers ("static", "dynamic", or None for
            the model's default; with ``compile`` on, None means "static").
        compile: let transformers compile the decoding forward (``torch.compile``, its
            "reduce-overhead" mode: CUDA graphs) over a static KV cache. None (default) = off
            (:meth:`sized_for` says why: measured slower than eager inside the training loop on
            the H200); ``true`` opts in. transformers only compiles on accelerators (on CPU it is
            a no-op). With it on, each chunk's prompt is left-padded so prompt +
            ``max_new_tokens`` is a multiple of ``HF_CACHE_BUCKET`` tokens: the cache, and the
            compiled step with it, keep one shape across calls (a longer call would otherwise
            recompile), and a chunk of fewer than ``batch_size`` rows is filled up with copies of
            its first row (their samples are discarded).
        dtype: weights dtype of an engine with its own copy (not ``shared``): ``auto`` (the
            module's own; a run resolves it to the trainer's compute dtype, bf16 on CUDA:
            ``flowrl/machine.py``), ``float32``, ``bfloat16``, ``float16``. Decoding is
            memory-bound: bf16 weights read half the bytes of fp32 per token.
        logprobs_mode: what ``rollout_logprobs`` holds, see :meth:`HFRolloutEngine.generate`.
            "tempered" (default) = log softmax(logits / T) over the full vocabulary, the quantity the
            trainer recomputes; "processed" = log-probability under the truncated (top-k/top-p),
            renormalised distribution the token was actually drawn from.
        cudnn_attention: let PyTorch pick cuDNN attention inside ``generate`` on CUDA. Off by
            default: the attention mask makes every prefill and decode call masked SDPA, a
            dynamic KV cache is one key longer at every decode step, and cuDNN builds a graph
            per new shape (36 ms against 0.4 ms per decode call on an H100,
            ``flowrl.models.attention.sdpa_without_cudnn``). Off, SDPA takes the
            memory-efficient kernel (or flash, where no mask is needed).

    On a model with liger-kernel's RMSNorm/SwiGLU/RoPE (``model.liger_kernel``), ``generate``
    (compiled or not) runs transformers' own modules (``models/kernels.eager_kernels``) while the
    trainer recomputes with liger's: the two differ by bf16 rounding, which shows in
    ``rollout/logprob_mismatch`` as a small shift, not a weight-sync fault.
    """

    batch_size: int = 64
    cache_implementation: Optional[str] = None
    compile: Optional[bool] = None
    dtype: str = "auto"
    logprobs_mode: str = "tempered"  # "tempered" | "processed" (OmegaConf has no Literal)
    cudnn_attention: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.cache_implementation not in _CACHE_IMPLEMENTATIONS:
            raise ValueError(f"cache_implementation must be one of {_CACHE_IMPLEMENTATIONS}, "
                             f"got {self.cache_implementation!r}")
        if self.compile and self.cache_implementation == "dynamic":
            raise ValueError("rollout.hf.compile=true needs the static KV cache: set "
                             "rollout.hf.cache_implementation=static (or null), not 'dynamic'")
        if self.compile and self.cache_implementation is None:
            self.cache_implementation = "static"  # what compiling needs; the docstring says so
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.logprobs_mode not in ("tempered", "processed"):
            raise ValueError(f"logprobs_mode must be 'tempered' or 'processed', "
                             f"got {self.logprobs_mode!r}")


    def sized_for(self, job: "RolloutJob", on_cuda: bool) -> tuple["HFRolloutConfig", list[str]]:
        """This engine's configuration for the job: ``compile`` filled in where it is None (one
        reason per filled setting, for the console).

        ``compile`` resolves to off on every device: off the GPU transformers does not compile;
        on CUDA the compiled decode measured slower than eager inside the training loop (the
        comment above ``HF_CACHE_BUCKET`` has the numbers), so it stays an opt-in. An explicit
        ``true`` off the GPU is turned off too, with its reason: it would only pad the prompts
        for a static cache that eager decoding reads slower.

        Args:
            job: the run's rollout demand per rank (``flowrl.engines.rollout.vllm_config
                .RolloutJob``); kept so every engine's rule has one signature.
            on_cuda: the engine's model is on a CUDA device.
        """
        if self.compile and not on_cuda:  # transformers would run eager over a padded static cache
            return dataclasses.replace(self, compile=False, cache_implementation=None), [
                "rollout.hf.compile=false (true has no effect off the GPU, where transformers "
                "does not compile; eager decoding runs with the default cache instead of the "
                "padded static one compiling needs, which was 2-3x slower on CPU)"]
        if self.compile is not None:
            return self, []
        cfg = dataclasses.replace(self, compile=False)
        why = ("not on CUDA: transformers compiles only on accelerators" if not on_cuda else
               "measured slower than eager inside the training loop on the H200, "
               "benchmarks/results/e2e_vs_trl_h200.md; rollout.hf.compile=true opts in")
        return cfg, [f"rollout.hf.compile=false ({why})"]


_NO_TOTAL = ("constant", "constant_with_warmup", "reduce_lr_on_plateau", "inverse_sqrt")


@dataclass
class TrainEngineConfig:
    """Optimisation settings of :class:`LocalTrainEngine` (AdamW + a transformers scheduler).

    Attributes:
        lr, weight_decay, betas, eps: torch AdamW arguments (``betas`` a list for OmegaConf).
        max_grad_norm: global grad-norm clip; <= 0 disables clipping (the norm is still reported).
        micro_batch_size: sequences per forward/backward; a mini-batch is cut into these.
        lr_scheduler: any name ``transformers.get_scheduler`` takes ("constant", "cosine", ...).
        warmup_steps: scheduler warm-up steps (needs a scheduler with warm-up, not "constant").
        total_steps: optimizer steps of the run; required by decaying schedulers.
        gradient_checkpointing: recompute activations in backward (HF models only).
        disable_dropout: zero every dropout probability of a trainable model. The policy-gradient
            ratio compares two forwards of the same weights; dropout would make it != 1 at step 0.
        strategy: ``auto`` (FSDP2 when the world size is > 1, else local), ``local`` or ``fsdp``
            (:class:`flowrl.engines.train.fsdp.FSDPTrainEngine`, also at world size 1).
        max_tokens_per_micro_batch: dynamic micro-batching: cut a mini-batch into the fewest
            micro-batches of at most this many valid (prompt + response) tokens, balanced by
            Karmarkar–Karp (``algorithms/balance.py``); replaces ``micro_batch_size``. None = off.
        mixed_precision: FSDP only. ``auto`` = bf16 parameters with fp32 gradient reduction on
            CUDA, fp32 on CPU; ``bf16`` / ``fp32`` force it.
        weight_bucket_mb: FSDP only. ``named_weights`` gathers full tensors in buckets of about this
            many MiB, so the rollout hand-off never materialises the whole model at once.
        balance_across_ranks: before each forward stage (logprobs, values, updates) the pool's
            ranks swap rows so each holds as many rows with nearly equal tokens
            (``ops/rebalance.py``); outputs return to their rows' owners in order. No-op at
            world size 1.
        logprob_chunk_size: tokens per chunk of the fused LM head + fp32 log-softmax
            (``algorithms/logprobs.linear_logprobs``): logprobs and entropy of the valid response
            tokens come from the final hidden states without materialising (B, R, V) logits, in
            forward or backward; peak extra memory is a few (chunk, V) fp32 buffers. Used for
            transformers causal LMs whose LM head is a plain ``nn.Linear`` (checked once against
            the model's own logits: a softcapped or scaled head falls back); None = the plain
            path (full logits, then ``token_logprobs``).
        logprob_compile: run the chunked head's per-chunk softmax math through ``torch.compile``
            (fewer memory passes over the (chunk, V) logits; compiles on first use, tens of
            seconds). Off by default until ``benchmarks/logprobs.py`` (``chunked+compile``) shows
            it faster on the GPU.
        padding_free: pack each micro-batch's valid tokens into one row with per-sequence position
            ids and document-masked attention (``algorithms/packing.py``), so no padding token is
            computed. ``auto`` = on for transformers models on CUDA whose attention implementation
            handles packed rows without a dense mask (``flash_attention_*``, ``flex_attention``,
            ``sdpa_flex``, ``sdpa_varlen``: opt-in, measured no faster than padded ``sdpa`` on the
            H200's e2e benchmark, ``flowrl/machine.py`` ``AUTO_SDPA_VARLEN``;
            under ``sdpa``/``eager`` transformers builds a dense (T, T) mask over the packed row
            and attention cost grows with the square of the micro-batch's tokens); ``true`` /
            ``false`` force it (``true`` needs a transformers model). A micro-batch whose rows are
            not one contiguous run of valid tokens runs padded.
        cudnn_attention: let PyTorch pick cuDNN attention for padded micro-batches on CUDA
            (SDPA with a padding mask; a packed micro-batch runs its own kernel). Off by
            default: cuDNN builds a graph per new (rows, length) shape (forward and backward;
            0.1-0.4 s each, reported by other projects), and padded micro-batches cut to a token
            budget take a new shape whenever a step's lengths change, inside the update. Off,
            SDPA takes the memory-efficient kernel, which has no per-shape build (attention was
            ~6 % of the 0.5B update's GPU time in the H100 profile). The cost per new shape:
            ``benchmarks/sdpa_shapes.py``.
        reshard_after_forward: FSDP only (``strategy=fsdp``, or any run on CUDA or > 1 rank).
            True: free each layer's gathered parameters (in the compute dtype: bf16 on CUDA)
            after its forward (``fully_shard(reshard_after_forward=...)``) and gather them again
            in backward, per micro-batch. False: keep them gathered through the whole pass,
            across the update's micro-batches too (gathered once per optimizer step); every
            gathered copy is dropped when ``train_step``, ``logprobs`` or ``values`` ends, so an
            optimizer step or an offload never meets a resident copy. Costs the whole model's
            gathered copy on every rank while a pass runs. None = auto: False when the
            pool has one rank (the "shard" is the whole parameter, so resharding only re-casts
            it: 0.82x the update time with False at SmolLM2's shape on an H100,
            benchmarks/results/update_shapes_h100.md), True on more.
        max_param_growth: the post-step guard (``engines/train/guard.py``): the run stops
            with a clear error when a step leaves non-finite parameters or multiplies the
            largest |parameter| by more than this (an AdamW step moves a weight by about lr);
            <= 0 keeps only the finiteness check.
    """

    # 1e-6: TRL's GRPO default and the low end of the 1e-6..3e-6 used for full fine-tuning of
    # 0.1-0.5B models with GRPO; short CPU recipes raise it in their conf/trainer file
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    micro_batch_size: int = 4
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    total_steps: Optional[int] = None
    gradient_checkpointing: bool = False
    disable_dropout: bool = True
    strategy: str = "auto"
    max_tokens_per_micro_batch: Optional[int] = None
    mixed_precision: str = "auto"
    weight_bucket_mb: int = 512
    balance_across_ranks: bool = True
    logprob_chunk_size: Optional[int] = 1024
    logprob_compile: bool = False
    padding_free: str = "auto"
    cudnn_attention: bool = False
    reshard_after_forward: Optional[bool] = None
    max_param_growth: float = 10.0

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two values in [0, 1), got {list(self.betas)}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps > 0 and self.lr_scheduler == "constant":
            raise ValueError("warmup_steps > 0 is ignored by lr_scheduler='constant'; "
                             "use 'constant_with_warmup'")
        if self.lr_scheduler not in _NO_TOTAL and self.total_steps is None:
            raise ValueError(f"total_steps is required by lr_scheduler={self.lr_scheduler!r}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if self.strategy not in ("auto", "local", "fsdp"):
            raise ValueError(f"strategy must be auto, local or fsdp, got {self.strategy!r}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1 or None, "
                             f"got {self.max_tokens_per_micro_batch}")
        if self.mixed_precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"mixed_precision must be auto, bf16 or fp32, got {self.mixed_precision!r}")
        if self.weight_bucket_mb < 1:
            raise ValueError(f"weight_bucket_mb must be >= 1, got {self.weight_bucket_mb}")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size must be >= 1 or None, got {self.logprob_chunk_size}")
        # YAML `true`/`false` reach a str field as "True"/"False" (OmegaConf) or as bools
        self.padding_free = str(self.padding_free).lower()
        if self.padding_free not in ("auto", "true", "false"):
            raise ValueError(f"padding_free must be auto, true or false, got {self.padding_free!r}")


@dataclass
class RewardModelConfig:
    """``reward.model`` of the run config (used when a graph has a ``reward_model`` stage).

    Attributes:
        model: the RM checkpoint: ``path`` = a local HF directory holding a sequence-classification
            model (its head is loaded with ``num_labels=1``), or ``tiny`` = a random one for tests.
            ``path: smollm2`` alone is rejected: the causal LM has no trained reward head.
        batch_size: sequences per forward pass.
    """

    model: Any = None  # Optional[ModelConfig]; Any so a CLI/YAML dict can fill a None section
    batch_size: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.model, Mapping):
            try:
                self.model = ModelConfig(**{str(k): v for k, v in self.model.items()})
            except TypeError as e:
                raise ValueError(f"reward.model.model: {e}") from e
        if self.model is not None and not isinstance(self.model, ModelConfig):
            raise ValueError(f"reward.model.model must be null or a model section, got {self.model!r}")
        if self.batch_size < 1:
            raise ValueError(f"reward.model.batch_size must be >= 1, got {self.batch_size}")
        if self.model is not None and self.model.tiny is None and self.model.path == SMOLLM2:
            raise ValueError("reward.model.model.path must be a local sequence-classification "
                             "checkpoint directory (or set reward.model.model.tiny for tests); "
                             "'smollm2' is a causal LM with no reward head")


__all__ = ["HFRolloutConfig", "RewardModelConfig", "TrainEngineConfig"]
