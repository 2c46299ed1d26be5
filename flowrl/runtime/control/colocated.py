"""The colocated placement's rank: one pool of every rank, every role taking its turn on the same
devices, the whole plan run by the job's one executor (``runtime/control/job.py`` says what a
placement supplies; ``runtime/control/overlap.py`` is its variant with the rollout a step ahead)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from flowrl.compiler.placement import PlacementPlan
    from flowrl.config import TrainConfig
    from flowrl.ops.context import DistInfo
    from flowrl.runtime.control.events import JobEvents
    from flowrl.runtime.step.evaluate import Evaluator
    from flowrl.runtime.step.executor import Executor
    from flowrl.runtime.step.resources import Engines


class Colocated:
    """One pool of every rank; every role takes its turn on the same devices (the whole plan)."""

    name = "colocated"
    overlaps = False

    def __init__(self, pp: "PlacementPlan", dinfo: "DistInfo"):
        self.plan, self.dist = pp.full, dinfo
        self.sends: list[str] = []
        self.engine_ranks: Optional[int] = None  # build_engines: the world, not a pool
        self.engine_group: Any = None
        self.logs, self.holds_state, self.samples = dinfo.rank == 0, True, True
        self.sampling_ranks = dinfo.world_size
        self.executor: Optional["Executor"] = None

    def header(self, cfg: "TrainConfig", out_dir: Path) -> str:
        return (f"[bold]flowrl[/bold] graph={self.plan.graph.name} steps={cfg.trainer.total_steps} "
                f"batch={cfg.trainer.prompts_per_step}x{cfg.algorithm.n} out={out_dir}")

    def start(self, executor: "Executor", engines: "Engines", start: int, resumed: bool) -> None:
        self.executor = executor
        if resumed:  # the rollout engine's copy (or shared module) gets the restored weights
            engines.weight_sink("rollout").load_weights(engines.weight_source("actor").named_weights())

    def step(self, step: int, events: JobEvents) -> None:
        from flowrl.runtime.io.distributed import reduce_metrics

        if self.executor is None:
            raise RuntimeError("Colocated.step before Colocated.start")
        events.record(step, reduce_metrics(self.executor.run_step(step)))  # sum/mean/max
        events.reached(step)

    def finish(self, events: JobEvents) -> None:
        pass

    def prompt_state(self, prompts: Any) -> Any:
        return prompts.state_dict()

    def evaluator(self, cfg, plan, engines, prompts, tokenizer) -> Optional[Evaluator]:
        if not self.logs:  # rank 0's rollout engine holds full weights; it evaluates alone
            return None  # (trainer.eval.limit=0: it returns {} and logs nothing)
        from flowrl.runtime.step.evaluate import greedy_evaluator

        return greedy_evaluator(cfg, plan, engines.rollout, prompts, tokenizer)

    def summary_fields(self, earlier: dict[str, Any], start: int) -> dict[str, Any]:
        out = dict(earlier)
        if "staleness" in out:  # an earlier part overlapped (placement.staleness=1); this one not
            out["staleness"] = 0
        return out

    def final_fields(self, summary: dict[str, Any]) -> dict[str, Any]:
        if "version_lags" not in summary:
            return {}
        # resumed after an overlapped part: one lag per step still, 0 for this part's steps
        lags = summary["version_lags"]
        return {"version_lags": lags + [0] * max(len(summary.get("history", [])) - len(lags), 0)}


__all__ = ["Colocated"]
