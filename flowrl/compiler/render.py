"""Text rendering of an ExecutionPlan (what ``flowrl plan`` prints)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flowrl.compiler.plan import ExecutionPlan


def format_plan(plan: "ExecutionPlan") -> str:
    g = plan.graph
    lines = [f"ExecutionPlan  graph={g.name}  placement={plan.placement}  pool=[rank 0]",
             f"roles with a model: {', '.join(plan.roles) or '-'}"]
    if plan.pruned:
        lines.append(f"pruned (when=false): {', '.join(plan.pruned)}")
    lines.append("")
    lines.append("Timeline of one step (colocated: one model role resident at a time):")
    i = 0
    for a in plan.actions:
        if a.kind == "run":
            i += 1
            st = g[a.stage]
            frees = plan.release_after.get(a.stage, [])
            lines.append(f"  {i:>2}. run     {a.stage:<14} op={st.op:<18} role={a.role or '-':<8}"
                         + (f" then free {', '.join(frees)}" if frees else ""))
            if a.stage in plan.refill:
                r = plan.refill[a.stage]
                target = r.target_groups or "one attempt's number of"
                lines.append(f"      refill  re-run {' -> '.join(r.upstream)} -> {a.stage} until "
                             f"{target} groups are kept (at most {r.max_attempts} attempts)")
        elif a.kind == "sync":
            lines.append(f"      sync    {a.detail}")
        else:
            lines.append(f"      {a.kind:<7} {a.role:<14} ({a.detail})")
    if plan.resident_at_end:
        lines.append(f"  resident going into the next step: {', '.join(plan.resident_at_end)}")
    lines.append(f"  model switches per step: {plan.num_swaps}")
    lines.append("")
    lines.append("Lifecycle of intermediates (freed right after the last consumer runs):")
    w = max([len(k) for k in plan.lifetimes] + [12])
    lines.append(f"  {'tensor':<{w}}  {'producer':<14} {'last consumer':<14} consumers")
    for k, t in plan.lifetimes.items():
        lines.append(f"  {k:<{w}}  {t.producer:<14} {t.last_consumer or '(none: freed at once)':<14} "
                     f"{', '.join(t.consumers) or '-'}")
    if plan.warnings:
        lines.append("")
        lines += [f"warning: {m}" for m in plan.warnings]
    return "\n".join(lines)
