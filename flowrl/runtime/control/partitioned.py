"""Partitioned execution: the rollout pool and the train pool run their halves of the plan
concurrently, connected by a queue of depth ``staleness`` (k).

Timeline of step ``s`` (versions count updates; the initial weights are version ``start - 1``)::

    rollout pool rank i                         its train pool rank(s) (see routing below)
    ───────────────────                         ──────────────────────────────────────────
    wait until version >= s-1-k  ◄──bcast v──┐  recv batch s (tagged with its version v_b)
    sample → rollout → reward → advantage     │  lag = version − v_b   (raise if lag > k)
    isend batch s (tagged version) ──────────►│  old_logprobs → update;  version += 1
    (store frees the sent keys at once)       └─ broadcast weights v (if a later rollout needs it)

k = 0: the rollout of step s waits for the update of step s−1 (same weights as colocated).
k = 1: rollout s+1 runs while the trainer updates on batch s; after warm-up every lag is exactly 1.

Routing (``n_roll`` rollout ranks, ``n_train`` train ranks, one a multiple of the other): rollout
rank i and train rank j are peers iff i ≡ j (mod min(n_roll, n_train)). More rollout ranks: a
train rank concatenates its peers' whole batches. More train ranks: rollout rank i cuts its rows
into n_train / n_roll contiguous near-equal chunks, chunk c to its c-th peer. The train pool is an
FSDP2 group of its own (``FSDPMixin(mesh=)`` over the pool's process group) when it has several
ranks: every collective of the update (loss denominators, micro-batch agreement, gradient
reduce-scatter, weight gathers) stays inside the pool, and the global denominators make the update
equal to one rank's on the whole batch.
Batches move point-to-point (``transport.send_batch``), weights by bucketed broadcast on a group of
train-pool rank 0 and the rollout ranks (``transport.WeightBroadcaster``; every train rank takes
part in the FSDP gather before it, only rank 0 sends); every wait has a timeout
and a dead peer raises ``PoolPeerError`` naming its pool and rank.

Metrics: each rollout rank ships its step metrics with the batch; the train rank merges them
(``store/*`` and ``perf/*`` get a ``/rollout`` suffix, its own a ``/train`` one) so train-pool
rank 0 logs both pools, including ``perf/busy_s/<pool>`` (seconds spent in stages and weight
transfers) for the busy fraction ``busy_s / perf/step_s``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from flowrl.compiler.placement import (
    ROLLOUT_POOL,
    TRAIN_POOL,
    PlacementPlan,
    PoolPlan,
    check_pool_sizes,
)
from flowrl.ops.context import DistInfo
from flowrl.runtime.io.distributed import combine_metrics, reduce_metrics
from flowrl.runtime.io.transport import PendingSend, WeightBroadcaster, recv_batch, send_batch

# fault injection for tests: a rollout rank exits abruptly (no teardown) after sending this step
FAULT_EXIT_AFTER = int(os.environ.get("FLOWRL_FAULT_ROLLOUT_EXIT_AFTER", "0") or 0)
# seconds a pool waits for the other before raising PoolPeerError (a dead peer is reported at
# once; this bounds a silent one). Covers the other pool's model load and first generation.
POOL_TIMEOUT_S = float(os.environ.get("FLOWRL_POOL_TIMEOUT_S", 1800))


class StalenessError(RuntimeError):
    """A batch reached the trainer more than ``placement.staleness`` weight versions old."""


@dataclass
class PoolContext:
    """This rank's place in a partitioned job.

    Attributes:
        placement: the whole placement; pool: this rank's PoolPlan.
        rank: global rank; dist: this pool's data-parallel rank/size and its process group.
        peers: global ranks of this rank's peers in the other pool, in chunk / concatenation
            order (rollout rank → the train ranks it sends to; train rank → those it receives
            from). See the module docstring for the routing.
        broadcaster: weight broadcast (train-pool rank 0 sends; rollout ranks receive; None on
            other train ranks).
    """

    placement: PlacementPlan
    pool: PoolPlan
    rank: int
    dist: DistInfo
    peers: list[int]
    broadcaster: WeightBroadcaster | None

    @property
    def is_train(self) -> bool:
        return self.pool.name == TRAIN_POOL


def check_partitioned(placement: PlacementPlan) -> None:
    """Pool shapes this runtime runs: the larger pool a multiple of the smaller (see
    :func:`flowrl.compiler.placement.check_pool_sizes`). Raises PlacementError naming
    ``placement.pools``."""
    check_pool_sizes(len(placement.pools[ROLLOUT_POOL].ranks), len(placement.pools[TRAIN_POOL].ranks))


def pool_peers(pool: str, index: int, n_roll: int, n_train: int) -> list[int]:
    """Pool-local indices of the other pool's ranks that pool rank ``index`` exchanges batches
    with: rollout i and train j are peers iff i ≡ j (mod min(n_roll, n_train)), in rank order.

    >>> pool_peers("rollout", 0, 1, 2), pool_peers("train", 1, 4, 2), pool_peers("rollout", 3, 4, 2)
    ([0, 1], [1, 3], [1])
    """
    m = min(n_roll, n_train)
    other = n_train if pool == ROLLOUT_POOL else n_roll
    return [j for j in range(other) if j % m == index % m]


def split_batch(data: Mapping[str, Any], parts: int) -> list[dict[str, Any]]:
    """Cut a batch's rows into ``parts`` contiguous near-equal chunks (``tensor_split`` sizes).

    Rows = the leading dim of the first tensor with ``dim >= 1`` (B = prompts × n); every tensor
    and list/tuple of that length is cut, anything else is copied into every chunk.

    Raises:
        ValueError: fewer rows than ``parts`` (a train rank would get none): raise
            ``trainer.prompts_per_step``.
    """
    if parts == 1:
        return [dict(data)]
    B = next((v.shape[0] for v in data.values() if isinstance(v, torch.Tensor) and v.dim()), None)
    if B is None or B < parts:
        raise ValueError(f"partitioned: a rollout rank's batch has {B} rows for {parts} train "
                         "ranks; raise trainer.prompts_per_step (or give the rollout pool more ranks)")
    bounds = [0] + [int(c[-1]) + 1 for c in torch.arange(B).tensor_split(parts)]
    out: list[dict[str, Any]] = [{} for _ in range(parts)]
    for key, v in data.items():
        rowwise = (isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == B) or \
            (isinstance(v, (list, tuple)) and len(v) == B)
        for c in range(parts):
            out[c][key] = v[bounds[c]:bounds[c + 1]] if rowwise else v
    return out


def pool_context(placement: PlacementPlan, rank: int, *, bucket_mb: int, device: torch.device,
                 timeout_s: float) -> PoolContext:
    """Create the pool groups (collective: every rank of the job calls this, in the same order)."""
    train = placement.pools[TRAIN_POOL].ranks
    roll = placement.pools[ROLLOUT_POOL].ranks
    groups = {TRAIN_POOL: dist.new_group(train), ROLLOUT_POOL: dist.new_group(roll)}
    wgroup = dist.new_group(sorted({train[0], *roll}))
    pool = placement.pool_of(rank)
    info = DistInfo(rank=pool.ranks.index(rank), world_size=len(pool.ranks), group=groups[pool.name])
    other = roll if pool.name == TRAIN_POOL else train
    peers = [other[j] for j in pool_peers(pool.name, info.rank, len(roll), len(train))]
    bc = None
    if rank in (train[0], *roll):
        bc = WeightBroadcaster(wgroup, train[0], bucket_mb=bucket_mb,
                               device=device if device.type == "cuda" else "cpu", timeout_s=timeout_s,
                               receivers=f"{ROLLOUT_POOL} pool ranks {roll}")
    return PoolContext(placement, pool, rank, info, peers, bc)


def pool_metrics(metrics: Mapping[str, float], pool: str) -> dict[str, float]:
    """One pool's step metrics under their merged names: ``store/*`` and ``perf/*`` get the pool
    suffix; ``perf/busy_s/<pool>`` = the stages' summed times (``time/*``) plus weight transfers."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        out[f"{k}/{pool}" if k.startswith(("store/", "perf/")) else k] = v
    busy = sum(v for k, v in metrics.items() if k.startswith("time/"))
    out[f"perf/busy_s/{pool}"] = busy + metrics.get("perf/weight_sync_s", 0.0)
    return out


def merge_rank_metrics(dicts: list[Mapping[str, float]]) -> dict[str, float]:
    """Combine several ranks' metric dicts by :func:`flowrl.runtime.io.distributed.metric_rule`."""
    return combine_metrics(dicts)


def concat_batches(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate batches from several rollout ranks along dim 0. Tensors of different widths
    are padded with zeros/False: ``prompt_*`` on the left (prompts are left-padded), everything
    else on the right. Lists (e.g. ``ground_truth``) are joined."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, Any] = {}
    for key in parts[0]:
        vals = [p[key] for p in parts]
        if not isinstance(vals[0], torch.Tensor):
            out[key] = [x for v in vals for x in v]
            continue
        if vals[0].dim() >= 2:
            width = max(v.shape[1] for v in vals)
            left = key.split(".", 1)[1].startswith("prompt_")
            vals = [torch.nn.functional.pad(v, (width - v.shape[1], 0) if left else
                                            (0, width - v.shape[1])) for v in vals]
        out[key] = torch.cat(vals)
    return out


class RolloutPool:
    """The rollout side: waits for the weights it needs, runs its stages, isends the batch.

    Args:
        executor: Executor of ``ctx.pool.plan`` with ``sends=ctx.pool.sends``.
        ctx: this rank's PoolContext; engines: role → engine (the weight-sync destinations load
            each received version).
    """

    def __init__(self, executor, ctx: PoolContext, *, staleness: int, timeout_s: float,
                 device: torch.device):
        self.executor, self.ctx, self.k = executor, ctx, staleness
        self.timeout_s, self.device = timeout_s, device
        dsts = {dst for _, dst in ctx.placement.weight_sync} or {"rollout"}
        self.sync_roles = [r for r in dsts if r in executor.engines]
        self.version = -1
        self.pending: list[PendingSend] = []

    def receive_weights(self) -> float:
        """Receive the next broadcast version into every sync destination; returns seconds."""
        t0 = time.perf_counter()
        bc = self.ctx.broadcaster
        if bc is None:  # a pool-context bug: every rollout rank receives the broadcast
            raise RuntimeError(f"rollout pool rank {self.ctx.rank}: no weight broadcaster")
        version, named = bc.recv()
        if self.version >= 0 and version != self.version + 1:
            raise RuntimeError(f"rollout pool rank {self.ctx.rank}: received weight version "
                               f"{version} after {self.version}")
        verify = self.executor.verify_now()  # one decision per version, for every role
        for role in self.sync_roles:
            sink = self.executor.engines.weight_sink(role)
            if not verify:
                sink.load_weights(named)
                continue
            from flowrl.runtime.step.weight_check import SyncProbe, check_sync

            probe = SyncProbe(named)
            sink.load_weights(probe)
            check_sync(sink, probe, f"broadcast version {version} -> {role} "
                       f"({type(sink).__name__})", shared=sink.shared)
        self.version = version
        return time.perf_counter() - t0

    def step(self, step: int) -> None:
        wait_s = 0.0
        while self.version < step - 1 - self.k:
            wait_s += self.receive_weights()
        outgoing: dict[str, Any] = {}
        m = self.executor.run_step(step, send=outgoing.update)
        self.pending = [p for p in self.pending if not p.done()]
        m = pool_metrics(m, ROLLOUT_POOL)
        m[f"perf/weight_wait_s/{ROLLOUT_POOL}"] = wait_s
        m["placement/rollout_version"] = float(self.version)
        state = self.executor.resources["prompts"].state_dict()
        for c, (dst, part) in enumerate(zip(self.ctx.peers, split_batch(outgoing, len(self.ctx.peers)))):
            # the step metrics travel once (with chunk 0): the train pool sums counts over ranks
            self.pending.append(send_batch(
                part, version=self.version, step=step, dst=dst, metrics=m if c == 0 else {},
                device=self.device if self.device.type == "cuda" else "cpu",
                timeout_s=self.timeout_s, peer=f"{TRAIN_POOL} pool", state=state))
        outgoing.clear()
        if step == FAULT_EXIT_AFTER:  # fault injection (tests): die without any teardown
            self.finish()
            # exit status 0, or torchrun would SIGTERM the train pool before it can notice
            os._exit(0)

    def finish(self) -> None:
        """Wait until the train pool took every batch (the sender's last references go)."""
        for p in self.pending:
            p.wait()
        self.pending = []


class TrainPool:
    """The train side: receives a batch, checks its version lag, runs its stages, broadcasts."""

    def __init__(self, executor, ctx: PoolContext, *, staleness: int, timeout_s: float,
                 device: torch.device, total_steps: int):
        self.executor, self.ctx, self.k = executor, ctx, staleness
        self.timeout_s, self.total_steps = timeout_s, total_steps
        self.device = device if device.type == "cuda" else torch.device("cpu")
        self.src_role = ctx.placement.weight_sync[0][0] if ctx.placement.weight_sync else "actor"
        self.version = -1
        self.lags: list[int] = []
        self.rollout_state: Any = None  # rollout pool rank 0's prompt-sampler state, last batch

    def send_weights(self, version: int) -> dict[str, float]:
        """Broadcast the actor's weights as ``version`` (only train-pool rank 0 sends).

        Several train ranks (FSDP): ``named_weights`` all-gathers each tensor over the train pool,
        so every train rank iterates it to the end; the others drop the full tensors."""
        t0 = time.perf_counter()
        named = self.executor.engines.weight_source(self.src_role).named_weights()  # FSDP: gathers
        bc = self.ctx.broadcaster
        if bc is not None:
            bc.send(named, version)
        else:
            for _ in named:
                pass
        self.version = version
        return {"perf/weight_sync_s": time.perf_counter() - t0,
                "perf/weight_sync_bytes": float(bc.last_bytes if bc else 0)}

    def step(self, step: int) -> dict[str, float]:
        """One training step; returns the merged metrics of both pools (this train rank's view,
        reduced over the train pool)."""
        t_step = time.perf_counter()
        got = [recv_batch(src, device=self.device, timeout_s=self.timeout_s,
                          peer=f"{ROLLOUT_POOL} pool") for src in self.ctx.peers]
        recv_s = time.perf_counter() - t_step
        for b in got:
            if b.step != step:
                raise RuntimeError(f"train pool: expected the batch of step {step} from rank "
                                   f"{b.src}, got step {b.step}")
        lag = self.version - min(b.version for b in got)
        if lag > self.k:
            raise StalenessError(f"step {step}: batch of weight version {min(b.version for b in got)}"
                                 f" is {lag} versions behind the trainer's {self.version}; "
                                 f"placement.staleness={self.k}")
        self.lags.append(lag)
        self.rollout_state = got[0].state  # a chunk of rollout pool rank 0's batch on train rank 0
        m = self.executor.run_step(step, received=concat_batches([b.data for b in got]))
        # a later rollout step needs this version only if step + 1 + k <= total_steps
        if step <= self.total_steps - 1 - self.k:
            m.update(self.send_weights(self.version + 1))
        else:
            self.version += 1
        m["perf/recv_wait_s"] = recv_s
        out = pool_metrics(m, TRAIN_POOL)
        out.update(merge_rank_metrics([b.metrics for b in got]))
        out["placement/version_lag"] = float(lag)
        out["store/peak_bytes"] = max(out.get(f"store/peak_bytes/{p}", 0.0)
                                      for p in (TRAIN_POOL, ROLLOUT_POOL))
        out["perf/step_s"] = time.perf_counter() - t_step
        return reduce_metrics(out, group=self.ctx.dist.group)


# ---- what placement=partitioned supplies to the job (runtime/control/job.py RankPlacement) -----
class _PoolRank:
    """A rank of a partitioned job: its pool's plan, data-parallel group and peers.

    Each rank builds only its pool's engines: the rollout pool a rollout engine on its own model
    copy (weights arrive by broadcast, version ``start - 1`` first), the train pool the actor
    (+ ref, critic) and no rollout engine; a train pool of several ranks shards them with FSDP2
    over the pool's own process group, so the rollout ranks never join a training collective.
    Seeds and prompt shards follow the *pool* data-parallel rank, so pool rank 0 draws what rank
    0 of a colocated run draws: with ``staleness=0`` a partitioned run trains the same weights as
    a colocated one on the same seeds.
    """

    name = "partitioned"
    overlaps = False

    def __init__(self, cfg, pp: PlacementPlan, dinfo: DistInfo):
        from flowrl.runtime.step.resources import run_device

        self.device = run_device(cfg)
        self.ctx = pool_context(pp, dinfo.rank, bucket_mb=cfg.placement.bucket_mb,
                                device=self.device, timeout_s=POOL_TIMEOUT_S)
        self.pp, self.k, self.total_steps = pp, pp.staleness, cfg.trainer.total_steps
        self.plan, self.dist, self.sends = self.ctx.pool.plan, self.ctx.dist, self.ctx.pool.sends
        # build_engines: FSDP shards over the pool's ranks and group, never the world
        self.engine_ranks: Optional[int] = self.ctx.dist.world_size
        self.engine_group: Any = self.ctx.dist.group
        self.logs = dinfo.rank == pp.pools[TRAIN_POOL].ranks[0]
        self.sampling_ranks = len(pp.pools[ROLLOUT_POOL].ranks)

    def header(self, cfg, out_dir) -> str:
        return (f"[bold]flowrl[/bold] graph={self.pp.full.graph.name} placement=partitioned "
                f"train={self.pp.pools[TRAIN_POOL].ranks} rollout={self.pp.pools[ROLLOUT_POOL].ranks}"
                f" staleness={self.k} steps={self.total_steps} out={out_dir}")

    def summary_fields(self, earlier: dict[str, Any], start: int) -> dict[str, Any]:
        return {**earlier, "placement": "partitioned", "staleness": self.k,
                "version_lags": earlier.get("version_lags", [])[:start - 1]}

    def final_fields(self, summary: dict[str, Any]) -> dict[str, Any]:
        return {}


class RolloutRank(_PoolRank):
    """A rollout-pool rank: waits for the weights it needs, generates, sends. It holds no
    training state; it joins the checkpoint of step ``s`` right after it received weight version
    ``s`` (or after its last step when no later rollout needs that version), which is where the
    train pool waits for it."""

    holds_state, samples = False, True

    def start(self, executor, engines, start: int, resumed: bool) -> None:
        self.pool = RolloutPool(executor, self.ctx, staleness=self.k, timeout_s=POOL_TIMEOUT_S,
                                device=self.device)
        self.pool.receive_weights()  # version start - 1

    def step(self, step: int, events) -> None:
        while self.pool.version < step - 1 - self.k:
            self.pool.receive_weights()
            events.reached(self.pool.version)
        self.pool.step(step)

    def finish(self, events) -> None:
        for version in range(self.pool.version + 1, self.total_steps + 1):
            events.reached(version)  # versions no rollout needed: the train pool saves them
        self.pool.finish()

    def prompt_state(self, prompts) -> Any:
        return None  # the sampler's state travels with each batch; the train pool saves it

    def evaluator(self, cfg, plan, engines, prompts, tokenizer):
        return None


class TrainRank(_PoolRank):
    """A train-pool rank: receives its peers' batches, updates, broadcasts the weights; its
    pool rank 0 logs both pools' metrics and writes the checkpoint metadata."""

    holds_state, samples = True, False

    def start(self, executor, engines, start: int, resumed: bool) -> None:
        self.pool = TrainPool(executor, self.ctx, staleness=self.k, timeout_s=POOL_TIMEOUT_S,
                              device=self.device, total_steps=self.total_steps)
        self.pool.send_weights(start - 1)

    def step(self, step: int, events) -> None:
        events.record(step, self.pool.step(step))
        events.reached(step)

    def finish(self, events) -> None:
        pass

    def prompt_state(self, prompts) -> Any:
        return self.pool.rollout_state  # rollout pool rank 0's, from its last batch

    def final_fields(self, summary: dict[str, Any]) -> dict[str, Any]:
        return {"version_lags": summary.get("version_lags", []) + self.pool.lags}

    def evaluator(self, cfg, plan, engines, prompts, tokenizer):
        """Greedy eval on train-pool rank 0 (the trainer holds the newest weights; the rollout
        pool keeps generating meanwhile). One train rank: an HF engine over the actor's own
        module (shared, no copy). Several (FSDP): the module is sharded, so every train rank
        joins the gather of the actor's weights and rank 0 evaluates a full model copy it loads
        for the eval and then drops. Returns None on ranks that take no part."""
        from flowrl.engines.rollout.hf import HFRolloutEngine
        from flowrl.runtime.step.evaluate import greedy_evaluator

        ev = cfg.trainer.eval
        if not (ev.before or ev.after or ev.every) or ev.limit == 0:
            return None
        actor = engines.weight_source("actor")
        if prompts.world_size > 1:  # the train pool's shard of the eval slice: rank 0 evaluates it all
            from flowrl.data import PromptSource
            from flowrl.runtime.step.resources import image_encoder

            prompts = PromptSource(cfg.data, tokenizer,
                                   image_encoder=image_encoder(cfg.model, tokenizer))
        if not actor.lockstep:  # one train rank: the module is whole
            if not self.logs:
                return None
            shared = HFRolloutEngine(actor.model, tokenizer, cfg.rollout.hf, shared=True)
            return greedy_evaluator(cfg, plan, shared, prompts, tokenizer)
        rank0 = self.logs

        def gathered(samples_path=None, on_progress=None):
            from flowrl.models.loading import load_model

            named = actor.named_weights()  # collective over the train pool: iterate to the end
            if not rank0:
                for _ in named:
                    pass
                return None
            with torch.random.fork_rng(devices=[]):  # a random init must not move rank 0's RNG
                model = load_model(cfg.model)
            engine = HFRolloutEngine(model.to(actor.device), tokenizer, cfg.rollout.hf)
            engine.load_weights(named)
            return greedy_evaluator(cfg, plan, engine, prompts, tokenizer)(samples_path, on_progress)

        return gathered


def partitioned_rank(cfg, pp: PlacementPlan, dinfo: DistInfo) -> "TrainRank | RolloutRank":
    """This rank's side of a partitioned job (creates the pool groups: a collective, every rank
    calls it in the same order)."""
    check_partitioned(pp)
    pool = pp.pool_of(dinfo.rank).name
    return TrainRank(cfg, pp, dinfo) if pool == TRAIN_POOL else RolloutRank(cfg, pp, dinfo)


__all__ = ["POOL_TIMEOUT_S", "PoolContext", "RolloutPool", "RolloutRank", "StalenessError",
           "TrainPool", "TrainRank", "check_partitioned", "concat_batches", "merge_rank_metrics",
           "partitioned_rank", "pool_context", "pool_metrics", "pool_peers", "split_batch"]
