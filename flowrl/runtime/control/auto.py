"""``flowrl train placement=auto launcher.nproc=N``: profile, choose, continue.

    phase 1  colocated on all N ranks, ``placement.auto.profile_steps`` real training steps
             (checkpointed at the last one; their ``time/<stage>`` metrics are the profile)
       │
       ▼     cost.refine_and_choose: the cost model fitted to the measured stage times predicts
             colocated and every valid rollout/train split; the fastest wins (partitioned only
             by placement.auto.min_gain)
    phase 2  the chosen placement resumes from that checkpoint (DCP reshards the actor onto the
             train pool) and runs to ``trainer.total_steps``; then the predicted step time is
             printed next to the measured one.

The global batch stays the same across the switch: colocated ranks each sample
``trainer.prompts_per_step`` prompts; a partitioned rollout pool of r ranks samples
``prompts_per_step × N / r`` per rank (a split that does not divide it is skipped).
The decision is written to ``<output_dir>/placement_auto.json``; a resumed auto run reuses it.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from flowrl.compiler.modes import mode_of
from flowrl.compiler.placement import Mode

if TYPE_CHECKING:
    from flowrl.compiler.placement import PlacementPlan
    from flowrl.compiler.plan import ExecutionPlan
    from flowrl.config import TrainConfig
    from flowrl.ops.context import DistInfo

log = logging.getLogger("flowrl")
DECISION_FILE = "placement_auto.json"
# runtime/control/job.run_placement: (cfg, plan, placement, dinfo, out_dir) -> summary
class RunPlacement(Protocol):
    """``runtime/control/job.run_placement``: one phase of the job under one placement.
    ``intro``: a console line before the phase's header; ``closing``: False leaves out the run's
    closing ``checkpoint: ...`` line (the profile is not the run's end)."""

    def __call__(self, cfg: "TrainConfig", plan: "ExecutionPlan", pp: "PlacementPlan",
                 dinfo: "DistInfo", out_dir: Path, *, intro: Optional[str] = None,
                 closing: bool = True) -> dict[str, Any]: ...


def phase_config(cfg: "TrainConfig", *, mode: str, pools: dict[str, list[int]] | None = None,
                 trainer: dict[str, Any], eval_: dict[str, Any],
                 vllm: dict[str, Any] | None = None) -> "TrainConfig":
    """The run config of one phase: ``cfg`` with the placement set to ``mode`` (``pools``: the
    partitioned split; roles: the defaults) and the given ``trainer`` / ``trainer.eval`` /
    ``rollout.vllm`` fields replaced (each section validated again)."""
    placement = dataclasses.replace(cfg.placement, mode=mode, pools=dict(pools or {}), roles={})
    rollout = cfg.rollout if not vllm else dataclasses.replace(
        cfg.rollout, vllm=dataclasses.replace(cfg.rollout.vllm, **vllm))
    ev = dataclasses.replace(cfg.trainer.eval, **eval_)
    return dataclasses.replace(cfg, placement=placement, rollout=rollout,
                               trainer=dataclasses.replace(cfg.trainer, eval=ev, **trainer))


def read_step_metrics(out_dir: Path, first: int, last: int) -> list[dict[str, float]]:
    """Rows of ``metrics.jsonl`` (rank 0's, already reduced over ranks) for steps first..last
    that carry a step time (eval rows do not)."""
    from flowrl.runtime.io.metrics import read_metrics

    rows = read_metrics(out_dir)
    return [{k: v for k, v in rows[s].items() if v is not None} for s in sorted(rows)
            if first <= s <= last and rows[s].get("perf/step_s") is not None]


def decide(cfg, plan, world_size: int, profile: list[dict[str, float]]) -> dict[str, Any]:
    """The refined choice as a plain dict: ``mode``, ``pools`` (partitioned), ``prompts_per_step``
    of each sampling rank, ``predicted_step_s`` and the cost model's ``notes``."""
    from flowrl.compiler.cost import StageCosts, refine_and_choose
    from flowrl.runtime.control.preflight import role_parallelism

    rp = role_parallelism(cfg)
    costs = StageCosts.from_config(plan, cfg, world_size, parallelism=rp)
    # the first step pays one-time costs (allocator warm-up, compilation): leave it out if we can
    measured = profile[1:] if len(profile) > 1 else profile
    pp = refine_and_choose(plan, cfg, world_size, costs, measured, rp)
    notes = list(pp.notes)
    if len(profile) > 1:
        notes[0] += f" (steps 2-{len(profile)} of the profile; step 1 is warm-up)"
    out: dict[str, Any] = {"mode": pp.mode, "notes": notes,
                           "predicted_step_s": pp.estimate.step_s if pp.estimate else None,
                           "prompts_per_step": cfg.trainer.prompts_per_step,
                           "profile_steps": len(profile)}
    if mode_of(pp.mode).concurrent_pools:
        pools = {k: list(v.ranks) for k, v in pp.pools.items()}
        n_roll = len(pools["rollout"])
        global_prompts = cfg.trainer.prompts_per_step * world_size
        if global_prompts % n_roll:
            out.update(mode=Mode.COLOCATED, notes=out["notes"] + [
                f"kept colocated: {global_prompts} prompts per step do not split over "
                f"{n_roll} rollout ranks"])
        else:
            out.update(pools=pools, prompts_per_step=global_prompts // n_roll)
    return out


def run_auto(cfg: "TrainConfig", plan: "ExecutionPlan", dinfo: "DistInfo", out_dir: Path,
             run: RunPlacement) -> dict[str, Any]:
    """Run a ``placement=auto`` job (see the module docstring): each phase is one
    ``run(cfg, plan, placement, dinfo, out_dir)`` (``runtime/control/job.run_placement``), the
    second resuming the first one's checkpoint under the placement :func:`decide` chose.

    Returns the summary of the whole run with ``placement_auto``: the decision, the predicted
    and the measured mean step time after the switch.
    """
    from flowrl.runtime.control.preflight import prepare_placement
    from flowrl.runtime.io.distributed import broadcast_object
    from flowrl.runtime.step.resources import run_device

    P = cfg.placement.auto.profile_steps
    T = cfg.trainer.total_steps
    decision_path = out_dir / DECISION_FILE
    decision = broadcast_object(json.loads(decision_path.read_text())
                                if dinfo.rank == 0 and decision_path.is_file() else None)
    if decision is None:
        vllm: dict[str, Any] = {}
        if cfg.rollout.backend == "vllm":
            # an in-process vLLM's shutdown destroys the job's process group, which phase 2
            # still needs: the profile's engines run in processes with their own torch world
            procs = cfg.rollout.vllm.engine_procs
            if procs == 0 or (procs is None and run_device(cfg).type != "cuda"):
                vllm["engine_procs"] = 1  # (null on CUDA: >= 1 already)
        # a job no longer than the profile is the profile: its final eval is the job's
        profile = phase_config(cfg, mode=Mode.COLOCATED, trainer={"total_steps": min(P, T)},
                               eval_={"after": cfg.trainer.eval.after and T <= P}, vllm=vllm)
        # its own header and no closing line: it read like the run's end (fresh-user report)
        intro = (f"placement=auto: profiling steps 1-{P} of {T} colocated; then the cost model "
                 f"chooses the placement of steps {P + 1}-{T} from what they measured") if T > P \
            else (f"placement=auto: the job's {T} steps fit in the profile "
                  f"(placement.auto.profile_steps={P}): colocated throughout, nothing to choose")
        run(profile, plan, prepare_placement(profile, plan, dinfo.world_size), dinfo, out_dir,
            intro=intro, closing=T <= P)
        _free_memory()
        if T <= P:  # the whole job fit in the profile
            return json.loads((out_dir / "summary.json").read_text()) if dinfo.rank == 0 else {}
        decision = None
        if dinfo.rank == 0:
            decision = decide(cfg, plan, dinfo.world_size, read_step_metrics(out_dir, 1, P))
            decision_path.write_text(json.dumps(decision, indent=1))
            print("\n".join(decision["notes"]), flush=True)
        decision = broadcast_object(decision)
    # re-plan: the chosen placement continues from the profile's checkpoint
    partitioned = mode_of(decision["mode"]).concurrent_pools
    chosen = phase_config(
        cfg, mode=decision["mode"], pools=decision["pools"] if partitioned else None,
        trainer={"resume": True, **({"prompts_per_step": decision["prompts_per_step"]}
                                    if partitioned else {})},
        eval_={"before": False})
    where = f"partitioned {decision['pools']}" if partitioned else decision["mode"]
    summary = run(chosen, plan, prepare_placement(chosen, plan, dinfo.world_size), dinfo, out_dir,
                  intro=f"placement=auto: steps {decision['profile_steps'] + 1}-{T} {where}")
    _free_memory()
    if dinfo.rank == 0:
        after = read_step_metrics(out_dir, decision["profile_steps"] + 1, T)
        after = after[1:] if len(after) > 1 else after  # first step after the switch warms up
        measured = sum(r["perf/step_s"] for r in after) / len(after) if after else None
        pred = decision["predicted_step_s"]
        line = f"placement=auto chose {decision['mode']}"
        if partitioned:
            line += f" {decision['pools']}"
        line += f": predicted step {pred:.3g} s" if pred else ": no prediction"
        if measured is not None:
            line += f", measured {measured:.3g} s" + (
                f" ({(measured / pred - 1) * 100:+.1f}%)" if pred else "")
        print(line, flush=True)
        summary["placement_auto"] = {**decision, "measured_step_s": measured, "line": line}
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _free_memory() -> None:
    """Engines of the finished phase are unreachable once ``run`` returned; give their memory
    back before the next phase loads its own."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
