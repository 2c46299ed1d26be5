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
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from flowrl.compiler.devices import DEVICES, INF, DeviceProfile
from flowrl.compiler.footprint import (
    ModelSize,
    fmt_bytes,
    pool_peak_memory,
    role_memory,
    role_model_configs,
    tensor_bytes,
)
from flowrl.compiler.placement import (
    ROLLOUT_POOL,
    TRAIN_POOL,
    PlacementConfig,
    PlacementError,
    PlacementPlan,
    colocated,
    partitioned,
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
    def from_config(cls, cfg: Any, sampling_ranks: int) -> "Workload":
        """Upper bounds from the run config: P = ``data.max_prompt_tokens``, R =
        ``rollout.sampling.max_new_tokens`` (refine() replaces R by the measured max length);
        B = ``trainer.prompts_per_step`` × ``algorithm.n`` × ``sampling_ranks``, the ranks that
        each sample ``prompts_per_step`` prompts a step (colocated: every rank; an explicit
        partitioned run: its rollout pool's)."""
        return cls(cfg.trainer.prompts_per_step * cfg.algorithm.n * sampling_ranks,
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
OP_KIND = {"rollout.generate": "decode", "teacher.generate": "decode", "rollout.multi_turn": "decode", "reward.genrm": "decode", "logprobs": "forward",
           "values": "forward", "reward.model": "forward", "update.policy": "train",
           "update.critic": "train", "update.sft": "train"}


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
    def from_config(cls, plan: Any, cfg: Any, sampling_ranks: int, device: Optional[str] = None,
                    parallelism: Optional[dict[str, int]] = None,
                    prompt_tokens: Optional[int] = None) -> "StageCosts":
        """Model sizes read without loading weights (each role's ``ModelConfig.size()``); device kind from
        ``placement.auto.device`` unless given; ``prompt_tokens``: P measured from the data
        (default: the ``data.max_prompt_tokens`` bound); ``sampling_ranks``: see
        :meth:`Workload.from_config` (``placement=auto`` compares layouts at the world's batch:
        a partitioned choice rescales the rollout ranks' prompts to keep it)."""
        kind = device or resolve_device(cfg.placement.auto.device, cfg.trainer.device)
        models = role_model_configs(cfg)
        sizes = {r: models[r].size() for r in plan.roles}
        w = Workload.from_config(cfg, sampling_ranks)
        if prompt_tokens is not None:
            w = replace(w, prompt_tokens=prompt_tokens)
        return cls.from_plan(plan, sizes, w, DEVICES[kind], parallelism)

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
        ``response/length_max`` replaces R, ``data/prompt_length_max`` (the padded prompt width)
        P; ``time/<stage>`` sets the stage's scale (measured /
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
        if (p := mean("data/prompt_length_max")) is not None:  # not the max_prompt_tokens bound
            self.workload = replace(self.workload, prompt_tokens=max(1, round(p)))
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
    """Weight bytes broadcast per step from the train pool to the rollout pool of a partitioned
    plan: each synced source role's weights (a colocated plan broadcasts nothing: 0, in
    :func:`estimate_colocated`)."""
    return sum(costs.sizes[src].weight_bytes for src, _ in pp.weight_sync if src in costs.sizes)


@dataclass
class PlacementEstimate:
    """Predictions for one PlacementPlan (bytes per step, seconds per step, bytes per device).

    Attributes:
        step_s: predicted step time.
        sides: pool → predicted seconds of its stages and swaps per step.
        sync_s / transfer_s: weight broadcast and rollout → train transfer seconds per step.
        memory: pool → (peak bytes per device, the role whose turn on the device sets it;
            None: unknown).
        role_memory: pool → role → predicted bytes per device of that role's model alone
            (:func:`~flowrl.compiler.footprint.role_memory`: every model role of the pool, a
            teacher or reference included); their sum is the pool's need with every model
            resident (no swaps: ``trainer.offload=never``, or ``auto`` when it fits).
        transfers: key → bytes per step.
        sync_bytes: weight bytes broadcast per step.
        candidates: auto only: candidate label → predicted step seconds.
        device: device profile name.
        with_activations: the memory peaks count a micro-batch's activations and logits (a
            cluster plan's ``footprint``), not only the models, optimizer state and KV cache.
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
    role_memory: dict[str, dict[str, int]] = field(default_factory=dict)
    with_activations: bool = False


def _pool_sides(pp: PlacementPlan, costs: StageCosts, measured_swaps: bool
                ) -> tuple[dict[str, float], dict[str, tuple[int, Optional[str]]],
                           dict[str, dict[str, int]]]:
    """pool → predicted seconds of its stages and swaps per step (``measured_swaps``: the
    profile's measured swap seconds replace the modelled ones when there are any), pool →
    (peak bytes per device, the role that sets it), and pool → role → bytes per device."""
    w = costs.workload
    sides, memory = {}, {}
    by_role: dict[str, dict[str, int]] = {}
    for name, pool in pp.pools.items():
        p = len(pool.ranks)
        side = sum(costs.stage_seconds(s, p) for s in pool.plan.order)
        swaps = costs.swap_seconds(pool.plan.actions, p)
        if measured_swaps and costs.swap_measured is not None:
            swaps = costs.swap_measured
        sides[name] = side + swaps
        tp = max((costs.parallelism.get(r, 1) for r in pool.roles), default=1)
        kv_tokens = math.ceil(w.batch / max(p // tp, 1)) * (w.prompt_tokens + w.response_tokens)
        memory[name] = pool_peak_memory(pool.roles, costs.sizes, p, kv_tokens)
        by_role[name] = {r: role_memory(r, costs.sizes[r], p, kv_tokens) for r in pool.roles}
    return sides, memory, by_role


def estimate_colocated(pp: PlacementPlan, costs: StageCosts) -> PlacementEstimate:
    """A colocated plan's predicted step: its one pool's stages and swaps (the measured swap
    seconds once profiled); nothing is broadcast or transferred. Overlapped (``pp.halves``,
    ``placement.staleness=1``): the longer of its rollout and train halves, nothing swapped (a
    lower bound: the two halves share the devices)."""
    sides, memory, by_role = _pool_sides(pp, costs, measured_swaps=True)
    if pp.overlapped:
        p = pp.world_size
        for name, half in pp.halves.items():
            sides[name] = sum(costs.stage_seconds(s, p) for s in half.plan.order)
        sides["all"] = max(sides[ROLLOUT_POOL], sides[TRAIN_POOL])
        memory["all"] = (sum(by_role["all"].values()), None)  # every model resident at once
    return PlacementEstimate(sides["all"], sides, 0.0, 0.0, memory,
                             transfer_bytes(pp, costs.workload), 0, costs.device.name,
                             role_memory=by_role)


def estimate_partitioned(pp: PlacementPlan, costs: StageCosts) -> PlacementEstimate:
    """A partitioned plan's predicted step: k = 0 the rollout and train sides in turn, k >= 1 the
    longer of the two (they overlap); plus the weight broadcast and the rollout → train
    transfers."""
    sides, memory, by_role = _pool_sides(pp, costs, measured_swaps=False)
    xfer = transfer_bytes(pp, costs.workload)
    sb = sync_bytes(pp, costs)
    link = costs.device.link_bw
    r, t = len(pp.pools[ROLLOUT_POOL].ranks), len(pp.pools[TRAIN_POOL].ranks)
    sync_s = sb / link  # pipelined bucket broadcast: ~bytes / bandwidth for any receiver count
    xfer_s = sum(xfer.values()) / (link * min(r, t))  # min(r, t) point-to-point links at once
    rs, ts = sides[ROLLOUT_POOL], sides[TRAIN_POOL]
    body = rs + ts if pp.staleness == 0 else max(rs, ts)
    return PlacementEstimate(body + sync_s + xfer_s, sides, sync_s, xfer_s, memory, xfer, sb,
                             costs.device.name, role_memory=by_role)


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
    colo = colocated(full_plan, world_size, rp)
    colo_est = estimate_colocated(colo, costs)
    cands = {f"colocated W={world_size}": colo_est.step_s}
    notes = [f"auto: device profile {costs.device.name}; workload B={costs.workload.batch} rows, "
             f"P={costs.workload.prompt_tokens}, R={costs.workload.response_tokens} tokens"]
    splits: dict[int, tuple[PlacementPlan, PlacementEstimate]] = {}

    def part(r: int) -> float:
        if r not in splits:
            c = copy.copy(pc)
            c.pools = {TRAIN_POOL: list(range(world_size - r)),
                       ROLLOUT_POOL: list(range(world_size - r, world_size))}
            pp = partitioned(full_plan, c, world_size, rp)
            splits[r] = (pp, estimate_partitioned(pp, costs))
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


__all__ = ["CALIBRATION", "ClusterCosts", "ClusterEstimate", "ClusterPlan", "DEVICES",
           "DeviceProfile", "Fit", "KIND_SECONDS", "ModelShape", "OP_KIND", "PlacementEstimate",
           "PoolMemory", "StageCosts", "Term", "Workload", "choose_placement", "cluster_placement",
           "cluster_report", "decode_seconds", "estimate_cluster", "estimate_colocated",
           "estimate_partitioned", "kv_token_bytes",
           "matmul_efficiency", "matmul_params", "plan_cluster",
           "forward_seconds", "predicted_vs_measured", "refine_and_choose", "resolve_device", "stage_kind", "sync_bytes", "ternary_search",
           "train_seconds", "transfer_bytes"]


# =============================================================================================
# Cluster planning (``flowrl plan cluster=<name>``): the same step, on hardware you do not have.
#
# Where StageCosts above scales FLOP counts by factors fitted to *this* run's profiled steps, the
# cluster model is first principles per term (roofline decode, 6·N·tokens training, ring
# collectives, bytes / bandwidth) with per-term efficiencies fitted once, to this project's own
# H200 measurements (:data:`CALIBRATION`, each with its source and fit), so it predicts a cluster
# and a model that never ran. Every term reports its formula with the numbers put in.
# =============================================================================================
class ModelShape(ModelSize, Protocol):
    """The model by shape (``flowrl.models.size.ModelSize`` from any HF config.json is one)."""

    hidden_size: int
    n_heads: int
    vocab_size: int
    intermediate_size: int
    tied_embeddings: bool


@dataclass(frozen=True)
class Fit:
    """One calibrated constant: its value, the measurement it comes from, how it was fitted."""

    value: float
    source: str
    fit: str


_H200_PEAK = 989.5e12
_MATMUL_CEILING = 790e12 / _H200_PEAK
# Qwen2.5-0.5B shape of benchmarks/scaling.py: 494,032,768 params (tied), 24 layers, hidden 896,
# 14 heads x 64, S = 256 + 512 tokens
_Q05_N, _Q05_L, _Q05_H, _Q05_S = 494_032_768, 24, 896, 768
_Q05_BF16 = 2 * _Q05_N  # 988,065,536 bytes of bf16 weights


def _h0(tokens_per_s: float, flops_per_token: float) -> float:
    """h0 of eff(h) = ceiling · h / (h + h0) through one measured point at h = 896."""
    return _Q05_H * (_MATMUL_CEILING / (tokens_per_s * flops_per_token / _H200_PEAK) - 1)


CALIBRATION: dict[str, Fit] = {
    "matmul_ceiling": Fit(
        _MATMUL_CEILING, "benchmarks/results/scaling.md: a plain 8192^3 bf16 matmul reaches 790 "
        "TFLOP/s on the lent H200", "790e12 / 989.5e12 (H200 dense bf16 peak)"),
    "h0_train": Fit(
        _h0(52368.129, 6 * _Q05_N + 6 * _Q05_L * _Q05_H * _Q05_S),
        "benchmarks/results/scaling_1gpu.json: 52,368 train tok/s, Qwen2.5-0.5B shape, S=768",
        "MFU = tok/s · (6N + 6·L·d·S) / peak = 0.162; h0 = h·(ceiling/MFU − 1), h = 896"),
    "h0_forward": Fit(
        _h0(117386.864, 2 * _Q05_N + 2 * _Q05_L * _Q05_H * _Q05_S),
        "benchmarks/results/scaling_1gpu.json: 117,387 logprob tok/s (same model and shapes)",
        "MFU = tok/s · (2N + 2·L·d·S) / peak = 0.121; h0 = h·(ceiling/MFU − 1)"),
    "decode_bw_eff": Fit(
        4.3e12 / 4.8e12, "benchmarks/results/rollout_h200.md: the decode floor's 4.3 TB/s of "
        "the H200's 4.8; NOT fitted to a bandwidth-bound run (none ran: a 0.5B model decodes "
        "host-bound)", "4.3 / 4.8"),
    "host_s_per_token_1": Fit(
        1 / 28771, "benchmarks/results/rollout_h200.md: flowrl-vllm (1 engine), seeded, 2048 "
        "seqs x 256 tokens: 28,771 tok/s, GPU nearly idle (roofline 12x faster)",
        "1 / tok/s: host (scheduler, sampler, logprobs) seconds per generated token"),
    "host_s_per_token_4": Fit(
        1 / 85997, "benchmarks/results/rollout_h200.md: flowrl-vllm-procs4 seeded: 85,997 tok/s",
        "1 / tok/s per GPU with 4 engine processes (2.99x one engine)"),
    "reload_fixed_s": Fit(
        0.214, "benchmarks/results/weight_sync_h200.md run 1 (full): vLLM reload_weights 0.214 s "
        "for a 0.8 GB model (4 engines in parallel)", "taken as a fixed per-load cost (Python "
        "work per tensor; a 0.5B run cannot separate it from a per-byte cost); the bytes are "
        "added at HBM speed (a device-to-device copy from CUDA IPC handles)"),
    "gather_bw_local": Fit(
        803_876_608 / 0.036, "benchmarks/results/weight_sync_h200.md: FSDP bucketed gather + "
        "cast 0.036 s in a training step (1 GPU)", "bytes / seconds"),
    "offload_bw": Fit(
        (6.766942 - 0.990108) * 2**30 / 5.074860, "benchmarks/results/scaling_1gpu.json: "
        "FSDPTrainEngine.offload() 5.78 GiB in 5.07 s (pageable host memory)", "bytes / s"),
    "onload_bw": Fit(
        (6.766942 - 0.990108) * 2**30 / 1.011263, "benchmarks/results/scaling_1gpu.json: "
        "onload() 5.78 GiB in 1.01 s", "bytes / s"),
    "sleep_wake_fixed_s_1": Fit(
        0.713 + 0.088, "benchmarks/results/rollout_h200.md switch table: flowrl-vllm sleep1 "
        "0.713 s + wake1 0.088 s (0.99 GB of bf16 weights)", "taken as fixed; the bytes are added "
        "at the PCIe peak both ways (vLLM backs sleeping weights with pinned host memory): a "
        "0.5B run cannot separate the two"),
    "sleep_wake_fixed_s_4": Fit(
        0.802 + 0.163, "rollout_h200.md: flowrl-vllm-procs4 sleep1 0.802 s + wake1 0.163 s",
        "as sleep_wake_fixed_s_1, 4 engines per GPU"),
    "logit_bytes": Fit(
        (43.047182 * 2**30 - 16 * _Q05_N - 34 * 16384 * _Q05_H * _Q05_L - _Q05_BF16)
        / (16384 * 512 / 768 * 151936),
        "benchmarks/results/scaling_1gpu.json: peak 43.0 GiB training 16384-token micro-batches",
        "(peak − 16N states − 34·T·h·L activations − bf16 rollout copy) / (response tokens · V)"),
    "nccl_eff": Fit(0.8, "assumed: no multi-node run exists; the 1->2 GPU run (scaling.md) only "
                    "shows the FSDP collectives hidden behind compute", "assumption"),
}


def cal(name: str) -> float:
    """The value of :data:`CALIBRATION` ``name``."""
    return CALIBRATION[name].value


def matmul_efficiency(hidden: int, forward_only: bool = False) -> float:
    """Fraction of peak a dense layer of width ``hidden`` reaches: ceiling · h / (h + h0), h0 fitted
    to this project's H200 training (or logprob) throughput at h = 896 (:data:`CALIBRATION`).
    Wider layers fill the tensor cores better: h=3584 → 0.40 (training), h=8192 → 0.56."""
    h0 = cal("h0_forward" if forward_only else "h0_train")
    return cal("matmul_ceiling") * hidden / (hidden + h0)


def matmul_params(m: ModelShape) -> int:
    """Parameters that multiply every token: all but an untied input embedding (a lookup)."""
    return m.n_params - (0 if m.tied_embeddings else m.vocab_size * m.hidden_size)


def kv_token_bytes(m: ModelShape) -> int:
    """bf16 KV cache of one token: 2 (K, V) · layers · kv_heads · head_dim · 2 bytes."""
    return 2 * m.n_layers * m.n_kv_heads * m.head_dim * 2


@dataclass(frozen=True)
class Term:
    """One cost term: ``seconds`` per step and the formula with its numbers put in;
    ``overlaps_previous``: it runs concurrently with the term before it (FSDP's collectives with
    the compute they prefetch for), so the two cost their max."""

    name: str
    seconds: float
    formula: str
    overlaps_previous: bool = False


def _g(x: float) -> str:
    return f"{x:.3g}"


@dataclass
class ClusterCosts:
    """Per-term costs of one RL step on a cluster (see the section comment above).

    Attributes:
        cluster: the hardware.
        shape: the model (every role: the actor's shape; a separate reward model is not sized).
        workload: global rows B = prompts × n, padded prompt P and response R tokens (every row
            is taken to run the full R: an upper bound), PPO epochs.
        n: samples per prompt (vLLM shares a prompt's prefill and KV among its n children).
        stages: stage → (role or None, kind) of the compiled plan.
        rollout_tp: tensor-parallel size of a rollout engine (0 = the smallest whose weights
            take at most half of a GPU's budget).
        micro_batch_tokens: tokens per training micro-batch (trainer.engine).
        activation_checkpointing: recompute activations (trainer.engine.gradient_checkpointing).
        max_num_seqs: vLLM's concurrent sequences per engine.
        memory_fraction: share of HBM the job may use.
    """

    cluster: Any
    shape: ModelShape
    workload: Workload
    n: int
    stages: dict[str, tuple[Optional[str], str]]
    rollout_tp: int = 0
    micro_batch_tokens: int = 16384
    activation_checkpointing: bool = False
    max_num_seqs: int = 2048
    memory_fraction: float = 0.9

    def __post_init__(self) -> None:
        if self.rollout_tp == 0:
            self.rollout_tp = self.auto_tp()

    # ---- sizes --------------------------------------------------------------------------
    @property
    def budget(self) -> float:
        """Bytes of one GPU the job may use."""
        return self.memory_fraction * self.cluster.hbm_bytes

    @property
    def bf16_weights(self) -> int:
        return 2 * self.shape.n_params

    def auto_tp(self) -> int:
        """Smallest power of two (≤ GPUs per node) whose bf16 weight shard takes at most half the
        budget, leaving the rest for the KV cache."""
        tp = 1
        while self.bf16_weights / tp > 0.5 * self.budget and tp < self.cluster.gpus_per_node:
            tp *= 2
        return tp

    def engine_procs(self, colocated: bool) -> int:
        """vLLM engine processes per GPU, flowrl's rule (rollout.vllm.engine_procs=null): 4 on a
        colocated GPU when 4 weight copies fit a quarter of the budget (tp 1), else 1."""
        return 4 if colocated and self.rollout_tp == 1 and \
            4 * self.bf16_weights <= 0.25 * self.budget else 1

    def train_state_bytes(self, gpus: int) -> float:
        """fp32 master weights + fp32 grads + 2 fp32 AdamW moments, FSDP-sharded: 16·N / p; a LoRA
        model (A adapter parameters): the frozen fp32 weights and the adapters' four, (4·N +
        16·A) / p."""
        a = self.shape.trainable_params
        return (4 * self.shape.n_params + 16 * a if a else 16 * self.shape.n_params) / gpus

    def train_state_label(self) -> str:
        """The memory line of :meth:`train_state_bytes`."""
        return ("fp32 params + LoRA adapters' grads+AdamW /p" if self.shape.trainable_params
                else "fp32 params+grads+AdamW /p")

    def resident_train_bytes(self, gpus: int) -> float:
        """What stays of the trainer while the rollout runs: weights + moments (grads freed), 12·N/p
        (LoRA: (4·N + 12·A) / p)."""
        a = self.shape.trainable_params
        return (4 * self.shape.n_params + 12 * a if a else 12 * self.shape.n_params) / gpus

    def activation_bytes(self) -> float:
        """One micro-batch of T tokens: 34·T·h bytes per layer (Korthikanti et al. 2022, eq. 2,
        bf16, attention by SDPA/flash so no s² term) or 2·T·h per layer + one layer's 34·T·h with
        activation checkpointing; plus the logits of its response tokens, T·R/(P+R) · V ·
        logit_bytes (fp32 log-softmax and its grad; fitted)."""
        m, w, t = self.shape, self.workload, self.micro_batch_tokens
        per_layer = 34 * t * m.hidden_size
        acts = (2 * t * m.hidden_size * m.n_layers + per_layer) if self.activation_checkpointing \
            else per_layer * m.n_layers
        resp = t * w.response_tokens / (w.prompt_tokens + w.response_tokens)
        return acts + resp * m.vocab_size * cal("logit_bytes")

    def kv_seq_bytes(self) -> float:
        """KV of one sequence at full length, its prompt's share split among the n children."""
        w = self.workload
        return kv_token_bytes(self.shape) * (w.prompt_tokens / self.n + w.response_tokens)

    # ---- rollout ------------------------------------------------------------------------
    def rollout_terms(self, gpus: int, kv_budget: float, colocated: bool) -> tuple[list[Term], str]:
        """Prefill (compute-bound) and decode (max of weight+KV bytes / bandwidth, FLOPs / peak and
        host seconds per token) on ``gpus`` GPUs as gpus/tp engines; ``kv_budget`` bytes of KV per
        GPU bound the concurrent sequences. Returns the terms and a note on what bounds decode."""
        m, w, c = self.shape, self.workload, self.cluster
        tp = self.rollout_tp
        inst = max(gpus // tp, 1)
        b = math.ceil(w.batch / inst)
        nmm = matmul_params(m)
        d = m.n_heads * m.head_dim
        eff = matmul_efficiency(m.hidden_size, forward_only=True)
        pre_tok = b / self.n * w.prompt_tokens
        pre_flops = pre_tok * (2 * nmm + 2 * m.n_layers * d * w.prompt_tokens)
        prefill = pre_flops / (tp * c.peak_bf16_flops * eff)
        cap = int(kv_budget * tp // self.kv_seq_bytes()) if kv_budget > 0 else 0
        conc = max(min(b, self.max_num_seqs, cap), 0)
        if conc == 0:
            return [Term("rollout: prefill", prefill, "-"),
                    Term("rollout: decode", INF, f"no KV cache room: {fmt_bytes(kv_budget)} per "
                         f"GPU < one sequence's {fmt_bytes(self.kv_seq_bytes() / tp)}")], "no KV room"
        waves = math.ceil(b / conc)
        ctx = w.prompt_tokens + w.response_tokens / 2
        step_bytes = 2 * nmm + conc * ctx * kv_token_bytes(m)
        t_bw = step_bytes / (tp * c.hbm_bw * cal("decode_bw_eff"))
        t_fl = conc * (2 * nmm + 4 * m.n_layers * d * ctx) / (tp * c.peak_bf16_flops * eff)
        procs = self.engine_procs(colocated)
        tau = cal("host_s_per_token_4") if procs == 4 else cal("host_s_per_token_1")
        t_host = conc * tau
        step = max(t_bw, t_fl, t_host)
        bound = {t_bw: "HBM bandwidth", t_fl: "compute", t_host: "host (vLLM per-token work)"}[step]
        limit = "KV cache" if conc == cap and cap < min(b, self.max_num_seqs) else \
            ("max_num_seqs" if conc == self.max_num_seqs and conc < b else "batch")
        decode = waves * w.response_tokens * step
        terms = [
            Term("rollout: prefill", prefill,
                 f"(B/inst/n)·P·(2·N_mm + 2·L·d·P) / (tp·peak·eff) = {_g(pre_tok)} tok · "
                 f"{_g(pre_flops / max(pre_tok, 1))} FLOP / ({tp}·{_g(c.peak_bf16_flops)}·{eff:.3f})"),
            Term("rollout: decode", decode,
                 f"waves·R·max(bytes/(tp·bw·{cal('decode_bw_eff'):.2f}), FLOPs/(tp·peak·eff), c·τ) = "
                 f"{waves}·{w.response_tokens}·max({_g(t_bw)}, {_g(t_fl)}, {_g(t_host)}) s; "
                 f"c={conc} seqs/engine ({limit}), bytes/step={fmt_bytes(step_bytes)}, "
                 f"{procs} engine(s)/GPU"),
        ]
        return terms, f"decode bound by {bound}, concurrency limited by {limit}"

    # ---- training side --------------------------------------------------------------------
    def forward_term(self, stage: str, gpus: int) -> Term:
        """2·N_mm·B·(P+R) + 2·L·d·B·(P+R)² FLOPs / (p·peak·eff_fwd(h))."""
        m, w, c = self.shape, self.workload, self.cluster
        s = w.prompt_tokens + w.response_tokens
        flops = w.batch * s * (2 * matmul_params(m) + 2 * m.n_layers * m.n_heads * m.head_dim * s)
        eff = matmul_efficiency(m.hidden_size, forward_only=True)
        sec = flops / (gpus * c.peak_bf16_flops * eff)
        return Term(f"{stage}: forward", sec, f"B·S·(2·N_mm + 2·L·d·S) / (p·peak·eff) = "
                    f"{_g(flops)} / ({gpus}·{_g(c.peak_bf16_flops)}·{eff:.3f})")

    def train_terms(self, stage: str, gpus: int) -> list[Term]:
        """Compute: epochs·B·S·(6·N_mm + 6·L·d·S) (+ one more forward with activation
        checkpointing) / (p·peak·eff(h)); FSDP: per micro-batch a bf16 all-gather in forward and
        in backward, one fp32 reduce-scatter per step, each moving (p−1)/p of the bytes through
        each GPU's link; overlapped with compute (max), as the 1→2 GPU run showed (scaling.md)."""
        m, w, c = self.shape, self.workload, self.cluster
        s = w.prompt_tokens + w.response_tokens
        per_tok = 6 * matmul_params(m) + 6 * m.n_layers * m.n_heads * m.head_dim * s
        if self.activation_checkpointing:
            per_tok = per_tok * 4 // 3
        flops = w.ppo_epochs * w.batch * s * per_tok
        eff = matmul_efficiency(m.hidden_size)
        compute = flops / (gpus * c.peak_bf16_flops * eff)
        micro = w.ppo_epochs * math.ceil(w.batch * s / gpus / self.micro_batch_tokens)
        frac = (gpus - 1) / gpus
        comm_bytes = frac * (micro * 2 * 2 * m.n_params + w.ppo_epochs * 4 * m.n_params)
        bw = c.link_bw(gpus) * cal("nccl_eff")
        comm = comm_bytes / bw if gpus > 1 else 0.0
        return [Term(f"{stage}: compute", compute,
                     f"epochs·B·S·(6·N_mm + 6·L·d·S) / (p·peak·eff) = {_g(flops)} / "
                     f"({gpus}·{_g(c.peak_bf16_flops)}·{eff:.3f})"),
                Term(f"{stage}: FSDP collectives (overlapped: max with compute)", comm,
                     f"(p−1)/p·(micro·2·2N + 4N) / (link·{cal('nccl_eff')}) = {_g(comm_bytes)} B / "
                     f"{_g(bw)} B/s, {micro} micro-batch(es) of {self.micro_batch_tokens} tokens",
                     overlaps_previous=True)]

    # ---- weights between the sides -------------------------------------------------------------
    def sync_terms(self, colocated: bool, train_gpus: int, rollout_gpus: int) -> list[Term]:
        """Colocated: every GPU gathers the full bf16 weights from the FSDP shards ((p−1)/p of them
        over its link, or the local cast rate, whichever is slower) and its engines reload their
        shard. Partitioned: a pipelined broadcast train pool → rollout pool, then the reload."""
        c, wb = self.cluster, self.bf16_weights
        load = cal("reload_fixed_s") + wb / self.rollout_tp / c.hbm_bw
        load_t = Term("weight sync: engine reload", load,
                      f"fixed + 2N/tp / hbm_bw = {cal('reload_fixed_s')} + "
                      f"{fmt_bytes(wb / self.rollout_tp)} / {_g(c.hbm_bw)} B/s")
        if colocated:
            p = train_gpus
            link = c.link_bw(p) * cal("nccl_eff")
            gather = max(wb * (p - 1) / p / link if p > 1 else 0.0, wb / cal("gather_bw_local"))
            return [Term("weight sync: gather from FSDP shards", gather,
                         f"max(2N·(p−1)/p / link, 2N / gather_local) = max({_g(wb * (p - 1) / p)} / "
                         f"{_g(link)}, {_g(wb)} / {_g(cal('gather_bw_local'))})"), load_t]
        bw = c.between_pools_bw(train_gpus, rollout_gpus) * cal("nccl_eff")
        return [Term("weight sync: broadcast train -> rollout pool", wb / bw,
                     f"2N / between-pools bw = {fmt_bytes(wb)} / {_g(bw)} B/s"), load_t]

    def swap_terms(self, gpus: int, offload_train: bool) -> list[Term]:
        """Colocated phases: vLLM sleep level 1 (bf16 weights to host) and wake: the fixed cost
        fitted for the engine count + the bytes both ways at the PCIe peak; with
        ``offload_train`` the trainer's resident state (12·N/p) goes to host and back too, at
        flowrl's measured (pageable) offload/onload rates."""
        procs = self.engine_procs(True)
        wb = self.bf16_weights / self.rollout_tp * procs
        fixed = cal("sleep_wake_fixed_s_4") if procs == 4 else cal("sleep_wake_fixed_s_1")
        hb = self.cluster.host_bw
        out = [Term("swap: vLLM sleep + wake (level 1)", fixed + 2 * wb / hb,
                    f"fixed + 2·W/host_bw = {fixed:.3f} + 2·{fmt_bytes(wb)} / {_g(hb)} B/s")]
        if offload_train:
            tb = self.resident_train_bytes(gpus)
            out.append(Term("swap: training state offload + onload", tb / cal("offload_bw")
                            + tb / cal("onload_bw"),
                            f"12N/p·(1/offload_bw + 1/onload_bw) = {fmt_bytes(tb)}·(1/"
                            f"{_g(cal('offload_bw'))} + 1/{_g(cal('onload_bw'))})"))
        return out


@dataclass
class PoolMemory:
    """Per-GPU memory of one pool: its phases (phase → component → bytes; the phases of a
    colocated pool take turns, so the peak is the largest phase), what had to move to host, what
    does not fit (empty = it fits)."""

    phases: dict[str, dict[str, float]]
    offloaded: list[str]
    does_not_fit: list[str]

    @property
    def peak(self) -> float:
        return max((sum(p.values()) for p in self.phases.values()), default=0.0)

    @property
    def peak_phase(self) -> Optional[str]:
        """The phase that sets :attr:`peak` (``"training"``, ``"rollout"``); None without phases."""
        return max(self.phases, key=lambda k: sum(self.phases[k].values()), default=None)


@dataclass
class ClusterEstimate:
    """One candidate: its PlacementPlan, predicted step, terms, memory per pool."""

    label: str
    pp: PlacementPlan
    step_s: float
    terms: list[Term]
    memory: dict[str, PoolMemory]
    notes: list[str]
    sides: dict[str, float]
    sync_s: float
    transfer_s: float

    @property
    def fits(self) -> bool:
        return all(not m.does_not_fit for m in self.memory.values()) and self.step_s < INF


def _stage_terms(costs: ClusterCosts, stage: str, gpus: int, kv_budget: float,
                 colocated: bool) -> tuple[list[Term], str]:
    role, kind = costs.stages[stage]
    if kind == "decode":
        return costs.rollout_terms(gpus, kv_budget, colocated)
    if kind == "forward":
        return [costs.forward_term(stage, gpus)], ""
    if kind == "train":
        return costs.train_terms(stage, gpus), ""
    return [], ""


def _side_seconds(terms: list[Term]) -> float:
    """Σ terms, a term that overlaps the previous one counting as the max of the two."""
    total, prev = 0.0, 0.0
    for t in terms:
        if t.overlaps_previous:
            total += max(t.seconds - prev, 0.0)  # only what the previous term does not hide
            prev = max(prev, t.seconds)
        else:
            total += t.seconds
            prev = t.seconds
    return total


def estimate_cluster(pp: PlacementPlan, costs: ClusterCosts) -> ClusterEstimate:
    """Predicted step, terms and per-GPU memory of a colocated or partitioned plan on the cluster.

    Colocated on W GPUs: Σ stages(W) + weight sync + swaps; the trainer's resident state is
    offloaded to host during the rollout when it leaves no KV room for one full wave of the
    batch. Partitioned, r rollout and t train GPUs: k = 0: rollout + train sides in turn; k ≥ 1:
    max of the two (they overlap); plus the weight broadcast and the rollout → train transfers."""
    c, w = costs.cluster, costs.workload
    notes: list[str] = []
    memory: dict[str, PoolMemory] = {}
    terms: list[Term] = []
    sides: dict[str, float] = {}
    one_pool = len(pp.pools) == 1  # a colocated plan is one pool of every rank
    tp = costs.rollout_tp
    wshard = costs.bf16_weights / tp
    if one_pool:
        p = len(pp.pools["all"].ranks)
        procs = costs.engine_procs(True)
        state, act = costs.resident_train_bytes(p), costs.activation_bytes()
        inst = max(p // tp, 1)
        rows = math.ceil(w.batch / inst)
        want_kv = min(rows, costs.max_num_seqs) * costs.kv_seq_bytes() / tp
        kv = costs.budget - state - wshard * procs
        offload = kv < want_kv
        if offload:
            kv = costs.budget - wshard * procs
            notes.append(f"colocated: the trainer's {fmt_bytes(state)}/GPU goes to host during the "
                         f"rollout (it would leave {fmt_bytes(costs.budget - state - wshard * procs)} "
                         f"of KV cache, below one wave's {fmt_bytes(want_kv)})")
        train_peak = costs.train_state_bytes(p) + act
        dnf = []
        if train_peak > costs.budget:
            dnf.append(f"training: {fmt_bytes(train_peak)} per GPU > budget "
                       f"{fmt_bytes(costs.budget)}: more GPUs, activation checkpointing or a smaller "
                       "micro-batch")
        if wshard * procs > costs.budget:
            dnf.append(f"rollout: bf16 weights/tp {fmt_bytes(wshard * procs)} > budget")
        roll = {"bf16 weights/tp x engines": wshard * procs,
                "KV cache (vLLM takes the rest)": max(kv, 0.0)}
        if not offload:
            roll["resident trainer (fp32 params + AdamW)/p"] = state
        memory["all"] = PoolMemory(
            {"training": {costs.train_state_label(): costs.train_state_bytes(p),
                          "activations + logits of one micro-batch": act},
             "rollout": roll},
            ["trainer state during the rollout"] if offload else [], dnf)
        for s in pp.pools["all"].plan.order:
            st, note = _stage_terms(costs, s, p, kv, True)
            terms += st
            if note:
                notes.append(f"stage {s}: {note}")
        terms += costs.sync_terms(True, p, p)
        terms += costs.swap_terms(p, offload)
        sides["all"] = _side_seconds(terms)
        step = sides["all"]
        sync_s = sum(t.seconds for t in terms if t.name.startswith("weight sync"))
        return ClusterEstimate("colocated", pp, step, terms, memory, notes, sides, sync_s, 0.0)
    r, t = len(pp.pools[ROLLOUT_POOL].ranks), len(pp.pools[TRAIN_POOL].ranks)
    kv = costs.budget - wshard
    rterms: list[Term] = []
    for s in pp.pools[ROLLOUT_POOL].plan.order:
        st, note = _stage_terms(costs, s, r, kv, False)
        rterms += st
        if note:
            notes.append(f"stage {s}: {note}")
    tterms: list[Term] = []
    for s in pp.pools[TRAIN_POOL].plan.order:
        tterms += _stage_terms(costs, s, t, 0.0, False)[0]
    sides = {ROLLOUT_POOL: _side_seconds(rterms), TRAIN_POOL: _side_seconds(tterms)}
    sync = costs.sync_terms(False, t, r)
    sync_s = sum(x.seconds for x in sync)
    xfer = transfer_bytes(pp, w)
    xbw = c.between_pools_bw(t, r) * cal("nccl_eff")
    xfer_s = sum(xfer.values()) / xbw
    body = sides[ROLLOUT_POOL] + sides[TRAIN_POOL] if pp.staleness == 0 else \
        max(sides[ROLLOUT_POOL], sides[TRAIN_POOL])
    step = body + sync_s + xfer_s
    act = costs.activation_bytes()
    dnf_t = [] if costs.train_state_bytes(t) + act <= costs.budget else [
        f"train pool: {fmt_bytes(costs.train_state_bytes(t) + act)} per GPU > budget "
        f"{fmt_bytes(costs.budget)}"]
    dnf_r = [] if wshard <= costs.budget else [f"rollout pool: bf16 weights/tp {fmt_bytes(wshard)} > "
                                                f"budget {fmt_bytes(costs.budget)}"]
    memory[TRAIN_POOL] = PoolMemory(
        {"training": {costs.train_state_label(): costs.train_state_bytes(t),
                      "activations + logits of one micro-batch": act}}, [], dnf_t)
    memory[ROLLOUT_POOL] = PoolMemory(
        {"rollout": {"bf16 weights/tp": wshard, "KV cache (vLLM takes the rest)": max(kv, 0.0)}},
        [], dnf_r)
    terms = rterms + tterms + sync + [Term("transfers rollout -> train", xfer_s,
                                           f"{fmt_bytes(sum(xfer.values()))} / {_g(xbw)} B/s")]
    label = f"partitioned rollout={r} train={t} k={pp.staleness}"
    return ClusterEstimate(label, pp, step, terms, memory, notes, sides, sync_s, xfer_s)


@dataclass
class ClusterPlan:
    """What ``flowrl plan cluster=...`` reports: every candidate, the chosen one (with the
    PlacementPlan the renderers print, its ``estimate`` and ``notes`` filled) and why."""

    costs: ClusterCosts
    candidates: list[ClusterEstimate]
    chosen: ClusterEstimate
    colocated: ClusterEstimate
    best_partitioned: Optional[ClusterEstimate]
    reason: str

    def tokens_per_s(self, e: ClusterEstimate) -> float:
        """Response tokens per second (every row of the batch runs R tokens)."""
        w = self.costs.workload
        return w.batch * w.response_tokens / e.step_s if e.step_s > 0 else 0.0


def plan_cluster(full_plan: Any, costs: ClusterCosts, placement_cfg: Optional[PlacementConfig] = None,
                 min_gain: float = 1.05, staleness: Sequence[int] = (0, 1),
                 asked: Optional[str] = None,
                 asked_pools: Optional[dict[str, list[int]]] = None) -> ClusterPlan:
    """Colocated on every GPU of ``costs.cluster`` vs every valid partitioned split (rollout GPUs a
    multiple of the rollout tp, pool sizes that divide) at each staleness k of ``staleness``; the
    fastest that fits wins, partitioned only when at least ``min_gain`` times faster than
    colocated (it holds a second weight copy and, at k ≥ 1, trains off-policy).

    What the user asked for is kept: ``asked`` = ``colocated`` / ``partitioned`` (the placement
    set on the command line) chooses that mode whatever the prediction (the table still shows
    every candidate), ``asked_pools`` is the only split tried, and a staleness the user set is
    the one ``staleness`` holds (``flowrl plan``'s caller).

    Raises:
        PlacementError: the graph cannot be placed at all, or not in the pools asked.
    """
    world = costs.cluster.world
    rp = {"rollout": costs.rollout_tp}
    base = placement_cfg or PlacementConfig()
    colo = estimate_cluster(colocated(full_plan, world, rp), costs)
    cands = [colo]
    why_not = ""
    splits = [asked_pools] if asked_pools else [
        {TRAIN_POOL: list(range(world - r)), ROLLOUT_POOL: list(range(world - r, world))}
        for r in (split_candidates(world, costs.rollout_tp) if world >= 2 else [])]
    for pools in splits:  # (with colocated asked too: the table shows every candidate)
        for k in staleness:
            pc = copy.copy(base)
            pc.staleness = k
            pc.pools = pools
            try:
                pp = partitioned(full_plan, pc, world, rp)
            except PlacementError as e:
                if asked_pools:  # the split asked for: its own reason, not another split
                    raise
                why_not = str(e)
                break
            cands.append(estimate_cluster(pp, costs))
    parts = [e for e in cands[1:] if e.fits]
    best = min(parts, key=lambda e: e.step_s) if parts else None
    if asked == "colocated":
        fit = "" if colo.fits else "; it does not fit: " + "; ".join(
            x for m in colo.memory.values() for x in m.does_not_fit)
        return ClusterPlan(costs, cands, colo, colo, best, f"placement=colocated, as asked{fit}")
    if asked == "partitioned" and len(cands) > 1:
        pick = best or min(cands[1:], key=lambda e: e.step_s)
        what = "the split asked for" if asked_pools else "the fastest split"
        fit = "" if pick.fits else "; NOTHING FITS: " + "; ".join(
            x for m in pick.memory.values() for x in m.does_not_fit)
        return ClusterPlan(costs, cands, pick, colo, best,
                           f"placement=partitioned, as asked: {what}{fit}")
    if not colo.fits and best is not None:
        chosen, reason = best, "colocated does not fit: " + "; ".join(
            x for m in colo.memory.values() for x in m.does_not_fit)
    elif best is None:
        chosen = colo
        reason = "no partitioned split fits" + (f" ({why_not})" if why_not else "") \
            if world >= 2 else "one GPU: colocated"
        if not colo.fits:
            reason = "NOTHING FITS (colocated shown): " + "; ".join(
                x for m in colo.memory.values() for x in m.does_not_fit)
    else:
        gain = colo.step_s / best.step_s if best.step_s > 0 else INF
        if gain >= min_gain:
            chosen, reason = best, (f"{best.label} is predicted {gain:.2f}x faster than colocated "
                                    f"(>= min_gain {min_gain})")
        else:
            chosen, reason = colo, (f"best split {best.label} is predicted {gain:.2f}x as fast as "
                                    f"colocated, below min_gain {min_gain}")
    return ClusterPlan(costs, cands, chosen, colo, best, reason)


def cluster_report(cp: ClusterPlan) -> list[str]:
    """The plan's text: setup, the candidate table (step s, tokens/s, per-GPU memory, fits), the
    chosen candidate's terms with formulas, its memory check, the calibration used."""
    c, m, w = cp.costs.cluster, cp.costs.shape, cp.costs.workload
    gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
    out = [f"Cluster {c.name}: {c.nodes} node(s) x {c.gpus_per_node} {c.gpu} = {c.world} GPUs; "
           f"peak {_g(c.peak_bf16_flops)} FLOP/s bf16, HBM {fmt_bytes(c.hbm_bytes)} at "
           f"{_g(c.hbm_bw)} B/s, NVLink {_g(c.nvlink_bw)} B/s, network {_g(c.internode_bw)} B/s "
           "per node",
           f"Model: {m.n_params / 1e9:.2f}B params ({matmul_params(m) / 1e9:.2f}B matmul), "
           f"{m.n_layers} layers, hidden {m.hidden_size}, {m.n_heads} heads / {m.n_kv_heads} KV "
           f"heads x {m.head_dim}, vocab {m.vocab_size}, intermediate {m.intermediate_size}"
           f"{', tied embeddings' if m.tied_embeddings else ''}; bf16 weights "
           f"{fmt_bytes(cp.costs.bf16_weights)}, KV {fmt_bytes(kv_token_bytes(m))}/token",
           f"Batch: {w.batch} rows = {w.batch // max(cp.costs.n, 1)} prompts x n={cp.costs.n}, "
           f"P={w.prompt_tokens} prompt + R={w.response_tokens} response tokens (every row runs "
           f"the full R: an upper bound), ppo_epochs={w.ppo_epochs}; rollout engine tp="
           f"{cp.costs.rollout_tp}; memory budget {cp.costs.memory_fraction:.0%} of HBM", "",
           "| candidate | step s | response tok/s | tok/s/GPU (P+R) | peak GiB/GPU per pool | fits |",
           "|---|---|---|---|---|---|"]
    for e in sorted(cp.candidates, key=lambda e: e.step_s):
        tps = cp.tokens_per_s(e)
        tot = w.batch * (w.prompt_tokens + w.response_tokens) / e.step_s / c.world if e.step_s else 0
        mem = ", ".join(f"{k} {gib(v.peak)}" for k, v in e.memory.items())
        mark = " (chosen)" if e is cp.chosen else ""
        out.append(f"| {e.label}{mark} | {_g(e.step_s)} | {tps:,.0f} | {tot:,.0f} | {mem} | "
                   f"{'yes' if e.fits else 'NO'} |")
    colo, bp = cp.colocated, cp.best_partitioned
    out += ["", f"Colocated: step {_g(colo.step_s)} s, {cp.tokens_per_s(colo):,.0f} response tok/s"
            + ("" if colo.fits else " (does not fit)") + "; best partitioned: "
            + (f"{bp.label}, step {_g(bp.step_s)} s, {cp.tokens_per_s(bp):,.0f} response tok/s"
               if bp is not None else ("none fits" if cp.costs.cluster.world > 1
                                       else "none (one GPU)")),
            f"Chose {cp.chosen.label}: {cp.reason}", "",
            f"Terms of {cp.chosen.label} (seconds per step):"]
    wt = max([len(t.name) for t in cp.chosen.terms] + [52])  # columns stay aligned for any name
    out += [f"  {t.name:<{wt}} {_g(t.seconds):>8}  = {t.formula}" for t in cp.chosen.terms]
    if cp.chosen is not cp.colocated:  # a partitioned split
        how = "rollout + train" if cp.chosen.pp.staleness == 0 else "max(rollout, train)"
        out.append(f"  step = {how} + sync + transfers = " + " + ".join(
            f"{k} {_g(v)}" for k, v in cp.chosen.sides.items()) +
            f" ({how}) + {_g(cp.chosen.sync_s)} + {_g(cp.chosen.transfer_s)}")
    out += ["", f"Memory per GPU ({cp.chosen.label}; budget {fmt_bytes(cp.costs.budget)}):"]
    rows = [(f"pool {pool}, {phase} phase: {k}", v) for pool, pm in cp.chosen.memory.items()
            for phase, comps in pm.phases.items() for k, v in comps.items()]
    wm = max([len(r) for r, _ in rows] + [0])
    for pool, pm in cp.chosen.memory.items():
        for phase, comps in pm.phases.items():
            for k, v in comps.items():
                out.append(f"  {f'pool {pool}, {phase} phase: {k}':<{wm}} {fmt_bytes(v)}")
        out += [f"  pool {pool}: offloaded to host: {x}" for x in pm.offloaded]
        out += [f"  pool {pool}: DOES NOT FIT: {x}" for x in pm.does_not_fit]
        if not pm.does_not_fit:
            out.append(f"  pool {pool}: fits")
    out += [f"  {n}" for n in cp.chosen.notes]
    out += ["", "Calibration (flowrl/compiler/cost.py CALIBRATION):"]
    out += [f"  {k} = {_g(f.value)}: {f.source}" for k, f in CALIBRATION.items()]
    return out


def cluster_placement(cp: ClusterPlan) -> PlacementPlan:
    """The chosen candidate's PlacementPlan with its ``estimate`` (PlacementEstimate: what the
    text/Mermaid/DOT renderers read) and the cluster report as its ``notes``."""
    e, w = cp.chosen, cp.costs.workload
    role_of = {"training": "actor", "rollout": "rollout"}  # the role whose phase it is
    mem: dict[str, tuple[int, Optional[str]]] = {
        k: (int(v.peak), role_of.get(v.peak_phase or "", v.peak_phase)) for k, v in e.memory.items()}
    est = PlacementEstimate(e.step_s, e.sides, e.sync_s, e.transfer_s, mem,
                            transfer_bytes(e.pp, w), 0 if e is cp.colocated
                            else 2 * cp.costs.shape.n_params, cp.costs.cluster.name,
                            {x.label: x.step_s for x in cp.candidates}, with_activations=True)
    return replace(e.pp, notes=list(e.pp.notes) + cluster_report(cp), estimate=est)
