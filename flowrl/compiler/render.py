"""Rendering of plans (what ``flowrl plan`` prints): an ExecutionPlan as text, a PlacementPlan as
text, Mermaid or Graphviz DOT (written directly: it is output formatting, no extra dependency)."""
from __future__ import annotations

from flowrl.compiler.footprint import fmt_bytes as _fmt_bytes
from flowrl.compiler.placement import PlacementPlan
from flowrl.compiler.plan import ExecutionPlan


def format_plan(plan: ExecutionPlan, ranks: list[int] | None = None,
                chosen: str | None = None) -> str:
    """One ExecutionPlan as text: the roles, the timeline of one step (runs, swaps, frees, the
    weight sync) and the lifecycle of intermediates. ``ranks``: the global ranks that run it
    (the header's ``ranks=``; None: left out, a plan not placed yet); ``chosen``: the mode
    ``placement=auto`` chose, said beside it."""
    g = plan.graph
    where = "" if ranks is None else f"  ranks={_ranks(ranks)}"
    mode = f"{plan.placement} ({chosen} chosen)" if chosen and chosen != plan.placement \
        else plan.placement
    lines = [f"ExecutionPlan  graph={g.name}  placement={mode}{where}",
             f"roles with a model: {', '.join(plan.roles) or '-'}"]
    lines += [f"  {role} served by {how}" for role, how in plan.served_by.items()]
    if plan.pruned:
        lines.append(f"pruned (when=false): {', '.join(plan.pruned)}")
    lines.append("")
    lines.append("Timeline of one step (colocated: one model role resident at a time):")
    # column widths from the content, so a long stage, op or role name keeps the columns aligned
    runs = [a for a in plan.actions if a.kind == "run"]
    ws = max([len(a.stage_name) for a in runs] + [len(a.role or "") for a in plan.actions
                                              if a.kind not in ("run", "sync")] + [14])
    wo = max([len(g[a.stage_name].op) for a in runs] + [18])
    wr = max([len(a.role or "-") for a in runs] + [8])
    i = 0
    for a in plan.actions:
        if a.kind == "run":
            i += 1
            st = g[a.stage_name]
            frees = plan.release_after.get(a.stage_name, [])
            row = f"  {i:>2}. run     {a.stage:<{ws}} op={st.op:<{wo}} role={a.role or '-':<{wr}}"
            lines.append((row + f" then free {', '.join(frees)}") if frees else row.rstrip())
            if a.stage in plan.refill:
                r = plan.refill[a.stage]
                target = r.target_groups or "one attempt's number of"
                lines.append(f"      refill  re-run {' -> '.join(r.upstream)} -> {a.stage} until "
                             f"{target} groups are kept (at most {r.max_attempts} attempts)")
        elif a.kind == "sync":
            lines.append(f"      sync    {a.detail}")
        else:
            lines.append(f"      {a.kind:<7} {a.role:<{ws}} ({a.detail})")
    if plan.resident_at_end:
        lines.append(f"  resident going into the next step: {', '.join(plan.resident_at_end)}")
    lines.append(f"  model switches per step: {plan.num_swaps}")
    lines.append("")
    lines.append("Lifecycle of intermediates (freed right after the last consumer runs):")
    none = "(none: freed at once)"
    w = max([len(k) for k in plan.lifetimes] + [12])
    wp = max([len(t.producer) for t in plan.lifetimes.values()] + [14])
    wl = max([len(t.last_consumer or none) for t in plan.lifetimes.values()] + [14])
    lines.append(f"  {'tensor':<{w}}  {'producer':<{wp}} {'last consumer':<{wl}} consumers")
    for k, t in plan.lifetimes.items():
        lines.append(f"  {k:<{w}}  {t.producer:<{wp}} {t.last_consumer or none:<{wl}} "
                     f"{', '.join(t.consumers) or '-'}")
    if plan.warnings:
        lines.append("")
        lines += [f"warning: {m}" for m in plan.warnings]
    return "\n".join(lines)


# --- placement: per-pool timelines (text, Mermaid, Graphviz DOT) -----------------------------
FORMATS = ("text", "mermaid", "dot")


def pool_timeline(pp: PlacementPlan, name: str, weights_cross: bool = False) -> list[tuple[str, str]]:
    """One pool's step as (kind, text) entries in order. kinds: wait (weights, before the rollout
    stage), recv (before the first stage reading the key), run, onload, offload, sync, send (after
    the pool's stages; the key is freed once sent), broadcast (weights after the update).
    ``weights_cross``: the weights go from the train pool to the other one (partitioned: the
    wait and broadcast entries); else a sync is a local step of the timeline."""
    pool, est = pp.pools[name], pp.estimate
    plan, g = pool.plan, pool.plan.graph
    xfer = est.transfers if est is not None else {}
    other = next((p for p in pp.pools if p != name), None)
    size = lambda k: f" ({_fmt_bytes(xfer[k])})" if k in xfer else ""  # noqa: E731
    out: list[tuple[str, str]] = []
    pending = list(pool.recvs)
    for a in plan.actions:
        if a.kind == "run":
            stage = g[a.stage_name]
            if weights_cross and any(d == stage.role for _, d in pp.weight_sync):
                src = ", ".join(s for s, d in pp.weight_sync if d == stage.role)
                out.append(("wait", f"weights {src} -> {stage.role} from pool {other}: at most "
                                    f"{pp.staleness} version(s) behind (staleness {pp.staleness})"))
            reads = {f"{src}.{o}" for _, src, o in stage.input_refs()}
            for k in [k for k in pending if k in reads]:
                out.append(("recv", f"{k} from pool {other}{size(k)}"))
                pending.remove(k)
            frees = plan.release_after.get(a.stage_name, [])
            out.append(("run", f"{a.stage} op={stage.op} role={a.role or '-'}"
                               + (f" then free {', '.join(frees)}" if frees else "")))
            if weights_cross and name == "train":
                for s, d in pp.weight_sync:
                    if s == a.role and a.stage in {w.src for w in pp.full.graph.weight_sync}:
                        out.append(("broadcast", f"weights {s} -> {d} to pool {other} "
                                                 f"(buckets; new version each update)"))
        elif a.kind == "sync":
            out.append(("sync", a.detail))
        else:
            out.append((a.kind, f"{a.role} ({a.detail})"))
    out += [("send", f"{k} to pool {other}{size(k)}, then free") for k in pool.sends]
    return out


def colocated_text(pp: PlacementPlan) -> str:
    """A colocated plan as text: its one pool's ExecutionPlan (:func:`format_plan`), then the
    cost model's predictions and the notes."""
    extra = _estimate_lines(pp) + ((["", "Notes:"] + [f"  {n}" for n in pp.notes]) if pp.notes else [])
    extra = overlap_lines(pp) + extra
    pool = pp.pools["all"]
    return format_plan(pool.plan, pool.ranks, chosen=str(pp.mode)) + "\n" + "\n".join(extra)


def overlap_lines(pp: PlacementPlan) -> list[str]:
    """What an overlapped colocated plan (``placement.staleness=1``) changes in the timeline
    :func:`format_plan` prints for it (empty for any other plan)."""
    if not pp.overlapped:
        return []
    r, t = pp.halves["rollout"].plan.order, pp.halves["train"].plan.order
    return ["", f"Overlap (placement.staleness={pp.staleness}, one-step off-policy): the rollout "
            f"half ({' -> '.join(r)}) of step s+1 runs beside the train half ({' -> '.join(t)}) of "
            "step s, with the weights of update s-1; then the weights sync and the next step "
            "starts. The timeline above is the on-policy order: nothing is offloaded (its "
            "offload/onload actions are skipped) and each batch after the first is one weight "
            "version behind (staleness 1, not the graph's 0)."]


def partitioned_text(pp: PlacementPlan) -> str:
    """A partitioned plan as text: one timeline per pool, the transfers, the weight broadcast,
    the predictions (with the rollout/train sides) and the notes."""
    g, est = pp.full.graph, pp.estimate
    lines = [f"PlacementPlan  graph={g.name}  mode={pp.mode}  world={pp.world_size}"
             f"  staleness={pp.staleness}"]
    for name, pool in pp.pools.items():
        lines.append("")
        lines.append(f"Pool {name}  ranks {_ranks(pool.ranks)}  roles: {', '.join(pool.roles) or '-'}")
        lines += [f"  {role} served by {how}" for role, how in pp.full.served_by.items()
                  if role in pool.roles]
        for i, (kind, text) in enumerate(pool_timeline(pp, name, weights_cross=True), 1):
            lines.append(f"  {i:>2}. {kind:<9} {text}")
    if pp.transfers:
        r, t = len(pp.pools["rollout"].ranks), len(pp.pools["train"].ranks)
        route = transfer_route(r, t)
        lines += ["", f"Transfers rollout -> train per step ({route}):"]
        total, wk = 0, max([len(k) for k in pp.transfers] + [28])
        for k in pp.transfers:
            b = est.transfers.get(k) if est is not None else None
            total += b or 0
            lines.append(f"  {k:<{wk}} {_fmt_bytes(b) if b is not None else '?'}")
        if est is not None:
            lines.append(f"  {'total':<{wk}} {_fmt_bytes(total)}")
    if pp.weight_sync:
        wb = f", {_fmt_bytes(est.sync_bytes)} per update" if est is not None else ""
        lines.append("")
        lines.append("Weight sync: " + ", ".join(f"{s} -> {d}" for s, d in pp.weight_sync)
                     + f" broadcast train -> rollout after each update{wb}")
    lines += _estimate_lines(pp, sides=True)
    if pp.notes:
        lines += ["", "Notes:"] + [f"  {n}" for n in pp.notes]
    return "\n".join(lines)


def transfer_route(r: int, t: int) -> str:
    """Which rollout pool rank's batch goes to which train pool rank (pool ranks, not global
    ones; ``runtime/control/partitioned.pool_peers``), for ``r`` rollout and ``t`` train ranks:
    more rollout ranks, a train rank joins its peers' batches; more train ranks, a rollout rank
    splits its rows between its peers (the text said "train ranks j with j mod 1 = i")."""
    if r == t:
        return "rollout rank 0 -> train rank 0" if r == 1 else "rollout rank i -> train rank i"
    if t == 1:
        return f"every rollout rank -> train rank 0, the {r} batches joined"
    if r > t:
        return f"rollout rank i -> train rank i mod {t}, its peers' batches joined"
    if r == 1:
        return f"rollout rank 0 -> train ranks 0-{t - 1}, its rows split between them"
    return f"rollout rank i -> train ranks j with j mod {r} = i, its rows split between them"


def _estimate_lines(pp: PlacementPlan, sides: bool = False) -> list[str]:
    """The predictions' lines; ``sides``: how the pools' seconds add up (partitioned)."""
    est = pp.estimate
    if est is None:
        return []
    out = ["", f"Predicted (cost model, device profile {est.device}): step {est.step_s:.3g} s"]
    if pp.overlapped:  # the two halves at once on the same devices: a lower bound
        out.append(f"  = max(rollout={est.sides['rollout']:.3g}s train={est.sides['train']:.3g}s), "
                   "the halves side by side (they share the devices: a lower bound)")
    if sides:
        terms = " ".join(f"{k}={v:.3g}s" for k, v in est.sides.items())
        how = "sum" if pp.staleness == 0 else "max"
        out.append(f"  = {how}({terms}) + weight sync {est.sync_s:.3g}s + transfers {est.transfer_s:.3g}s")
    out.append("Predicted peak memory per device: " + "; ".join(
        f"pool {k} {_fmt_bytes(b)}" + (f" (set by the {who} role)" if who else "")
        for k, (b, who) in est.memory.items()))
    # every model role with its pool and size (a teacher or reference holds weights of its own):
    # the peak above assumes the roles swap; with all of them resident the pool needs the sum
    for k, roles in est.role_memory.items():
        if roles:
            each = ", ".join(f"{r} {_fmt_bytes(b)}" for r, b in roles.items())
            out.append(f"  pool {k} by role: {each}; every model resident (no swaps) "
                       f"{_fmt_bytes(sum(roles.values()))}")
    # what footprint.role_memory counts, said where the number is read: a run's measured peak
    # exceeds it by these terms (the tiny model on CPU: 97.1 MiB predicted, 642 MiB host RSS,
    # 361 MiB of it the imported runtime; issue 27: SmolLM2 graph=grpo_tools on a GPU, 2.0 GiB
    # predicted, 7.9 GiB peak)
    # a cluster plan's peaks hold a micro-batch's activations too (its breakdown below): the
    # note said they were left out of the number they made (fresh-user report)
    out.append(f"  {MEMORY_WITH_ACTIVATIONS if est.with_activations else MEMORY_LEAVES_OUT}")
    return out


MEMORY_WITH_ACTIVATIONS = (
    "(counts weights, gradients, AdamW moments, the KV cache and the activations and logits of "
    "one micro-batch (the breakdown below); leaves out the runtime (CUDA context) and allocator "
    "fragmentation)")
MEMORY_LEAVES_OUT = (
    "(counts weights, gradients, AdamW moments and the KV cache; leaves out the activations and "
    "logits of a micro-batch (they grow with trainer.engine.max_tokens_per_micro_batch x the "
    "vocabulary), the runtime (CUDA context; on CPU ~0.35 GiB of Python/torch host RSS) and "
    "allocator fragmentation)")


def _ranks(ranks: list[int]) -> str:
    """A pool's ranks as printed: the list, or ``[a..b]`` for more than 8 contiguous ranks (a
    planned 64-GPU cluster)."""
    if len(ranks) > 8 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}..{ranks[-1]}]"
    return str(list(ranks))


def _ident(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s)


def _edges(pp: PlacementPlan, weights_cross: bool
           ) -> tuple[dict[str, list[tuple[str, str, str]]], list[tuple[str, str, str, bool]]]:
    """Nodes per pool (id, kind, label) and edges (src, dst, label, dashed): each pool's timeline
    is a chain; sends feed the other pool's recvs; the broadcast feeds the weight wait."""
    nodes, edges = {}, []
    for name in pp.pools:
        tl = pool_timeline(pp, name, weights_cross)
        nodes[name] = [(f"{_ident(name)}_{i}", k, t) for i, (k, t) in enumerate(tl)]
        edges += [(a[0], b[0], "", False) for a, b in zip(nodes[name], nodes[name][1:])]
    by_kind = lambda pool, kind: [n for n in nodes.get(pool, []) if n[1] == kind]  # noqa: E731
    sizes = pp.estimate.transfers if pp.estimate is not None else {}
    for s in by_kind("rollout", "send"):
        key = s[2].split(" ")[0]
        label = key + (f" {_fmt_bytes(sizes[key])}" if key in sizes else "")
        for r in by_kind("train", "recv"):
            if r[2].split(" ")[0] == key:
                edges.append((s[0], r[0], label, False))
    for b in by_kind("train", "broadcast"):
        for w in by_kind("rollout", "wait"):
            edges.append((b[0], w[0], f"weights (staleness {pp.staleness})", True))
    return nodes, edges


def mermaid(pp: PlacementPlan, weights_cross: bool = False) -> str:
    """The pools as Mermaid subgraphs, each timeline a chain (``weights_cross``: see
    :func:`pool_timeline`); the cost model's prediction as a note."""
    q = lambda s: s.replace('"', "'")  # noqa: E731
    nodes, edges = _edges(pp, weights_cross)
    lines = ["flowchart TB"]
    for name, ns in nodes.items():
        pool = pp.pools[name]
        lines.append(f'  subgraph {_ident(name)}["pool {name} ranks {_ranks(pool.ranks)}"]')
        lines += [f'    {i}["{q(k)}: {q(t)}"]' for i, k, t in ns]
        lines.append("  end")
    for a, b, label, dashed in edges:
        arrow = "-.->" if dashed else "-->"
        lines.append(f"  {a} {arrow}" + (f'|"{q(label)}"| ' if label else " ") + b)
    est = pp.estimate
    if est is not None:  # the cost model's prediction as a note beside the pools
        pools = "; ".join(f"pool {k} {est.sides.get(k, 0.0):.3g} s, peak {_fmt_bytes(b)}/device"
                          for k, (b, _) in est.memory.items())
        lines.append(f'  predicted["predicted ({q(est.device)}): step {est.step_s:.3g} s; {q(pools)}"]')
    return "\n".join(lines)


def dot(pp: PlacementPlan, weights_cross: bool = False) -> str:
    """The pools as Graphviz DOT clusters, each timeline a chain (``weights_cross``: see
    :func:`pool_timeline`)."""
    q = lambda s: s.replace("\\", "\\\\").replace('"', '\\"')  # noqa: E731
    nodes, edges = _edges(pp, weights_cross)
    lines = [f'digraph "{q(pp.full.graph.name)}" {{', "  rankdir=TB;", "  node [shape=box];"]
    for name, ns in nodes.items():
        lines.append(f"  subgraph cluster_{_ident(name)} {{")
        lines.append(f'    label="pool {name} ranks {_ranks(pp.pools[name].ranks)}";')
        lines += [f'    {i} [label="{q(k)}: {q(t)}"];' for i, k, t in ns]
        lines.append("  }")
    for a, b, label, dashed in edges:
        attrs = ([f'label="{q(label)}"'] if label else []) + (["style=dashed"] if dashed else [])
        lines.append(f"  {a} -> {b}" + (f" [{', '.join(attrs)}]" if attrs else "") + ";")
    lines.append("}")
    return "\n".join(lines)
