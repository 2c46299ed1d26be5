"""What an op may touch while it runs: its role's engine, the run's shared resources, metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Mapping, TypeVar

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from flowrl.algorithms.config import AlgorithmConfig
    from flowrl.data.prompts import PromptSource
    from flowrl.engines.base import SamplingConfig

# the engine a stage's op is handed: its role's Protocol (engines/base.py), e.g. an op of the
# rollout role takes ``StageContext[RolloutEngine]``; None for a role-less stage
E = TypeVar("E", covariant=True)


@dataclass
class DistInfo:
    """Rank/world of the pool the stage runs in (world size 1 for the single-process runtime)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup, or None when not initialised


class RunResources:
    """The run-wide objects an op reads, typed (``StageContext.run``): ``ctx.run.algorithm`` is
    the run's ``AlgorithmConfig``, so a type checker follows ``ctx.run.algorithm.kl_coef`` into
    the loss. A view of ``StageContext.resources`` (the executor's name → object mapping, which
    also holds the ops' cross-step state, ``ops/state.py``).

    Raises:
        KeyError: reading a resource the run did not provide, naming the stage.
    """

    def __init__(self, resources: Mapping[str, Any], stage: str) -> None:
        self._resources, self._stage = resources, stage

    def _get(self, name: str) -> Any:
        if name not in self._resources:
            raise KeyError(f"stage '{self._stage}': run has no resource '{name}' "
                           f"(has: {sorted(self._resources)})")
        return self._resources[name]

    @property
    def algorithm(self) -> AlgorithmConfig:
        """The run's ``algorithm`` config (``flowrl.algorithms.config.AlgorithmConfig``)."""
        return self._get("algorithm")

    @property
    def sampling(self) -> SamplingConfig:
        """The rollout's sampling settings (``rollout.sampling``; temperature, max_new_tokens)."""
        return self._get("sampling")

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The policy's tokenizer."""
        return self._get("tokenizer")

    @property
    def judge_tokenizer(self) -> PreTrainedTokenizerBase:
        """The ``genrm`` role's tokenizer (the policy's when the judge has none of its own)."""
        return self._resources.get("genrm_tokenizer") or self.tokenizer

    @property
    def prompts(self) -> PromptSource:
        """The stateful prompt source (this rank's shard)."""
        return self._get("prompts")

    @property
    def prompts_or_none(self) -> PromptSource | None:
        """The prompt source, or None in a run (or a test) without one: ops that only read
        optional prompt fields (the question text, ``data.response_prefix``)."""
        from flowrl.data.prompts import PromptSource

        source = self._resources.get("prompts")
        return source if isinstance(source, PromptSource) else None

    @property
    def prompts_per_step(self) -> int:
        """``trainer.prompts_per_step``: prompts drawn per step (before ``algorithm.n`` copies)."""
        return int(self._get("trainer").prompts_per_step)


@dataclass(frozen=True)
class StageContext(Generic[E]):
    """Handed to every op call. Ops never reach into the TensorStore or other stages.

    Attributes:
        stage: name of the stage being run.
        step: 1-based training step.
        engine: the engine of the stage's role, typed by the role's Protocol
            (``engines/base.py``: ``RolloutEngine`` for ``rollout``/``genrm``, ``TrainEngine``
            for ``actor``, ``LogprobEngine`` for ``ref`` and ``teacher``, ``ValueEngine`` for ``critic``,
            ``RewardScorer`` for ``reward_model``), or None for role-less ops.
        resources: run-wide shared objects by name: ``tokenizer``, ``prompts`` (the stateful prompt
            source), ``algorithm`` (AlgorithmConfig), ``sampling`` (SamplingConfig), ``trainer``,
            and the ops' cross-step state (``ops/state.py``). Ops read the run's objects typed,
            through :attr:`run`.
        dist: rank/world of the stage's pool.
        generator: torch RNG for this stage run (seeded from the run seed and step; checkpointed).
        metrics: scalars the op reported (floats); the executor prefixes nothing, so use
            ``group/name``. Reading it turns every pending tensor into a float at once.
    """

    stage: str
    step: int
    # a role-less stage's context is StageContext[None]: the default fits only that E
    engine: E = None  # type: ignore[assignment]
    resources: dict[str, Any] = field(default_factory=dict)
    dist: DistInfo = field(default_factory=DistInfo)
    generator: torch.Generator | None = None
    pending: dict[str, float | torch.Tensor] = field(default_factory=dict)

    def log(self, **values: float | torch.Tensor) -> None:
        """Record scalar metrics (``ctx.log(**{"reward/mean": 0.3})``).

        A 0-dim (or one-element) tensor is kept as it is, on its device, and read when
        :attr:`metrics` is: on a GPU each ``.item()`` would stall the stream, so a stage's metrics
        cost one device → host copy per device instead of one per value.
        """
        for k, v in values.items():
            self.pending[k] = v.detach().reshape(()) if isinstance(v, torch.Tensor) else float(v)

    @property
    def metrics(self) -> dict[str, float]:
        """Every logged value as a float (tensors gathered per device, one copy each)."""
        out = {k: v for k, v in self.pending.items() if isinstance(v, float)}
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for k, v in self.pending.items():
            if isinstance(v, torch.Tensor):
                by_device.setdefault(v.device, []).append((k, v))
        for items in by_device.values():
            floats = torch.stack([v.float() for _, v in items]).tolist()
            out.update(zip((k for k, _ in items), floats))
        self.pending.update(out)  # read once: later reads copy nothing
        return {k: out[k] for k in self.pending}

    @property
    def run(self) -> RunResources:
        """The run's objects, typed (:class:`RunResources`): ``ctx.run.algorithm.kl_coef``."""
        return RunResources(self.resources, self.stage)
