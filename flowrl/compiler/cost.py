"""Cost model of one RL step, and ``placement=auto``: predict the step time of colocated and of
every valid partitioned split, pick the fastest (``choose_placement``).

The model (all times in seconds, per step, for a fixed global workload of ``B`` rows of ``P``
prompt + ``R`` response tokens, see :class:`Workload`):

* stage time on a pool of ``p`` devices = a per-kind formula (:data:`KIND_SECONDS`, FLOP counts of
  Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1: ≈2N FLOPs per token
  forward, ≈6N forward+backward; decode by the roofline model of Williams et al. 2009) ×
  a per-stage calibration factor that :meth:`StageCosts.refine` fits to measured ``time/<stage>``.
* colocated on ``W`` ranks: Σ stage(W) + swap time (bytes moved / host bandwidth).
* partitioned, ``r`` rollout ranks, ``W-r`` train ranks, staleness ``k``:
  ``k = 0``: rollout_side(r) + train_side(W-r) + sync + transfer (the sides alternate);
  ``k >= 1``: max(rollout_side(r), train_side(W-r)) + sync + transfer (the sides overlap).

Assumptions (why a prediction can be off): perfect data-parallel scaling of every stage (no
collective cost inside a pool), the same global batch for every candidate, KV-cache reads and
attention FLOPs ignored, role-less stages (rule rewards, advantages) free unless measured.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from flowrl.compiler.devices import DEVICES, INF, DeviceProfile
from flowrl.compiler.footprint import (
    ModelSize,
    fmt_bytes,
    pool_peak_memory,
    role_model_configs,
    tensor_bytes,
)
from flowrl.compiler.placement import (
    ROLLOUT_POOL,
    TRAIN_POOL,
    PlacementConfig,
    PlacementError,
    PlacementPlan,
    place,
    split_candidates,
)
from flowrl.graph.roles import ROLES


@dataclass(frozen=True)
class Workload:
    """One step's global work: ``batch`` rows (prompts × n × data-parallel ranks), padded to
    ``prompt_tokens`` (P) and ``response_tokens`` (R); ``ppo_epochs`` passes of the update."""

    batch: int
    prompt_tokens: int
    response_tokens: int
    ppo_epochs: int = 1

    @classmethod
    def from_config(cls, cfg: Any, world_size: int) -> "Workload":
        """Upper bounds from the run config: P = ``data.max_prompt_tokens``, R =
        ``rollout.sampling.max_new_tokens`` (refine() replaces R by the measured max length)."""
        return cls(cfg.trainer.prompts_per_step * cfg.algorithm.n * world_size,
                   cfg.data.max_prompt_tokens, cfg.rollout.sampling.max_new_tokens,
                   cfg.algorithm.ppo_epochs)


# --- per-kind stage time on a pool of p devices (tp = tensor-parallel size of the role) ---------
def forward_seconds(m: ModelSize, w: Workload, p: int, tp: int, d: DeviceProfile) -> float:
    """2·N·B·(P+R) / (p·F): one forward pass over every token (logprobs, values, reward model)."""
    return 2 * m.n_params * w.batch * (w.prompt_tokens + w.response_tokens) / (p * d.flops)


def train_seconds(m: ModelSize, w: Workload, p: int, tp: int, d: DeviceProfile) -> float:
    """ppo_epochs · 6·N·B·(P+R) / (p·F): forward + backward (2N + 4N FLOPs per token)."""
    return w.ppo_epochs * 3 * forward_seconds(m, w, p, tp, d)


def decode_seconds(m: ModelSize, w: Workload, p: int, tp: int, d: DeviceProfile) -> float:
    """Roofline decode on ``p // tp`` engine instances of ``tp`` devices, each with
    b = ceil(B / instances) rows: prefill 2·N·b·P / (tp·F), then R token steps of
    max(weight bytes / (tp·mem_bw), 2·N·b / (tp·F)) (memory-bound at small b)."""
    b = math.ceil(w.batch / max(p // tp, 1))
    prefill = 2 * m.n_params * b * w.prompt_tokens / (tp * d.flops)
    token = max(m.weight_bytes / (tp * d.mem_bw), 2 * m.n_params * b / (tp * d.flops))
    return prefill + w.response_tokens * token


def free_seconds(m: Optional[ModelSize], w: Workload, p: int, tp: int, d: DeviceProfile) -> float:
    """0: a role-less stage (rule reward, advantage) is negligible next to model stages."""
    return 0.0


KIND_SECONDS: dict[str, Callable[..., float]] = {
    "forward": forward_seconds, "train": train_seconds, "decode": decode_seconds, "free": free_seconds}
OP_KIND = {"rollout.generate": "decode", "rollout.multi_turn": "decode", "reward.genrm": "decode", "logprobs": "forward",
           "values": "forward", "reward.model": "forward", "update.policy": "train",
           "update.critic": "train"}


def stage_kind(op: str, role: Optional[str]) -> str:
    """Kind of an op: from :data:`OP_KIND`; an unlisted op with a model role counts as a forward."""
    return OP_KIND.get(op, "forward" if role else "free")


@dataclass
class StageCosts:
    """Per-stage cost model of one plan (see the module docstring).

    Attributes:
        device: throughput defaults.
        workload: the global work of one step.
        stages: stage → (role or None, kind).
        sizes: role → ModelSize.
        parallelism: role → tensor-parallel size (default 1).
        scale: stage → measured / modelled time (1 until :meth:`refine`).
        measured_work: stage → device-seconds measured for a stage the model calls free.
        swap_measured: measured colocated swap seconds per step (replaces the modelled swap).
    """

    device: DeviceProfile
    workload: Workload
    stages: dict[str, tuple[Optional[str], str]]
    sizes: dict[str, ModelSize]
    parallelism: dict[str, int] = field(default_factory=dict)
    scale: dict[str, float] = field(default_factory=dict)
    measured_work: dict[str, float] = field(default_factory=dict)
    swap_measured: Optional[float] = None

    @classmethod
    def from_plan(cls, plan: Any, sizes: dict[str, ModelSize], workload: Workload,
                  device: DeviceProfile, parallelism: Optional[dict[str, int]] = None) -> "StageCosts":
        stages = {c.stage.name: (c.stage.role, stage_kind(c.stage.op, c.stage.role))
                  for c in plan.stages}
        return cls(device, workload, stages, sizes, dict(parallelism or {}))

    @classmethod
    def from_config(cls, plan: Any, cfg: Any, world_size: int, device: Optional[str] = None,
                    parallelism: Optional[dict[str, int]] = None) -> "StageCosts":
        """Model sizes read without loading weights (each role's ``ModelConfig.size()``); device kind from
        ``placement.auto.device`` unless given."""
        kind = device or resolve_device(cfg.placement.auto.device, cfg.trainer.device)
        models = role_model_configs(cfg)
        sizes = {r: models[r].size() for r in plan.roles}
        return cls.from_plan(plan, sizes, Workload.from_config(cfg, world_size), DEVICES[kind],
                             parallelism)

    def modelled(self, stage: str, p: int) -> float:
        role, kind = self.stages[stage]
        # a stage without a model (reward, advantage): no size, no parallelism
        size = None if role is None else self.sizes.get(role)
        tp = 1 if role is None else self.parallelism.get(role, 1)
        return KIND_SECONDS[kind](size, self.workload, p, tp, self.device)

    def stage_seconds(self, stage: str, p: int) -> float:
        """Predicted seconds of ``stage`` on a pool of ``p`` devices."""
        if stage in self.measured_work:
            return self.measured_work[stage] / p
        return self.scale.get(stage, 1.0) * self.modelled(stage, p)

    def swap_seconds(self, actions: Sequence[Any], p: int) -> float:
        """Σ over onload/offload actions of the bytes moved / host bandwidth: a train role moves
        weights, grads and 2 AdamW moments (4 × weight bytes, sharded over p), only 3 × when its
        weights stay for the rollout engine; other roles move their weights."""
        total = 0.0
        for a in actions:
            if a.kind not in ("onload", "offload"):
                continue
            m: float = self.sizes[a.role].weight_bytes
            if ROLES[a.role].kind == "train":
                m = (3 if a.keep_weights else 4) * m / p
            elif a.keep_weights:
                m = 0
            total += m / self.device.host_bw
        return total

    def refine(self, step_metrics: Mapping[str, float] | Sequence[Mapping[str, float]],
               ranks: int) -> "StageCosts":
        """Fit the model to measured steps (the executor's metrics, reduced over ranks) of a run on
        ``ranks`` colocated ranks; mean over the given steps (leave warm-up steps out).
        ``response/length_max`` replaces R; ``time/<stage>`` sets the stage's scale (measured /
        modelled) or, for a stage modelled as free, its measured device-seconds;
        ``perf/swap_s`` replaces the modelled colocated swap time. Returns self."""
        steps = [step_metrics] if isinstance(step_metrics, Mapping) else list(step_metrics)
        if not steps:
            return self

        def mean(key: str) -> Optional[float]:
            vals = [float(s[key]) for s in steps if key in s]
            return sum(vals) / len(vals) if vals else None

        if (r := mean("response/length_max")) is not None:
            self.workload = replace(self.workload, response_tokens=max(1, round(r)))
        for stage in self.stages:
            t = mean(f"time/{stage}")
            if t is None:
                continue
            model = self.modelled(stage, ranks)
            if model > 0:
                self.scale[stage] = t / model
            else:
                self.measured_work[stage] = t * ranks
        self.swap_measured = mean("perf/swap_s")
        return self


def resolve_device(auto_device: str, trainer_device: str) -> str:
    """``placement.auto.device``: a key of :data:`DEVICES`, or ``auto`` = ``h200`` when CUDA is
    used (``trainer.device`` cuda, or auto with a GPU present), else ``cpu``."""
    if auto_device != "auto":
        return auto_device
    if trainer_device == "cpu":
        return "cpu"
    import torch

    return "h200" if trainer_device == "cuda" or torch.cuda.is_available() else "cpu"


# --- step-time predictions --------------------------------------------------------------------
def transfer_bytes(pp: PlacementPlan, w: Workload) -> dict[str, int]:
    """Bytes per step of each key crossing from the rollout pool to the train pool."""
    return {k: tensor_bytes(k, w.batch, w.prompt_tokens, w.response_tokens) for k in pp.transfers}


def sync_bytes(pp: PlacementPlan, costs: StageCosts) -> int:
    """Weight bytes broadcast per step (partitioned: each synced source role's weights)."""
    if pp.mode != "partitioned":
        return 0
    return sum(costs.sizes[src].weight_bytes for src, _ in pp.weight_sync if src in costs.sizes)


@dataclass
class PlacementEstimate:
    """Predictions for one PlacementPlan (bytes per step, seconds per step, bytes per device).

    Attributes:
        step_s: predicted step time.
        sides: pool → predicted seconds of its stages and swaps per step.
        sync_s / transfer_s: weight broadcast and rollout → train transfer seconds per step.
        memory: pool → (peak bytes per device, the role that sets it).
        transfers: key → bytes per step.
        sync_bytes: weight bytes broadcast per step.
        candidates: auto only: candidate label → predicted step seconds.
        device: device profile name.
    """

    step_s: float
    sides: dict[str, float]
    sync_s: float
    transfer_s: float
    memory: dict[str, tuple[int, Optional[str]]]
    transfers: dict[str, int]
    sync_bytes: int
    device: str
    candidates: dict[str, float] = field(default_factory=dict)


def estimate(pp: PlacementPlan, costs: StageCosts) -> PlacementEstimate:
    """Predicted step time, per-pool peak memory and traffic of a colocated or partitioned plan."""
    w = costs.workload
    sides, memory = {}, {}
    for name, pool in pp.pools.items():
        p = len(pool.ranks)
        side = sum(costs.stage_seconds(s, p) for s in pool.plan.order)
        swaps = costs.swap_seconds(pool.plan.actions, p)
        if pp.mode == "colocated" and costs.swap_measured is not None:
            swaps = costs.swap_measured
        sides[name] = side + swaps
        tp = max((costs.parallelism.get(r, 1) for r in pool.roles), default=1)
        kv_tokens = math.ceil(w.batch / max(p // tp, 1)) * (w.prompt_tokens + w.response_tokens)
        memory[name] = pool_peak_memory(pool.roles, costs.sizes, p, kv_tokens)
    xfer = transfer_bytes(pp, w)
    sb = sync_bytes(pp, costs)
    link = costs.device.link_bw
    if pp.mode == "colocated":
        return PlacementEstimate(sides["all"], sides, 0.0, 0.0, memory, xfer, sb, costs.device.name)
    r, t = len(pp.pools[ROLLOUT_POOL].ranks), len(pp.pools[TRAIN_POOL].ranks)
    sync_s = sb / link  # pipelined bucket broadcast: ~bytes / bandwidth for any receiver count
    xfer_s = sum(xfer.values()) / (link * min(r, t))  # min(r, t) point-to-point links at once
    rs, ts = sides[ROLLOUT_POOL], sides[TRAIN_POOL]
    body = rs + ts if pp.staleness == 0 else max(rs, ts)
    return PlacementEstimate(body + sync_s + xfer_s, sides, sync_s, xfer_s, memory, xfer, sb,
                             costs.device.name)


def ternary_search(f: Callable[[int], float], xs: Sequence[int]) -> int:
    """argmin of ``f`` over the sorted candidates ``xs``, assuming f is unimodal along them
    (rollout time falls and train time rises with r); O(log n) evaluations. Ties keep the left
    part, so a plateau can mislead it: callers with few candidates check exhaustively."""
    lo, hi = 0, len(xs) - 1
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if f(xs[m1]) <= f(xs[m2]):
            hi = m2
        else:
            lo = m1
    return min(xs[lo:hi + 1], key=f)


EXHAUSTIVE_MAX = 64  # up to this many splits every one is evaluated (cheap; no plateau risk)


def choose_placement(full_plan: Any, cfg: Any, world_size: int, costs: StageCosts,
                     role_parallelism: Optional[dict[str, int]] = None) -> PlacementPlan:
    """``placement=auto``: the colocated plan or the best partitioned split, whichever is predicted
    faster — partitioned only when at least ``placement.auto.min_gain`` times faster (it holds a
    second copy of the weights and runs off-policy when staleness > 0). ``cfg`` is the TrainConfig
    (its ``placement.roles``/``staleness`` apply to the partitioned candidates). The result's
    ``notes`` list every candidate's prediction and the reason; ``estimate`` holds the winner's.
    """
    pc: PlacementConfig = cfg.placement
    rp = dict(role_parallelism or {})
    colo = place(full_plan, PlacementConfig(mode="colocated"), world_size, rp)
    colo_est = estimate(colo, costs)
    cands = {f"colocated W={world_size}": colo_est.step_s}
    notes = [f"auto: device profile {costs.device.name}; workload B={costs.workload.batch} rows, "
             f"P={costs.workload.prompt_tokens}, R={costs.workload.response_tokens} tokens"]
    splits: dict[int, tuple[PlacementPlan, PlacementEstimate]] = {}

    def part(r: int) -> float:
        if r not in splits:
            c = copy.copy(pc)
            c.mode, c.pools = "partitioned", {TRAIN_POOL: list(range(world_size - r)),
                                              ROLLOUT_POOL: list(range(world_size - r, world_size))}
            pp = place(full_plan, c, world_size, rp)
            splits[r] = (pp, estimate(pp, costs))
        return splits[r][1].step_s

    xs = split_candidates(world_size, rp.get("rollout", 1)) if world_size >= 2 else []
    best_r, why_not = None, ""
    if not xs:
        why_not = f"no valid partitioned split of {world_size} rank(s)"
    else:
        try:
            best_r = min(xs, key=part) if len(xs) <= EXHAUSTIVE_MAX else ternary_search(part, xs)
        except PlacementError as e:  # the graph cannot be cut (e.g. a rollout stage reads train output)
            why_not = f"partitioned impossible: {e}"
    for r, (pp, est) in sorted(splits.items()):
        cands[f"partitioned rollout={r} train={world_size - r} k={pp.staleness}"] = est.step_s
    for label, s in cands.items():
        notes.append(f"  predicted step {s:.3g} s  {label}")
    chosen, est = colo, colo_est
    if best_r is None:
        notes.append(f"chose colocated: {why_not}")
    else:
        pp, pest = splits[best_r]
        gain = colo_est.step_s / pest.step_s if pest.step_s > 0 else INF
        if gain >= pc.auto.min_gain:
            chosen, est = pp, pest
            notes.append(f"chose partitioned rollout={best_r} train={world_size - best_r}: predicted "
                         f"{gain:.2f}x faster than colocated (>= placement.auto.min_gain "
                         f"{pc.auto.min_gain})")
        else:
            notes.append(f"chose colocated: best split rollout={best_r} train={world_size - best_r} "
                         f"is predicted {gain:.2f}x as fast, below placement.auto.min_gain "
                         f"{pc.auto.min_gain}")
    for name, (b, role) in est.memory.items():
        if costs.device.memory is not None and b > costs.device.memory:
            notes.append(f"warning: pool {name} predicted peak {fmt_bytes(b)} per device ({role}) "
                         f"exceeds {costs.device.name} memory {fmt_bytes(costs.device.memory)}")
    est.candidates = cands
    chosen = replace(chosen, notes=list(chosen.notes) + notes, estimate=est)
    return chosen


def refine_and_choose(full_plan: Any, cfg: Any, world_size: int, costs: StageCosts,
                      profile_metrics: Sequence[Mapping[str, float]],
                      role_parallelism: Optional[dict[str, int]] = None) -> PlacementPlan:
    """The runtime's ``placement=auto`` switch point: after ``placement.auto.profile_steps``
    colocated steps on ``world_size`` ranks, fit ``costs`` to their metrics and choose again."""
    costs.refine(profile_metrics, ranks=world_size)
    pp = choose_placement(full_plan, cfg, world_size, costs, role_parallelism)
    pp.notes.insert(0, f"auto: refined from {len(profile_metrics)} measured colocated step(s)")
    return pp


def predicted_vs_measured(pp: PlacementPlan, step_metrics: Sequence[Mapping[str, float]]) -> str:
    """One line for the log: the plan's predicted step time next to the mean measured
    ``perf/step_s`` of ``step_metrics``, e.g. ``placement partitioned rollout=[2, 3] train=[0, 1]:
    predicted step 89 s, measured 95 s (+6.7%)``."""
    pools = " ".join(f"{k}={v.ranks}" for k, v in pp.pools.items())
    vals = [float(m["perf/step_s"]) for m in step_metrics if "perf/step_s" in m]
    pred = pp.estimate.step_s if pp.estimate is not None else None
    line = f"placement {pp.mode} {pools}: predicted step " + (f"{pred:.3g} s" if pred else "?")
    if vals:
        meas = sum(vals) / len(vals)
        line += f", measured {meas:.3g} s" + (f" ({(meas / pred - 1) * 100:+.1f}%)" if pred else "")
    return line


__all__ = ["DEVICES", "DeviceProfile", "KIND_SECONDS", "OP_KIND", "PlacementEstimate",
           "StageCosts", "Workload", "choose_placement", "decode_seconds", "estimate",
           "forward_seconds", "predicted_vs_measured", "refine_and_choose", "resolve_device", "stage_kind", "sync_bytes", "ternary_search",
           "train_seconds", "transfer_bytes"]
