"""Typed seams between ops and the heavy engines (see DESIGN.md "Seams").

Shapes: B = sequences in the batch, P = prompt width (left-padded), R = response width
(right-padded). Masks are ``torch.bool``; logprobs/entropies are float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Protocol,
    runtime_checkable,
)

if TYPE_CHECKING:  # the configs here are read before torch loads (flowrl/config.py)
    import torch
    from torch import Tensor, nn

    from flowrl.engines.config import TrainEngineConfig


# SamplingConfig.logprobs: whether a generate call returns the sampled tokens' logprobs
LOGPROB_MODES = ("all", "sampled", "none")
# ... under "sampled": the training steps that measure them, 1 and every this many after it
LOGPROB_SAMPLE_EVERY = 8


def logprobs_measured(mode: str, step: int) -> bool:
    """Does training step ``step`` (1-based) ask its rollout engine for logprobs under ``mode``
    (``SamplingConfig.logprobs``; ``auto`` = ``all``): ``sampled`` measures steps 1, 9, 17, ...
    (``LOGPROB_SAMPLE_EVERY``), ``none`` no step, the rest every step."""
    if mode == "none":
        return False
    if mode == "sampled":
        return (step - 1) % LOGPROB_SAMPLE_EVERY == 0
    return True


@dataclass
class SamplingConfig:
    """Sampling parameters of one generate call.

    ``temperature == 0`` means greedy decoding (then ``rollout_logprobs`` are taken at T=1).
    ``stop_token_ids`` are stop ids in addition to the tokenizer's EOS; the stop token itself is kept
    in the response (and in ``response_mask``).

    ``logprobs``: does ``rollout_logprobs`` hold the sampler's logprobs (``LOGPROB_MODES``):
    ``all``; ``none`` (every valid token NaN: not measured); ``sampled``: the run's rollout ops
    ask for ``all`` on steps 1, 9, 17, ... and ``none`` on the others (:func:`logprobs_measured`),
    so ``rollout/logprob_mismatch`` is still logged on those steps; an engine handed ``sampled``
    or ``auto`` measures all. ``auto`` is resolved before the run (``flowrl/machine.py``: ``all``
    when the loss reads them, i.e. ``algorithm.rollout_is`` is set, or the backend is ``hf``,
    whose logprobs cost nothing; else ``sampled``). Why: asked for any row, vLLM computes and
    returns them for its whole batch every decode step: 1.69 s against 1.55 s without for 256
    sequences on 4 engine processes (H100, ``benchmarks/results/rollout_logprobs_h100.md``; one
    request group in 8 still cost 1.69 s), and in-process GRPO reads them for a metric only.
    """

    # 1.0: the on-policy sampling standard for GRPO/PPO (TRL's and verl's default): the sampler's
    # distribution is the policy's, so rollout_logprobs and the trainer's logprobs describe the
    # same π. A model that needs a cooler sampler says so in its conf/model group (SmolLM2: 0.7)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    # 256: GSM8K chain-of-thought answers of small instruct models run ~150-250 tokens; the same
    # budget as greedy evaluation (EvalConfig.max_new_tokens). CPU recipes that shorten it for
    # speed do so in their conf/trainer file
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: str = "auto"  # auto | all | sampled | none (OmegaConf has no Literal)

    def __post_init__(self) -> None:
        if self.logprobs not in LOGPROB_MODES + ("auto",):
            # YAML's true/false reach this str field as "True"/"False" (OmegaConf)
            got = (f"{str(self.logprobs).lower()} (a boolean: all or none?)"
                   if str(self.logprobs) in ("True", "False") else repr(self.logprobs))
            raise ValueError(f"rollout.sampling.logprobs must be auto or one of {LOGPROB_MODES}, "
                             f"got {got}")
        if self.temperature < 0:
            raise ValueError(f"rollout.sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"rollout.sampling.top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class RolloutBatch:
    """Output of :meth:`RolloutEngine.generate`.

    Attributes:
        response_ids: (B, R) int64, right-padded with the pad id after the response.
        response_mask: (B, R) bool; True up to and including the first stop token, False after.
        rollout_logprobs: (B, R) float32; log π_sampler(token) at the sampling temperature, 0 where
            the mask is False; NaN where it is True when the call asked for none
            (``SamplingConfig.logprobs``).
        truncated: (B,) bool; True when generation hit ``max_new_tokens`` without a stop token.
    """

    response_ids: Tensor
    response_mask: Tensor
    rollout_logprobs: Tensor
    truncated: Tensor


class Engine(Protocol):
    """What every role's engine offers the runtime: where it computes, and how the colocated
    plan swaps it off and back onto the device between phases (DESIGN.md "Seams").

    ``device``: where its methods take their batch and return results (the executor moves a
    stage's inputs there; DESIGN.md "Where tensors live").
    ``last_timings``: seconds (and, for a weight gather, ``gather_bytes``) of its last call, keyed
    by what was timed (``offload_s``, ``generate_s``, ...); the executor reads it after a sync.
    """

    device: torch.device
    last_timings: dict[str, float]

    def offload(self, keep_weights: bool = False) -> None:
        """Give device memory back (a colocated swap point); a timed no-op on CPU.
        ``keep_weights``: the parameters stay (the rollout engine that shares this module serves
        them next); only what else the engine holds (grads, optimizer state, caches) leaves."""
        ...

    def onload(self) -> None:
        """Inverse of :meth:`offload`: ready to compute on ``device`` again."""
        ...

    def close(self) -> None:
        """Release processes and devices the engine holds (idempotent); run on the way out."""
        ...


class RolloutEngine(Engine, Protocol):
    """Generates responses (roles ``rollout`` and ``genrm``). Implementations:
    ``engines/rollout/hf.py``, ``vllm.py``, ``vllm_proc.py``; ``envs/rollout.MultiTurnEngine``
    (whole trajectories, for evaluation).

    ``device``: the HF engine's module's device; vLLM's is the host (it takes token lists).
    ``shared``: True when the engine runs the actor's own module (HF, one process): then the
    actor's ``offload(keep_weights=True)`` keeps the weights this engine serves next.
    ``last_prefix_cache``: ``{"prompt_tokens": n, "cached_tokens": m}`` of the last ``generate``
    (m = prompt tokens a prefix cache served; 0 for an engine without one).
    """

    shared: bool
    last_prefix_cache: dict[str, int]

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingConfig,
                 generator: torch.Generator | None = None,
                 images: Mapping[str, Tensor] | None = None) -> RolloutBatch:
        """prompt_ids/prompt_mask: (B, P) left-padded. One response per row. ``images``: the
        rows' vision inputs (``pixel_values`` (B, N, D), ``image_grid_thw`` (B, K, 3);
        ``flowrl.data.images``) for a vision-language model, None for text."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy full (unsharded) weights in place, e.g. after an actor update.

        Raises:
            KeyError: a name the model does not have. ValueError: a shape mismatch or an
                incomplete set where the engine needs all of them.
        """
        ...


@runtime_checkable
class WeightReadback(Protocol):
    """An engine that can read back what it holds (``runtime/step/weight_check.py``: after each
    weight sync, the run checks that the weights really arrived)."""

    def weight_samples(self, index: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """For each name in ``index`` that this engine holds as one tensor under that (HF) name:
        its values at the flat positions ``index[name]`` (1-D int64, CPU), in the engine's own
        dtype, on CPU. Names it does not hold so (vLLM's fused ``qkv_proj``) are left out."""
        ...


@dataclass
class LogprobOutput:
    """logprobs: (B, R) float32, 0 where response_mask is False. entropy: same shape or None."""

    logprobs: Tensor
    entropy: Tensor | None = None


# loss_fn(micro_batch, logprobs (b, R), entropy (b, R) | None) -> (scalar loss, metrics).
# The loss is already normalised by *global* mini-batch denominators, so the engine only sums the
# micro-batch gradients (never averages them). Metrics are detached 0-dim tensors (or floats) on
# the engine's device; the engine sums them and reads them once per train_step (no sync per
# micro-batch).
LossFn = Callable[[Mapping[str, "Tensor"], "Tensor", "Tensor | None"],
                  tuple["Tensor", dict[str, "Tensor | float"]]]


class LogprobEngine(Engine, Protocol):
    """Scores given responses under a causal LM (roles ``ref`` and ``teacher``, and every actor engine):
    ``engines/train/local.py`` (one process), its FSDP2 variant (``fsdp.py``), LoRA's
    adapter-disabled reference (``models/lora.py``).

    ``device``: the device of its parameters; ``logprobs`` takes its batch there (the executor
    moves it) and returns there. ``model``: the module (an HF rollout engine may share it).
    ``cfg``: micro-batching and cross-rank balancing (``TrainEngineConfig``). ``lockstep``: every
    rank of its pool must run the same forwards/backwards (FSDP2 collectives), so ranks never
    skip or add a micro-batch alone.
    """

    model: nn.Module
    cfg: TrainEngineConfig
    lockstep: bool

    def logprobs(self, batch: Mapping[str, Tensor], temperature: float,
                 with_entropy: bool = False) -> LogprobOutput:
        """batch holds prompt_ids, prompt_mask (B, P) and response_ids, response_mask (B, R)."""
        ...


class Trainable(Engine, Protocol):
    """What every trained model offers (actor and critic): one optimizer step per mini-batch
    and its state for checkpoints. The micro-batches ``loss_fn`` sees are slices of the batch on
    ``device``, so every tensor a loss function touches is there. ``model``, ``cfg``,
    ``lockstep``: as :class:`LogprobEngine`."""

    model: nn.Module
    cfg: TrainEngineConfig
    lockstep: bool

    def train_step(self, batch: Mapping[str, Tensor], loss_fn: LossFn, temperature: float,
                   with_entropy: bool = False, entropy_grad: bool = True) -> dict[str, float]:
        """One optimizer step over ``batch`` (a mini-batch), cut into micro-batches inside.
        ``entropy_grad=False``: the entropy handed to loss_fn is a metric (no autograd graph).
        Returns ``loss``, ``grad_norm``, ``lr``, ``skipped`` (0/1) and loss_fn's metrics summed."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optimizer", "scheduler"}`` in ``torch.distributed.checkpoint`` form."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainEngine(LogprobEngine, Trainable, Protocol):
    """The trained policy (role ``actor``): logprobs, updates, and full weights for the rollout
    engine (``engines/train/local.py``, ``fsdp.py``, ``models/lora.py``)."""

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) of the weights the rollout engine needs; an FSDP engine
        gathers them (a collective: every rank of the pool iterates to the end)."""
        ...


class ValueEngine(Trainable, Protocol):
    """A value model (role ``critic``, PPO): ``engines/train/value.py``. Its ``train_step``
    hands ``loss_fn`` the values (b, R) where an actor's hands logprobs."""

    def values(self, batch: Mapping[str, Tensor]) -> Tensor:
        """(B, R) float32 V(s_t) at every response position, 0 where response_mask is False."""
        ...


class RewardScorer(Engine, Protocol):
    """A sequence-classification reward model (role ``reward_model``): ``engines/reward_model.py``."""

    def score(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
              response_mask: Tensor) -> Tensor:
        """(B,) float32 reward of every (prompt (B, P) left-padded, response (B, R)) row."""
        ...
