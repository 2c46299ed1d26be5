"""The per-rank controller: runs one ExecutionPlan step after step (SPMD: every rank runs this
same loop on its own shard; world size 1 today).

Dataflow of one GRPO step (colocated pool; ``[x]`` = role resident, ``→ free`` = lifecycle release)::

    sample ──prompt_ids/mask, group_id, ground_truth──────────────────────────────────┐
      │                                                                               │
      ▼  [rollout]                                                                    │
    rollout ──response_ids/mask, rollout_logprobs──► reward ──rewards──► advantage ───┤
      │                                                                   (→ free     │
      │  offload rollout / onload ref                                      rewards)   │
      ▼  [ref]                                                                        │
    ref_logprobs ──ref_logprobs────────────────────────────────────────────────────────┤
      │  offload ref / onload actor                                                   │
      ▼  [actor]                                                                      ▼
    old_logprobs ──old_logprobs──────────────────────────────────────────────────► update
                                                                 (→ free everything) │
                                        sync weights actor → rollout (staleness 0) ◄──┘

Each stage reads its inputs from the TensorStore, writes its outputs back, and the store frees every
key whose last consumer (from the plan's lifecycle table) has just run. Devices (one rule,
``runtime/step/devices.py``): the store keeps the step on the pool's home device (the trainer's GPU
on a GPU run); the executor hands each op its inputs on the device of the stage's engine (the host for
role-less stages).
A ``refill`` stage (DAPO dynamic sampling) re-runs the stages it depends on until it has kept
enough groups (``flowrl/runtime/step/refill.py``; the plan lists them under ``plan.refill``).
"""
from __future__ import annotations

import logging
import time
import zlib
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from torch.profiler import record_function

from flowrl.compiler.plan import ExecutionPlan
from flowrl.graph.roles import ROLES
from flowrl.ops.context import DistInfo, StageContext
from flowrl.ops.registry import OPS
from flowrl.ops.state import OpState, init_op_states
from flowrl.runtime.step.devices import home_device, stage_device, to_device
from flowrl.runtime.step.refill import run_refill
from flowrl.runtime.step.resources import SWAPS, Swap
from flowrl.runtime.step.store import TensorStore

if TYPE_CHECKING:
    from flowrl.engines.base import Engine
    from flowrl.runtime.step.resources import Engines

log = logging.getLogger(__name__)


SEND = "_send"  # store release point of a partitioned pool's outgoing keys


# seconds of the rollout engine's swap/sync actions per step (colocated vLLM: sleep, wake_up and
# the in-place weight load that follows each update)
ROLLOUT_TIMERS = {"offload": "perf/rollout_sleep_s", "onload": "perf/rollout_wake_s",
                  "sync": "perf/weight_load_s"}


def _rss_gib() -> float:
    """This process's resident host memory now (GiB); engine child processes not included."""
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def _peak_rss_gib() -> float:
    """This process's peak resident host memory since it started (GiB; Linux ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def stage_seed(seed: int, step: int, stage: str) -> int:
    """Deterministic per-(run, step, stage) seed, so a resumed run draws the same numbers."""
    return (seed * 1_000_003 + step * 7919 + zlib.crc32(stage.encode())) % (2**63 - 1)


class Executor:
    """Runs an ExecutionPlan.

    Args:
        plan: the compiled plan.
        engines: the rank's engine of every role the plan uses, each typed by its role's
            Protocol (``engines/base.py``).
        resources: shared objects handed to ops (tokenizer, prompts, algorithm, sampling, trainer).
        seed: run seed; each stage run gets ``torch.Generator`` seeded by :func:`stage_seed`.
        sends: partitioned placement: keys (``"stage.output"``) this pool hands to the other pool
            at the end of each step (``PoolPlan.sends``); freed from the store once sent.
        device: the store's home device; default :func:`~flowrl.runtime.step.devices.home_device`
            of ``engines`` (the trainer's device).
        swap: which of the plan's offload/onload actions run (``trainer.offload``): ``"all"``
            moves every idle model to host memory; ``"generate"`` only the generation engines
            (roles of kind ``generate``: vLLM sleeps at its ``sleep_level`` while the training
            state stays resident); ``"none"`` skips them (every model stays resident, no cost).

    The cross-step state of every op of the plan that declares one (``ops/state.py``) is created
    in ``resources`` at construction; :meth:`op_state_dict` / :meth:`load_op_state_dict` are what
    the job checkpoints and restores.

    Raises:
        KeyError: at construction, when a role of the plan has no engine.
    """

    def __init__(self, plan: ExecutionPlan, engines: "Engines",
                 resources: Mapping[str, Any], *, seed: int = 0, dist: DistInfo | None = None,
                 sends: list[str] | tuple[str, ...] = (), device: torch.device | None = None,
                 swap: Swap = "all", verify_sync: bool = False, verify_sync_every: int = 1):
        missing = [r for r in plan.roles if r not in engines]
        if missing:
            raise KeyError(f"plan needs engines for roles {missing}; have {sorted(engines.by_role())}")
        self.plan = plan
        self.engines = engines
        self.resources = dict(resources)
        self.op_states: dict[str, OpState] = init_op_states(
            sorted({c.stage.op for c in plan.stages}), self.resources)
        self.seed = seed
        self.dist = dist or DistInfo()
        self.sends = list(sends)
        # the pseudo-stage SEND releases what was handed to the other pool
        self.device = device or home_device(self.engines.by_role())
        if swap not in SWAPS:
            raise ValueError(f"swap must be one of {SWAPS}, got {swap!r}")
        self.swap: Swap = swap
        self.verify_sync = verify_sync  # rollout.verify_sync: runtime/step/weight_check.py
        # rollout.verify_sync_every: the readback costs a round trip per engine (0.46 s a sync for
        # the 0.5B shape over 4 engine processes on the H200, e2e_vs_trl_h200.md), so after the
        # first sync of the process only every n-th is checked
        self.verify_sync_every = max(1, verify_sync_every)
        self.syncs_done = 0  # weight syncs of this process (the first one is always checked)
        self.store = TensorStore({**plan.release_after, SEND: self.sends}, device=self.device)
        self._cfg = {c.stage.name: c.config for c in plan.stages}
        self._resident: set[str] = set(plan.resident_at_end)
        self.stage_metrics: dict[str, dict[str, float]] = {}  # this step's, per stage

    # ---- op state across steps ----------------------------------------------------------------
    def op_state_dict(self) -> dict[str, dict[str, Any]]:
        """key → state dict of every stateful op of this plan (JSON-able)."""
        return {k: st.state_dict() for k, st in sorted(self.op_states.items())}

    def load_op_state_dict(self, states: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """Restore :meth:`op_state_dict` (a checkpoint's). Keys this plan has no state for are
        left alone (another pool's ops); returns this plan's keys the checkpoint lacked (they
        keep their initial state)."""
        for key, st in self.op_states.items():
            if key in states:
                st.load_state_dict(states[key])
        return sorted(set(self.op_states) - set(states))

    # ---- swap / sync points -----------------------------------------------------------------
    def _swaps(self, role: str) -> bool:
        """Whether ``role``'s engine really moves at a swap point (``trainer.offload``)."""
        return self.swap == "all" or (self.swap == "generate" and ROLES[role].kind == "generate")

    def _offload(self, role: str, keep_weights: bool = False) -> None:
        if not self._swaps(role):  # it stays resident (trainer.offload)
            return
        eng = self._engine(role)
        # the plan keeps the weights when the next role serves them; that saves a copy only if
        # the serving engine really reads this module (HF rollout with shared=True), not when it
        # holds its own copy (vLLM, FSDP): then the weights leave the device too
        keep_weights = keep_weights and any(
            self.engines.weight_sink(r).shared for r in self.engines.by_role()
            if ROLES[r].weights_from == role)
        eng.offload(keep_weights=keep_weights)
        self._resident.discard(role)

    def _onload(self, role: str) -> None:
        if not self._swaps(role):
            self._resident.add(role)
            return
        self._engine(role).onload()
        self._resident.add(role)

    def _engine(self, role: str) -> "Engine":
        eng = self.engines.get(role)
        if eng is None:  # a plan bug: the constructor checked every role of the plan
            raise KeyError(f"plan action for role {role!r}, which this rank has no engine for")
        return eng

    @property
    def resident(self) -> set[str]:
        """The roles whose engines are on the device now (a copy)."""
        return set(self._resident)

    def ensure_resident(self, role: str) -> None:
        """Make ``role`` the resident model (offloading the others), as the plan's swap points
        would; used when a refill stage re-runs its upstream stages. A role that never moves
        (``swap``) stays resident beside it."""
        for r in list(self._resident - {role}):
            self._offload(r, keep_weights=ROLES[role].weights_from == r)
        if role not in self._resident:
            self._onload(role)

    def verify_now(self) -> bool:
        """Whether this weight sync is checked (``rollout.verify_sync``): the first of the process
        (a fresh start or a resume), then every ``verify_sync_every``-th; counts the sync."""
        n, self.syncs_done = self.syncs_done, self.syncs_done + 1
        return self.verify_sync and n % self.verify_sync_every == 0

    def sync_weights(self, src_role: str, dst_role: str, step: int = 0) -> dict[str, float]:
        """Load ``src_role``'s weights into ``dst_role``'s engine; returns its metrics: the bytes
        gathered (``perf/weight_sync_bytes``; an FSDP or LoRA source records them, else 0) and
        the parts of the load its engines timed (``perf/weight_sync/<part>``: e.g. the source's
        ``gather_s``, vLLM engine processes' ``engine_load_weights_s`` and ``ipc_collect_s``).
        ``verify_sync`` (on the syncs :meth:`verify_now` picks): the engine's weights are read back and checked
        (``runtime/step/weight_check.py``; ``perf/weight_sync/verify_s``, and
        ``perf/weight_sync_checked``: the tensors compared); then what was sent is checked
        against the trainer's effective weights (a LoRA merge that sent the base weights:
        ``check_effective``; ``perf/weight_sync_effective_checked``).

        Raises:
            WeightSyncError: the engine does not serve what it was sent, naming the tensors."""
        src = self.engines.weight_source(src_role)
        sink = self.engines.weight_sink(dst_role)
        verify = self.verify_now()
        if not verify:
            sink.load_weights(src.named_weights())
        else:
            from flowrl.runtime.step.weight_check import SyncProbe, check_effective, check_sync

            probe = SyncProbe(src.named_weights())
            sink.load_weights(probe)
        # the sink's last call is this load; the source's other timings are of earlier calls
        parts = {k: v for k, v in sink.last_timings.items() if k.endswith("_s")}
        checked: dict[str, float] = {"tensors_checked": 0.0, "effective_checked": 0.0}
        if verify:
            t0 = time.perf_counter()
            what = f"{src_role} -> {dst_role} ({type(sink).__name__}) after step {step}"
            checked = check_sync(sink, probe, what, shared=sink.shared)
            checked.update(check_effective(src.model, probe, what))
            parts["verify_s"] = time.perf_counter() - t0
        if "gather_s" in src.last_timings:
            parts["gather_s"] = src.last_timings["gather_s"]
        out = {"perf/weight_sync_bytes": float(src.last_timings.get("gather_bytes", 0.0)),
               **{f"perf/weight_sync/{k}": float(v) for k, v in parts.items()}}
        if self.verify_sync:  # tensors whose values were read back and matched (0: not checked)
            out["perf/weight_sync_checked"] = checked["tensors_checked"]
            # of those sent, the LoRA-adapted tensors compared with the trainer's forward
            out["perf/weight_sync_effective_checked"] = checked["effective_checked"]
        return out

    # ---- one step ------------------------------------------------------------------------------
    def run_step(self, step: int, received: Mapping[str, Any] | None = None,
                 send: Callable[[dict[str, Any]], None] | None = None) -> dict[str, float]:
        """Run every action of the plan once; return the step's metrics.

        Partitioned pools: ``received`` (``"stage.output"`` → value, from the other pool) enters
        the store before the first stage; after the last one, ``send`` is called with the keys of
        ``sends`` and they leave the store (lifecycle: freed on the sender once sent).
        """
        metrics: dict[str, float] = {}
        swap_s = sync_s = 0.0
        moved = {"offload": 0.0, "onload": 0.0}  # seconds per direction (colocated swaps)
        t_step = time.perf_counter()
        self.store.clear()
        self.stage_metrics.clear()
        for key, value in (received or {}).items():
            stage, out = key.split(".", 1)
            self.store.put(stage, {out: value})
        for a in self.plan.actions:
            if a.role is not None and a.role not in self.engines and a.kind != "run":
                continue  # a role of the other pool: its weights arrive by broadcast
            t0 = time.perf_counter()
            # a named range for trainer.profile (runtime/io/profiling.py); ~1 µs when off
            label = a.stage_name if a.kind == "run" else a.role_name
            with record_function(f"flowrl/{a.kind}/{label}"):
                if a.kind == "offload":
                    self._offload(a.role_name, a.keep_weights)
                    swap_s += time.perf_counter() - t0
                    moved["offload"] += time.perf_counter() - t0
                elif a.kind == "onload":
                    self._onload(a.role_name)
                    swap_s += time.perf_counter() - t0
                    moved["onload"] += time.perf_counter() - t0
                elif a.kind == "sync":
                    src = self.plan.graph[a.stage_name]
                    if src.role is None:  # graph validation refuses a sync from a role-less stage
                        raise ValueError(f"weight sync from role-less stage {src.name!r}")
                    metrics.update(self.sync_weights(src.role, a.role_name, step))
                    sync_s += time.perf_counter() - t0
                elif (stage := a.stage_name) in self.plan.refill:
                    metrics.update(run_refill(self, self.plan.refill[stage], step))
                    metrics[f"time/{stage}"] = time.perf_counter() - t0  # its re-runs included
                else:
                    metrics.update(self.run_stage(stage, step))
                    metrics[f"time/{stage}"] = time.perf_counter() - t0
            if a.role == "rollout" and a.kind in ROLLOUT_TIMERS:  # sleep / wake / weight load
                key = ROLLOUT_TIMERS[a.kind]
                metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - t0
        if self.sends:
            if send is None:
                raise RuntimeError(f"step {step}: the plan sends {self.sends} but no send was given")
            send({k: self.store.get(k) for k in self.sends})
            self.store.release_after(SEND)
        leftover = list(self.store.keys())
        if leftover:  # a plan bug, not a user error: the lifecycle table missed these
            log.warning("step %d: store still holds %s at step end", step, leftover)
        st = self.store.stats
        if self.device.type == "cuda":  # what the step asked of the device at most
            metrics["perf/peak_device_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            # the caching allocator's cudaMalloc calls and out-of-memory retries (it frees its
            # whole cache, synchronising, and tries again) so far: a step that jumps here paid
            # for device allocations, e.g. beside other processes on a shared GPU
            mem = torch.cuda.memory_stats(self.device)
            metrics["perf/cuda_mallocs"] = float(mem.get("num_device_alloc", 0))
            metrics["perf/cuda_alloc_retries"] = float(mem.get("num_alloc_retries", 0))
        metrics["perf/host_rss_gib"] = _rss_gib()
        metrics["perf/host_peak_rss_gib"] = _peak_rss_gib()
        metrics.update({
            "perf/step_s": time.perf_counter() - t_step, "perf/swap_s": swap_s,
            "perf/sync_s": sync_s, "perf/offload_s": moved["offload"],
            "perf/onload_s": moved["onload"], "store/peak_bytes": st.peak_bytes,
            "store/keep_all_bytes": st.produced_bytes,
            "store/peak_device_bytes": st.peak_device_bytes,
            "store/keep_all_device_bytes": st.produced_device_bytes,
            **{f"store/freed_bytes/{k}": v for k, v in st.freed_by_stage.items()},
        })
        return metrics

    def run_stage(self, name: str, step: int, attempt: int = 1) -> dict[str, float]:
        """Run stage ``name`` (:meth:`call_op`), put its outputs in the store and release what
        it was the last consumer of; returns the op's metrics."""
        t0 = time.perf_counter()
        outputs, metrics = self.call_op(name, step, attempt)
        self.store.put(name, outputs)
        self.store.release_after(name)
        self.stage_metrics[name] = {**metrics, f"time/{name}": time.perf_counter() - t0}
        return metrics

    def stage_inputs(self, name: str) -> dict[str, Any]:
        """The op arguments of stage ``name`` from the store, on the stage's compute device (its
        engine's ``device``; the host for a role-less stage): the device rule's second half
        (``runtime/step/devices.py``). Optional inputs the graph leaves unbound are None."""
        stage = self.plan.graph[name]
        device = stage_device(self.engines.get(stage.role))
        inputs = {arg: to_device(self.store.get(ref), device) for arg, ref in stage.inputs.items()}
        for arg in OPS[stage.op].optional_inputs:
            inputs.setdefault(arg, None)
        return inputs

    def call_op(self, name: str, step: int, attempt: int = 1
                 ) -> tuple[dict[str, Any], dict[str, float]]:
        """Run one stage's op on its inputs from the store; returns (outputs, metrics). A refill
        attempt > 1 draws from its own seed, so it samples new responses."""
        stage = self.plan.graph[name]
        spec = OPS[stage.op]
        engine = self.engines.get(stage.role)
        inputs = self.stage_inputs(name)
        key = name if attempt == 1 else f"{name}@attempt{attempt}"
        gen = torch.Generator().manual_seed(stage_seed(self.seed, step, key))
        ctx = StageContext(stage=name, step=step, engine=engine,
                           resources=self.resources, dist=self.dist, generator=gen)
        outputs = dict(spec.fn(ctx, self._cfg[name], **inputs))
        if set(outputs) != set(spec.outputs):
            raise RuntimeError(f"stage '{name}': op '{spec.name}' returned {sorted(outputs)}, "
                               f"declared {sorted(spec.outputs)}")
        return outputs, ctx.metrics
