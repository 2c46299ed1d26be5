"""Placement: which pool of ranks runs which stage of a compiled plan.

* ``colocated``: one pool holding every rank; every role takes its turn on the same devices and
  the plan's swap points offload/onload between phases (the ExecutionPlan as compiled).
* ``partitioned``: two disjoint pools. The *rollout pool* runs the rollout side of the graph
  (``sample -> rollout -> reward`` and every role-less stage that depends only on them); the *train
  pool* runs the rest (logprobs, advantage when it needs the critic, update). The rollout pool sends
  the tensors the train pool reads point-to-point (``transfers``) and frees them once sent; after
  each update the train pool broadcasts the actor's weights to the rollout pool, which may run at
  most ``staleness`` weight versions behind.
* ``auto``: a cost model picks one of the above (``flowrl/compiler/cost.py``).

Here: the data (:class:`Mode`, the config, the plans) and the two cuts (:func:`colocated`,
:func:`partitioned`); each mode's behaviour as one class (place, cost, render) is in
``flowrl/compiler/modes.py``. No engine is imported here: ``flowrl plan placement=partitioned``
works on a laptop.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from flowrl.compiler.devices import DEVICES
from flowrl.compiler.plan import Action, CompiledStage, ExecutionPlan, TensorLife, _swap_actions
from flowrl.graph.graph import Graph
from flowrl.graph.roles import ROLES


class Mode(str, Enum):
    """``placement.mode``. A ``str``: it prints, formats and serialises as its value (Python
    3.10 has no ``enum.StrEnum``; this is what it would be)."""

    COLOCATED = "colocated"
    PARTITIONED = "partitioned"
    AUTO = "auto"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


MODES = tuple(m.value for m in Mode)


def parse_mode(value: str) -> Mode:
    """``placement.mode`` as a :class:`Mode`.

    Raises:
        ValueError: an unknown mode, in one line with the closest mode, e.g. ``placement.mode
            must be one of ('colocated', 'partitioned', 'auto'), got 'colo' (did you mean
            colocated?)``.
    """
    try:
        return Mode(value)
    except ValueError:
        close = difflib.get_close_matches(str(value), MODES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"placement.mode must be one of {MODES}, got {value!r}{hint}") from None
TRAIN_POOL, ROLLOUT_POOL = "train", "rollout"
# where each role lives unless placement.roles says otherwise (the role table's ``pool``)
DEFAULT_ROLE_POOL: dict[str, str] = {role: spec.pool for role, spec in ROLES.items()}


class PlacementError(ValueError):
    """An impossible placement; the message names the ``placement.*`` field. Raised before any
    model loads."""


@dataclass
class AutoConfig:
    """``placement=auto``: profile ``profile_steps`` colocated steps, then pick the placement (and
    pool split) the cost model predicts fastest. ``min_gain``: partitioned must be predicted at
    least this much faster (ratio) to be chosen over colocated, since it costs a model copy.
    ``device``: throughput profile of the cost model (``flowrl.compiler.cost.DEVICES``: cpu, h200;
    ``auto`` = h200 when training on CUDA, else cpu)."""

    profile_steps: int = 2
    min_gain: float = 1.05
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.profile_steps < 1:
            raise ValueError(f"placement.auto.profile_steps must be >= 1, got {self.profile_steps}")
        if self.min_gain < 1.0:
            raise ValueError(f"placement.auto.min_gain must be >= 1.0, got {self.min_gain}")
        if self.device != "auto" and self.device not in DEVICES:
            raise ValueError(f"placement.auto.device must be auto or one of {sorted(DEVICES)}, "
                             f"got {self.device!r}")


@dataclass
class PlacementConfig:
    """Attributes:
        mode: colocated | partitioned | auto.
        pools: partitioned: pool name → global ranks, e.g. ``{train: [0], rollout: [1]}``. A pool
            left out or given as an empty list takes its ranks of the default split
            (:func:`default_pools`: the first half of the ranks train, rounded up, the rest roll
            out), so ``launcher.nproc=4 placement=partitioned`` splits 2 / 2.
        roles: role → pool name, overriding :data:`DEFAULT_ROLE_POOL` (e.g. ``{ref: rollout}``).
        staleness: weight versions the rollout pool may run behind the trainer (0 = the next rollout
            waits for the new weights; 1 = one-step off-policy). None = the graph's
            ``weight_sync.staleness``.
        bucket_mb: weight broadcast bucket size (MiB) from the train pool to the rollout pool.
        auto: settings of ``mode=auto``.
    """

    mode: str = Mode.COLOCATED  # a Mode after __post_init__ (OmegaConf types the field as str)
    pools: dict[str, list[int]] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    staleness: Optional[int] = None
    bucket_mb: int = 256
    auto: AutoConfig = field(default_factory=AutoConfig)

    def __post_init__(self) -> None:
        self.mode = parse_mode(self.mode)
        if self.staleness is not None and self.staleness < 0:
            raise ValueError(f"placement.staleness must be >= 0 or null, got {self.staleness}")
        if self.bucket_mb < 1:
            raise ValueError(f"placement.bucket_mb must be >= 1, got {self.bucket_mb}")
        if any(self.pools.values()) and self.mode is not Mode.PARTITIONED:  # ignored without a word
            raise ValueError(f"placement.pools is read only by placement=partitioned, and this run "
                             f"is placement={self.mode}: put placement=partitioned before the "
                             f"pools, or drop placement.pools")
        if self.roles and self.mode is Mode.COLOCATED:
            raise ValueError("placement.roles is read only by placement=partitioned or auto, and "
                             "this run is placement=colocated: choose one of those, or drop "
                             "placement.roles")
        for name, ranks in self.pools.items():  # [] = the pool's ranks of the default split
            if any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
                raise ValueError(f"placement.pools.{name} must be a list of distinct ranks >= 0 "
                                 f"(empty: the default split), got {list(ranks)}")
        for role, _pool in self.roles.items():
            if role not in DEFAULT_ROLE_POOL:
                raise ValueError(f"placement.roles.{role}: unknown role (roles: "
                                 f"{sorted(DEFAULT_ROLE_POOL)})")


@dataclass
class PoolPlan:
    """One pool's part of a step.

    Attributes:
        name: pool name (``all`` when colocated).
        ranks: global ranks of the pool; the pool's data-parallel rank is the index in this list.
        plan: the pool's own ExecutionPlan: its stages in order, its swap points, and its lifecycle
            (``release_after`` counts only local consumers; keys in ``sends`` are freed at send).
        sends: keys ``"stage.output"`` sent to the other pool after this pool's stages ran.
        recvs: keys received from the other pool before this pool's first stage reads them.
    """

    name: str
    ranks: list[int]
    plan: ExecutionPlan
    sends: list[str] = field(default_factory=list)
    recvs: list[str] = field(default_factory=list)

    @property
    def roles(self) -> list[str]:
        return self.plan.roles


@dataclass
class PlacementPlan:
    """The compiler's placement output.

    Attributes:
        mode: ``colocated`` or ``partitioned`` (``auto`` is resolved to one of them).
        world_size: ranks in the job.
        pools: pool name → PoolPlan (colocated: one pool ``all``).
        transfers: keys crossing from the rollout pool to the train pool, every step.
        staleness: max weight-version lag of the rollout pool (partitioned only).
        weight_sync: (source role, destination role) pairs synced after each update.
        notes: why this placement (auto's predicted step times, defaults taken).
        full: the whole-graph plan both pools were cut from.
        halves: colocated with ``staleness`` 1 only: the rollout and train halves of ``full``, cut
            as ``partitioned`` cuts it (:func:`split_plan`), both on every rank. The runtime runs
            the rollout half of step s+1 beside the train half of step s (one-step off-policy on
            the same devices: ``runtime/control/overlap.py``). Empty otherwise.
        estimate: ``flowrl.compiler.cost.PlacementEstimate`` (predicted step time, memory per
            pool, bytes moved) when a cost model was run (``placement=auto``, ``flowrl plan``).
    """

    mode: Mode
    world_size: int
    pools: dict[str, PoolPlan]
    full: ExecutionPlan
    transfers: list[str] = field(default_factory=list)
    staleness: int = 0
    weight_sync: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    estimate: Optional[Any] = None
    halves: dict[str, PoolPlan] = field(default_factory=dict)

    @property
    def overlapped(self) -> bool:
        """Colocated, the rollout of the next step beside this step's update (``halves``)."""
        return bool(self.halves)

    def pool_of(self, rank: int) -> PoolPlan:
        """The pool holding global ``rank``. Raises KeyError when no pool holds it."""
        for p in self.pools.values():
            if rank in p.ranks:
                return p
        raise KeyError(f"rank {rank} is in no pool of {sorted(self.pools)}")


def default_pools(world_size: int) -> dict[str, list[int]]:
    """First ceil(W/2) ranks train, the rest roll out (W=2: train [0], rollout [1])."""
    n_train = (world_size + 1) // 2
    return {TRAIN_POOL: list(range(n_train)), ROLLOUT_POOL: list(range(n_train, world_size))}


def split_candidates(world_size: int, rollout_tp: int = 1) -> list[int]:
    """Rollout-pool sizes r (train gets W - r) that pass :func:`check_pool_sizes`: 1 <= r < W, r a
    multiple of the rollout tensor-parallel size, max(r, W-r) a multiple of min(r, W-r).
    W=8, tp=1 → [1, 2, 4, 6, 7]."""
    return [r for r in range(1, world_size)
            if r % rollout_tp == 0 and max(r, world_size - r) % min(r, world_size - r) == 0]


def check_parallelism(pool_sizes: dict[str, int], role_pool: dict[str, str], roles: list[str],
                      role_parallelism: dict[str, int]) -> None:
    """Every role's pool size must be a multiple of its tensor-parallel size (``role_parallelism``,
    default 1), e.g. a vLLM engine with tensor_parallel_size=2 needs 2, 4, ... rollout ranks.

    Raises:
        PlacementError: naming ``placement.pools.<pool>`` (or ``launcher.nproc`` when colocated).
    """
    for role in roles:
        tp = role_parallelism.get(role, 1)
        pool = role_pool[role]
        n = pool_sizes[pool]
        if tp > 1 and n % tp:
            field_name = "launcher.nproc" if pool == "all" else f"placement.pools.{pool}"
            raise PlacementError(f"{field_name}: pool '{pool}' has {n} rank(s), too few for role "
                                 f"'{role}' (tensor_parallel_size {tp}): the size must be a "
                                 f"multiple of {tp}")


def check_pool_sizes(n_rollout: int, n_train: int) -> None:
    """Data-parallel routing: rollout rank i sends its rows to train rank i mod n_train (more
    rollout ranks), or splits them over train ranks j ≡ i (mod n_rollout) (more train ranks), so
    the larger pool's size must be a multiple of the smaller's.

    Raises:
        PlacementError: naming ``placement.pools``.
    """
    lo, hi = sorted((n_rollout, n_train))
    if hi % lo:
        raise PlacementError(f"placement.pools: rollout has {n_rollout} rank(s) and train "
                             f"{n_train}; the larger pool's size must be a multiple of the "
                             f"smaller's (samples route rollout rank i -> train rank i mod "
                             f"{n_train})")


def staleness_of(plan: ExecutionPlan, cfg: PlacementConfig) -> int:
    """``placement.staleness``, or the graph's largest ``weight_sync.staleness`` when it is null."""
    if cfg.staleness is not None:
        return cfg.staleness
    return max([w.staleness for w in plan.graph.weight_sync], default=0)


def _sync_roles(graph: Graph) -> list[tuple[str, str]]:
    """(source role, destination role) of every ``weight_sync`` of a validated graph.

    Raises:
        ValueError: a sync between stages without a role (the graph skipped validation)."""
    out = []
    for w in graph.weight_sync:
        src, dst = graph[w.src].role, graph[w.dst].role
        if src is None or dst is None:
            raise ValueError(f"weight_sync {w.src} -> {w.dst}: both stages need a role")
        out.append((src, dst))
    return out


def colocated(plan: ExecutionPlan, world_size: int,
              role_parallelism: Optional[dict[str, int]] = None,
              staleness: int = 0) -> PlacementPlan:
    """One pool ``all`` of every rank running ``plan`` as compiled (its swap points included).

    ``staleness`` 1: the plan is also cut into its rollout and train halves (``halves``), which
    the runtime runs side by side on every rank: the rollout of step s+1 with the weights of
    update s-1 while the trainer updates on the batch of step s (one-step off-policy, as
    ``placement=partitioned staleness=1`` but without a second pool of devices).

    Raises:
        PlacementError: a world size < 1, or not a multiple of a role's tensor-parallel size
            (``role_parallelism``), naming ``launcher.nproc``; ``staleness`` > 1 (one device
            pipeline holds at most one batch ahead), or 1 on a graph that cannot be cut
            (no rollout stage, or a rollout-side stage that reads a train-side output), naming
            ``placement.staleness``.
    """
    if world_size < 1:
        raise PlacementError(f"launcher.nproc: world size must be >= 1, got {world_size}")
    check_parallelism({"all": world_size}, {r: "all" for r in plan.roles}, plan.roles,
                      role_parallelism or {})
    pool = PoolPlan("all", list(range(world_size)), plan)
    if staleness > 1:
        raise PlacementError(
            f"placement.staleness={staleness} with placement=colocated: the rollout can run at "
            "most one step ahead of the update on the same devices (set placement.staleness=1, "
            "or placement=partitioned for a deeper queue between two pools)")
    halves: dict[str, PoolPlan] = {}
    transfers: list[str] = []
    if staleness == 1:
        missing = next((f"no {what}" for role, what in (("rollout", "rollout stage"),
                                                        ("actor", "actor update"))
                        if role not in plan.roles), None)
        if missing:
            raise PlacementError(
                f"placement.staleness=1 overlaps the rollout with the update, and graph "
                f"'{plan.graph.name}' has {missing}: set placement.staleness=0")
        ranks = list(range(world_size))
        halves, transfers = split_plan(plan, DEFAULT_ROLE_POOL, ranks, ranks,
                                       field_name="placement.staleness")
    return PlacementPlan(Mode.COLOCATED, world_size, {"all": pool}, full=plan,
                         weight_sync=_sync_roles(plan.graph), staleness=staleness,
                         transfers=transfers, halves=halves)


def assign_stages(plan: ExecutionPlan, role_pool: dict[str, str]) -> dict[str, str]:
    """stage → pool. A stage with a role goes to its role's pool; a role-less stage goes to the
    rollout pool when every stage it reads from is there (``sample``, rule rewards, GRPO's
    advantage), else to the train pool (GAE needs the critic's values)."""
    where: dict[str, str] = {}
    for c in plan.stages:  # plan order is topological
        s = c.stage
        if s.role:
            where[s.name] = role_pool[s.role]
        else:
            srcs = {src for _, src, _ in s.input_refs()}
            where[s.name] = ROLLOUT_POOL if all(where[x] == ROLLOUT_POOL for x in srcs) else TRAIN_POOL
    return where


def _pool_plan(full: ExecutionPlan, name: str, ranks: list[int], stages: list[str],
               sends: list[str], recvs: list[str]) -> ExecutionPlan:
    """The ExecutionPlan of one pool: its stages, swap points among its own roles, and a lifecycle
    in which a key leaves the pool's store after its last *local* consumer — or, if it is sent,
    at the send."""
    g = full.graph
    sub = Graph(name=g.name, stages=[g[n] for n in stages], description=g.description)
    actions, resident = _swap_actions(sub, stages)
    mine = set(stages)
    lifetimes: dict[str, TensorLife] = {}
    release: dict[str, list[str]] = {n: [] for n in stages}
    for key, life in full.lifetimes.items():
        if life.producer not in mine and key not in recvs:
            continue
        cons = [c for c in life.consumers if c in mine]
        last = cons[-1] if cons else None
        lifetimes[key] = TensorLife(key, life.producer if life.producer in mine else "recv", cons, last)
        if key in sends:
            continue  # freed by the executor right after it is sent
        if last is not None:
            release[last].append(key)
        elif life.producer in mine:
            release[life.producer].append(key)
    compiled: list[CompiledStage] = [c for c in full.stages if c.stage.name in mine]
    return ExecutionPlan(graph=g, stages=compiled, actions=actions, lifetimes=lifetimes,
                         release_after=release, pruned=full.pruned, warnings=full.warnings,
                         placement=f"partitioned:{name}", resident_at_end=resident,
                         refill={k: v for k, v in full.refill.items() if k in mine})


def split_plan(plan: ExecutionPlan, role_pool: dict[str, str], rollout_ranks: list[int],
               train_ranks: list[int], field_name: str = "placement.roles"
               ) -> tuple[dict[str, PoolPlan], list[str]]:
    """Cut ``plan`` into its rollout and train halves (:func:`assign_stages`): the pool plans and
    the keys that cross from the rollout half to the train half every step.

    Raises:
        PlacementError: a rollout-side stage reads a train-side output (the cut must be one-way:
            only weights flow back), naming ``field_name``.
    """
    where = assign_stages(plan, role_pool)
    g = plan.graph
    for c in plan.stages:
        s = c.stage
        if where[s.name] == ROLLOUT_POOL:
            for _arg, src, out in s.input_refs():
                if where[src] == TRAIN_POOL:
                    fix = (f"move role '{s.role or g[src].role}' to the {TRAIN_POOL} pool"
                           if field_name == "placement.roles" else "set placement.staleness=0")
                    raise PlacementError(
                        f"{field_name}: stage '{s.name}' (pool {ROLLOUT_POOL}) reads "
                        f"'{src}.{out}' from pool {TRAIN_POOL}; only weights may flow back — {fix}")
    transfers = [k for k, life in plan.lifetimes.items()
                 if where[life.producer] == ROLLOUT_POOL
                 and any(where[c] == TRAIN_POOL for c in life.consumers)]
    order = {p: [n for n in plan.order if where[n] == p] for p in (ROLLOUT_POOL, TRAIN_POOL)}
    pools = {
        ROLLOUT_POOL: PoolPlan(ROLLOUT_POOL, rollout_ranks,
                               _pool_plan(plan, ROLLOUT_POOL, rollout_ranks, order[ROLLOUT_POOL],
                                          transfers, []), sends=transfers),
        TRAIN_POOL: PoolPlan(TRAIN_POOL, train_ranks,
                             _pool_plan(plan, TRAIN_POOL, train_ranks, order[TRAIN_POOL],
                                        [], transfers), recvs=transfers),
    }
    return pools, transfers


def partitioned(plan: ExecutionPlan, cfg: PlacementConfig, world_size: int,
                role_parallelism: Optional[dict[str, int]] = None) -> PlacementPlan:
    """Cut ``plan`` into a rollout pool and a train pool.

    Raises:
        PlacementError: fewer than 2 ranks, pools that overlap, leave a rank out or name ranks
            beyond the world, not exactly two pools, a role in no pool, actor and rollout in the
            same pool, or a rollout-pool stage that reads a train-pool output (the cut must be
            one-way: only weights flow back); a pool whose size is not a multiple of its roles'
            tensor-parallel size (``role_parallelism``), or pool sizes neither dividing the other.
    """
    if world_size < 2:
        raise PlacementError(f"placement.mode=partitioned needs >= 2 ranks (launcher.nproc), "
                             f"got {world_size}: run it with launcher.nproc=2 (one rank per pool) "
                             "or more, or use placement=colocated on one")
    if set(cfg.pools) - {TRAIN_POOL, ROLLOUT_POOL}:
        raise PlacementError(f"placement.pools must name exactly the pools '{TRAIN_POOL}' and "
                             f"'{ROLLOUT_POOL}', got {sorted(cfg.pools)}")
    # a pool not given (or given as []) takes its ranks of the default split
    given = {k: list(v) for k, v in cfg.pools.items() if v}
    pools = {**default_pools(world_size), **given}
    notes = [f"placement.pools not set: default split {pools}"] if not given else [
        f"placement.pools.{k} not set: {pools[k]} of the default split"
        for k in sorted(set(pools) - set(given))]
    seen: dict[int, str] = {}
    for name, ranks in pools.items():
        for r in ranks:
            if r >= world_size:
                raise PlacementError(f"placement.pools.{name}: rank {r} >= world size {world_size}")
            if r in seen:
                raise PlacementError(f"placement.pools: rank {r} is in both '{seen[r]}' and "
                                     f"'{name}' (partitioned pools must not overlap)")
            seen[r] = name
    if missing := sorted(set(range(world_size)) - set(seen)):
        split = {k: str(v).replace(" ", "") for k, v in default_pools(world_size).items()}
        raise PlacementError(
            f"placement.pools: ranks {missing} are in no pool; give each of the {world_size} "
            f"ranks a pool, e.g. placement.pools.train={split[TRAIN_POOL]} "
            f"placement.pools.rollout={split[ROLLOUT_POOL]}")
    role_pool = {**DEFAULT_ROLE_POOL, **cfg.roles}
    for role in plan.roles:
        if role_pool[role] not in pools:
            raise PlacementError(f"placement.roles.{role}: pool '{role_pool[role]}' does not exist "
                                 f"(pools: {sorted(pools)})")
    if role_pool["actor"] == role_pool["rollout"]:
        raise PlacementError("placement.roles: actor and rollout share a pool; use "
                             "placement=colocated for that")
    if role_pool["actor"] != TRAIN_POOL:
        raise PlacementError(f"placement.roles.actor must be '{TRAIN_POOL}', got {role_pool['actor']!r}")
    check_parallelism({k: len(v) for k, v in pools.items()}, role_pool, plan.roles,
                      role_parallelism or {})
    check_pool_sizes(len(pools[ROLLOUT_POOL]), len(pools[TRAIN_POOL]))
    pp, transfers = split_plan(plan, role_pool, pools[ROLLOUT_POOL], pools[TRAIN_POOL])
    return PlacementPlan(Mode.PARTITIONED, world_size, pp, full=plan, transfers=transfers,
                         staleness=staleness_of(plan, cfg), weight_sync=_sync_roles(plan.graph),
                         notes=notes)


__all__ = ["Action", "AutoConfig", "DEFAULT_ROLE_POOL", "MODES", "Mode", "PlacementConfig",
           "PlacementError", "PlacementPlan", "PoolPlan", "assign_stages", "colocated",
           "default_pools", "parse_mode", "partitioned", "split_candidates", "split_plan",
           "staleness_of", "check_parallelism", "check_pool_sizes"]
