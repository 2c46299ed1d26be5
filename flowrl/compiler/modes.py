"""The placement modes as objects: one small class per ``placement.mode``, registered by name,
owning what differs between modes — how it places a compiled plan on the ranks (``place``, and
``choose`` for a whole run config), how the cost model predicts its step (``estimate``) and how
``flowrl plan`` renders it (``render``). Nothing outside this registry (and the parsing in
``placement.parse_mode``) compares mode names: callers look the mode up (:func:`mode_of`) or call
the module functions below.

Adding a mode: a :class:`Mode` value, a subclass here decorated ``@register``, and the runtime's
``RankPlacement`` for it (``flowrl/runtime/control/job.py``).

Sits above ``placement`` (the cuts), ``cost`` (the formulas) and ``render`` (the text) of the
compiler; imports no engine and no torch.
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from flowrl.compiler import cost, render
from flowrl.compiler.placement import (
    Mode,
    PlacementConfig,
    PlacementError,
    PlacementPlan,
    colocated,
    parse_mode,
    partitioned,
    staleness_of,
)
from flowrl.compiler.plan import ExecutionPlan


class PlacementMode:
    """One ``placement.mode``: place / cost / render. Subclasses set ``mode`` and override what
    their mode does; the base refuses what a mode cannot do (``auto`` renders nothing: it is
    resolved to one of the others first)."""

    mode: ClassVar[Mode]
    #: the pools run at the same time and the train pool broadcasts weights to the rollout pool
    #: (the runtime then routes batches between pools and checks their sizes)
    concurrent_pools: ClassVar[bool] = False
    #: every role on every rank, whatever the costs say (what a LoRA actor needs for now)
    single_pool: ClassVar[bool] = False

    def place(self, plan: ExecutionPlan, cfg: PlacementConfig, world_size: int,
              role_parallelism: Optional[dict[str, int]] = None) -> PlacementPlan:
        """``plan`` on ``world_size`` ranks under ``cfg``.

        Raises:
            PlacementError: an impossible placement, naming the ``placement.*`` field.
        """
        raise NotImplementedError

    def choose(self, plan: ExecutionPlan, run_cfg: Any, world_size: int,
               role_parallelism: Optional[dict[str, int]] = None,
               prompt_tokens: Optional[int] = None) -> PlacementPlan:
        """The run's placement from the whole run config (``run_cfg.placement`` and, for
        ``auto``, what the cost model reads; ``prompt_tokens``: P measured from the data, else the
        ``data.max_prompt_tokens`` bound). Default: :meth:`place` of ``run_cfg.placement``."""
        return self.place(plan, run_cfg.placement, world_size, role_parallelism)

    def estimate(self, pp: PlacementPlan, costs: cost.StageCosts) -> cost.PlacementEstimate:
        """Predicted step time, per-pool peak memory and traffic of ``pp``."""
        raise NotImplementedError(f"placement.mode={self.mode} has no estimate of its own")

    def render(self, pp: PlacementPlan, fmt: str) -> str:
        """``pp`` as ``flowrl plan`` prints it in ``fmt`` (one of ``render.FORMATS``)."""
        raise NotImplementedError(f"placement.mode={self.mode} is resolved before it is rendered")


MODES: dict[Mode, PlacementMode] = {}


def register(cls: type[PlacementMode]) -> type[PlacementMode]:
    """Class decorator: one instance of ``cls`` serves ``cls.mode``."""
    MODES[cls.mode] = cls()
    return cls


def mode_of(name: str) -> PlacementMode:
    """The registered mode called ``name`` (a :class:`Mode` or its string).

    Raises:
        ValueError: an unknown mode, one line with did-you-mean (``placement.parse_mode``).
    """
    return MODES[parse_mode(name)]


@register
class Colocated(PlacementMode):
    """One pool of every rank; roles take turns, swapping at the plan's swap points."""

    mode = Mode.COLOCATED
    single_pool = True

    def place(self, plan: ExecutionPlan, cfg: PlacementConfig, world_size: int,
              role_parallelism: Optional[dict[str, int]] = None) -> PlacementPlan:
        if any(cfg.pools.values()) or cfg.roles:
            raise PlacementError("placement.pools/roles are for placement.mode=partitioned; "
                                 "colocated uses every rank for every role")
        return colocated(plan, world_size, role_parallelism, staleness=staleness_of(plan, cfg))

    def estimate(self, pp: PlacementPlan, costs: cost.StageCosts) -> cost.PlacementEstimate:
        return cost.estimate_colocated(pp, costs)

    def render(self, pp: PlacementPlan, fmt: str) -> str:
        if fmt == "mermaid":
            return render.mermaid(pp)
        if fmt == "dot":
            return render.dot(pp)
        return render.colocated_text(pp)


@register
class Partitioned(PlacementMode):
    """A rollout pool and a train pool running concurrently, weights broadcast after each
    update, the rollout pool at most ``staleness`` versions behind."""

    mode = Mode.PARTITIONED
    concurrent_pools = True

    def place(self, plan: ExecutionPlan, cfg: PlacementConfig, world_size: int,
              role_parallelism: Optional[dict[str, int]] = None) -> PlacementPlan:
        return partitioned(plan, cfg, world_size, role_parallelism)

    def estimate(self, pp: PlacementPlan, costs: cost.StageCosts) -> cost.PlacementEstimate:
        return cost.estimate_partitioned(pp, costs)

    def render(self, pp: PlacementPlan, fmt: str) -> str:
        if fmt == "mermaid":
            return render.mermaid(pp, weights_cross=True)
        if fmt == "dot":
            return render.dot(pp, weights_cross=True)
        return render.partitioned_text(pp)


@register
class Auto(PlacementMode):
    """The cost model picks colocated or the best partitioned split (``cost.choose_placement``);
    the result is a colocated or partitioned plan, estimated and rendered as such."""

    mode = Mode.AUTO

    def place(self, plan: ExecutionPlan, cfg: PlacementConfig, world_size: int,
              role_parallelism: Optional[dict[str, int]] = None) -> PlacementPlan:
        raise PlacementError("placement.mode=auto is resolved by flowrl.compiler.cost.choose_placement")

    def choose(self, plan: ExecutionPlan, run_cfg: Any, world_size: int,
               role_parallelism: Optional[dict[str, int]] = None,
               prompt_tokens: Optional[int] = None) -> PlacementPlan:
        costs = cost.StageCosts.from_config(plan, run_cfg, world_size, parallelism=role_parallelism,
                                            prompt_tokens=prompt_tokens)
        return cost.choose_placement(plan, run_cfg, world_size, costs, role_parallelism)


def place(plan: ExecutionPlan, cfg: PlacementConfig, world_size: int,
          role_parallelism: Optional[dict[str, int]] = None) -> PlacementPlan:
    """``plan`` placed by ``cfg.mode`` (colocated / partitioned; ``auto`` needs stage costs:
    :func:`choose`).

    Args:
        role_parallelism: role → tensor-parallel size of its engine (e.g. ``{"rollout": 2}``);
            a pool must hold a multiple of it. Missing roles: 1.

    Raises:
        PlacementError: a world size < 1; see ``placement.partitioned`` / ``placement.colocated``;
            pools/roles set under ``colocated``; ``auto``.
    """
    if world_size < 1:
        raise PlacementError(f"launcher.nproc: world size must be >= 1, got {world_size}")
    return mode_of(cfg.mode).place(plan, cfg, world_size, role_parallelism)


def choose(plan: ExecutionPlan, run_cfg: Any, world_size: int,
           role_parallelism: Optional[dict[str, int]] = None,
           prompt_tokens: Optional[int] = None) -> PlacementPlan:
    """The run's PlacementPlan of ``run_cfg.placement.mode`` (``auto``: the cost model's pick,
    its ``estimate`` attached, for ``prompt_tokens`` P when measured); loads no model."""
    return mode_of(run_cfg.placement.mode).choose(plan, run_cfg, world_size, role_parallelism,
                                                  prompt_tokens)


def estimate(pp: PlacementPlan, costs: cost.StageCosts) -> cost.PlacementEstimate:
    """Predicted step time, per-pool peak memory and traffic of a colocated or partitioned plan."""
    return mode_of(pp.mode).estimate(pp, costs)


def format_placement(pp: PlacementPlan, fmt: str = "text") -> str:
    """What ``flowrl plan`` prints. text: colocated = ``render.format_plan`` + the cost model's
    predictions; partitioned = one timeline per pool, transfers, weight sync, predictions and
    notes. mermaid / dot: each pool a subgraph holding its timeline as a chain; solid edges for
    transfers, dashed for the weight broadcast.

    Raises:
        ValueError: unknown ``fmt``.
    """
    if fmt not in render.FORMATS:
        raise ValueError(f"--format must be one of {render.FORMATS}, got {fmt!r}")
    return mode_of(pp.mode).render(pp, fmt)


__all__ = ["Auto", "Colocated", "MODES", "Partitioned", "PlacementMode", "choose", "estimate",
           "format_placement", "mode_of", "place", "register"]
