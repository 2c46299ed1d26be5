"""Refill loop of a ``refill`` stage (DAPO dynamic sampling): re-run the upstream sub-graph until
the stage has kept enough groups.

Protocol (checked by the compiler, ``flowrl.compiler.plan.refill_specs``): the stage's op config
has ``refill`` (True), ``max_attempts`` and ``target_groups`` (0 = the number of groups of the
first attempt); its op outputs ``group_id`` and returns, for each attempt, the rows it keeps.
Every output of the upstream stages is consumed only by upstream stages or by the refill stage,
so an attempt leaves nothing behind in the store.

One attempt = run the upstream stages (fresh seeds; the stateful prompt source hands out new
prompts with new, unique group ids), then the op. What the attempts keep is concatenated along
the batch dimension (2-D fields padded: ``prompt_*`` on the left, the rest on the right, with 0
under a False mask: masks, never pad ids, say what is real) and cut to the first
``target_groups`` groups. Metrics: the refill stage's own (counts) are summed over attempts, the
upstream stages' averaged (``time/*`` summed); ``refill/attempts``, ``refill/groups``,
``refill/surplus_groups`` are added.
"""
from __future__ import annotations

import time
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from flowrl.compiler.plan import ExecutionPlan, RefillSpec
from flowrl.errors import RunStopped
from flowrl.runtime.step.store import TensorStore


class StageRunner(Protocol):
    """What the refill loop needs of the executor that runs it (``runtime/step/executor.Executor``
    implements it): the plan, the store, this step's stage metrics, the resident roles, and
    running one stage (:meth:`run_stage`: into the store) or only its op (:meth:`call_op`)."""

    plan: ExecutionPlan
    store: TensorStore
    stage_metrics: dict[str, dict[str, float]]

    @property
    def resident(self) -> set[str]: ...

    def ensure_resident(self, role: str) -> None: ...

    def run_stage(self, name: str, step: int, attempt: int = 1) -> dict[str, float]: ...

    def call_op(self, name: str, step: int, attempt: int = 1
                ) -> tuple[dict[str, Any], dict[str, float]]: ...


def _pad_cat(name: str, values: list[Tensor]) -> Tensor:
    if values[0].dim() < 2:
        return torch.cat(values)
    width = max(v.shape[1] for v in values)
    padded = []
    for v in values:
        extra = width - v.shape[1]
        pad = (extra, 0) if name.startswith("prompt_") else (0, extra)
        padded.append(torch.nn.functional.pad(v, pad, value=0) if extra else v)
    return torch.cat(padded)


def concat_batches(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate per-attempt outputs row-wise (tensors, lists; None stays None)."""
    out: dict[str, Any] = {}
    for name in parts[0]:
        vals = [p[name] for p in parts]
        if vals[0] is None:
            out[name] = None
        elif isinstance(vals[0], Tensor):
            out[name] = _pad_cat(name, vals)
        else:
            out[name] = [x for v in vals for x in v]
    return out


def first_groups(batch: dict[str, Any], k: int) -> tuple[dict[str, Any], int]:
    """Rows of the first ``k`` groups (by first appearance of their ``group_id``); returns the
    cut batch and how many groups the input held."""
    gid = batch["group_id"]
    order: list[int] = []
    for g in gid.tolist():
        if g not in order:
            order.append(g)
    keep = torch.isin(gid, torch.tensor(order[:k], dtype=gid.dtype))
    idx = keep.nonzero().squeeze(1)
    cut = {n: None if v is None else (v[keep] if isinstance(v, Tensor) else [v[i] for i in idx.tolist()])
           for n, v in batch.items()}
    return cut, len(order)


def _average(rows: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in {k for r in rows for k in r}:
        vals = [r[key] for r in rows if key in r]
        out[key] = sum(vals) if key.startswith("time/") else sum(vals) / len(vals)
    return out


def run_refill(ex: StageRunner, spec: RefillSpec, step: int) -> dict[str, float]:
    """Run refill stage ``spec.stage`` (its upstream already ran once); returns the metrics that
    replace the upstream stages' and the stage's own.

    Raises:
        RunStopped (a RuntimeError): fewer than the target groups after ``max_attempts``
            attempts, naming the stage, the counts and the knobs to turn (one line, no
            traceback, from ``flowrl train``).
    """
    name = spec.stage
    resident_at_stage = ex.resident
    upstream_rows = [dict(ex.stage_metrics.get(s, {})) for s in spec.upstream]
    upstream_runs: list[dict[str, float]] = [{k: v for r in upstream_rows for k, v in r.items()}]
    own: dict[str, float] = {}
    parts: list[dict[str, Any]] = []
    target: Optional[int] = spec.target_groups or None
    sampled = 0
    for attempt in range(1, spec.max_attempts + 1):
        if attempt > 1:
            m: dict[str, float] = {}
            for s in spec.upstream:
                role = ex.plan.graph[s].role
                if role:
                    ex.ensure_resident(role)
                t0 = time.perf_counter()
                m.update(ex.run_stage(s, step, attempt=attempt))
                m[f"time/{s}"] = time.perf_counter() - t0
            upstream_runs.append(m)
            for role in resident_at_stage:
                ex.ensure_resident(role)
        if target is None:
            target = len(torch.unique(ex.store.get(_group_ref(ex, name))))
        sampled += len(torch.unique(ex.store.get(_group_ref(ex, name))))
        outputs, m = ex.call_op(name, step, attempt=attempt)
        ex.store.release_after(name)
        for k, v in m.items():
            own[k] = own.get(k, 0.0) + v
        parts.append(outputs)
        batch, have = first_groups(concat_batches(parts), target)
        if have >= target:
            break
    else:
        if have == 0:  # no knob of the filter helps a policy whose every sample scores alike
            raise RunStopped(
                f"stage '{name}': dynamic sampling kept 0 of the {target} groups it needs after "
                f"{spec.max_attempts} attempts: not one of the {sampled} groups sampled had two "
                "different rewards, so the reward is constant for this policy (an untrained or "
                "random model that never scores does this); start from a model that solves some "
                "prompts, or use a graph without dynamic sampling")
        raise RunStopped(
            f"stage '{name}': dynamic sampling kept {have} of the {target} groups it needs after "
            f"{spec.max_attempts} attempts ({sampled} groups sampled, the rest had no reward "
            f"variance): raise params.max_attempts of stage '{name}' in the graph file (or lower "
            f"its params.target_groups), or raise algorithm.n for more varied groups")
    ex.store.put(name, batch)
    ex.store.release_after(name)  # outputs nobody consumes
    return {**_average(upstream_runs), **own, "refill/attempts": attempt,
            "refill/groups": target, "refill/surplus_groups": have - target}


def _group_ref(ex: StageRunner, name: str) -> str:
    return ex.plan.graph[name].inputs["group_id"]
