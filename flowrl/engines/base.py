"""Typed seams between ops and the heavy engines (see DESIGN.md "Seams").

Shapes: B = sequences in the batch, P = prompt width (left-padded), R = response width
(right-padded). Masks are ``torch.bool``; logprobs/entropies are float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping, Protocol

if TYPE_CHECKING:  # the configs here are read before torch loads (flowrl/config.py)
    import torch
    from torch import Tensor


@dataclass
class SamplingConfig:
    """Sampling parameters of one generate call.

    ``temperature == 0`` means greedy decoding (then ``rollout_logprobs`` are taken at T=1).
    ``stop_token_ids`` are stop ids in addition to the tokenizer's EOS; the stop token itself is kept
    in the response (and in ``response_mask``).
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

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class RolloutBatch:
    """Output of :meth:`RolloutEngine.generate`.

    Attributes:
        response_ids: (B, R) int64, right-padded with the pad id after the response.
        response_mask: (B, R) bool; True up to and including the first stop token, False after.
        rollout_logprobs: (B, R) float32; log π_sampler(token) at the sampling temperature, 0 where
            the mask is False.
        truncated: (B,) bool; True when generation hit ``max_new_tokens`` without a stop token.
    """

    response_ids: Tensor
    response_mask: Tensor
    rollout_logprobs: Tensor
    truncated: Tensor


class RolloutEngine(Protocol):
    """Generates responses. Implementations: ``engines/rollout/hf.py``, ``vllm.py``, ``vllm_proc.py``.

    ``device``: where ``generate`` wants its prompts and returns its batch (the HF engine: its
    module's device; vLLM: the host, since it takes token lists). The executor moves a stage's
    inputs there (DESIGN.md "Where tensors live").
    """

    device: torch.device

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingConfig,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        """prompt_ids/prompt_mask: (B, P) left-padded. One response per row."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy full (unsharded) weights in place, e.g. after an actor update."""
        ...

    def sleep(self) -> None: ...  # give device memory back (colocated plans)

    def wake(self) -> None: ...


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


class TrainEngine(Protocol):
    """A trainable (actor, critic) or frozen (ref) model: ``engines/train/local.py`` (one
    process) and its FSDP2 variant (``fsdp.py``).

    ``device``: the device of its parameters; ``logprobs``/``train_step`` take their batch there
    (the executor moves it) and return there, and the micro-batches ``loss_fn`` sees are slices of
    that batch, so every tensor a loss function touches is on ``device``.
    """

    device: torch.device

    def logprobs(self, batch: Mapping[str, Tensor], temperature: float,
                 with_entropy: bool = False) -> LogprobOutput:
        """batch holds prompt_ids, prompt_mask (B, P) and response_ids, response_mask (B, R)."""
        ...

    def train_step(self, batch: Mapping[str, Tensor], loss_fn: LossFn, temperature: float,
                   with_entropy: bool = False, entropy_grad: bool = True) -> dict[str, float]:
        """One optimizer step over ``batch`` (a mini-batch), cut into micro-batches inside.
        ``entropy_grad=False``: the entropy handed to loss_fn is a metric (no autograd graph)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
