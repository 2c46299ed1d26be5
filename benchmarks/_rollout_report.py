"""The markdown report of ``benchmarks/rollout.py`` (``--report``) and its hardware floor."""
from __future__ import annotations

import json

from benchmarks._common import markdown_table

PEAK_FLOPS = 790e12  # bf16 matmul measured on this H200 (KINDS.md: 769-798 TFLOP/s)
PEAK_BW = 4.3e12     # device-to-device copy measured on this H200 (bytes read + written / s)


def floor_tokens_per_s(B: int, P: int, R: int, n_params: int, cfg) -> float:
    """Conservative hardware floor: per decode step, matmul FLOPs at PEAK_FLOPS *plus* bytes at
    PEAK_BW (no overlap): bf16 weights once, the KV cache at mean context P + R/2, fp32 logits written
    and read once; plus the prefill's FLOPs. FLOPs/token = 2·N + 4·L·d·ctx (attention)."""
    L, d = cfg.num_hidden_layers, cfg.hidden_size
    kv_bytes = 2 * L * cfg.num_key_value_heads * (d // cfg.num_attention_heads) * 2  # K+V, bf16
    ctx = P + R / 2
    step = (B * (2 * n_params + 4 * L * d * ctx) / PEAK_FLOPS
            + (2 * n_params + B * ctx * kv_bytes + 2 * 4 * B * cfg.vocab_size) / PEAK_BW)
    prefill = B * P * (2 * n_params + 4 * L * d * P / 2) / PEAK_FLOPS
    return B * R / (R * step + prefill)


def _ratio(a: float, b) -> str:
    return f"{a / b:.2f}" if b else "-"


def report(results: list[dict], notes: str = "", this_command: str = "") -> str:
    """Markdown: commands, machine, the throughput table with ratios, the switch cost, notes."""
    first = results[0]
    # one line per distinct (date, host) run: rows from different hosts are not comparable 1:1
    hosts = {}
    for r in results:
        key = (r["gpu"], r["machine"]["cpu"], r["machine"]["logical_cpus"],
               ", ".join(f"{k} {v}" for k, v in r["versions"].items()), r["git"])
        hosts.setdefault(key, []).append(r["date"])
    measured = "; ".join(f"{', '.join(dates)} on {g} ({cpu}, {n} CPUs), {vers}, flowrl {git}"
                         for (g, cpu, n, vers, git), dates in hosts.items())
    lines = ["# Rollout throughput: HF engine, vLLM and flowrl's vLLM engines (Qwen2.5-0.5B-shaped, bf16)", "",
             f"Measured {measured}.",
             f"Random {first['n_params'] / 1e6:.0f}M-parameter model, {first['prompt_len']}-token random "
             f"prompts, {first['new_tokens']} new tokens per sequence at temperature 1, sampled-token "
             "logprob per token; every sequence runs the full length (vLLM `ignore_eos=True`; the HF "
             "engine decodes the batch until its last row ends; flowrl's vLLM engines stop a row at EOS, "
             "which a random model rarely samples: see \"mean len\"). Tokens/s = response tokens "
             "returned / wall seconds of one warm `generate` up to (B, R) tensors on the host.", "",
             "Commands:", ""]
    lines += [f"    {r['command']}" for r in results]
    if this_command:
        lines += ["", "This file was written from the runs' JSON (`benchmarks/results/rollout_h200/`) by:", "",
                  f"    {this_command}"]
    rows = [r for res in results for r in res["rows"] if "switch" not in r]
    floor = {k: v for res in results for k, v in res["floor"].items()}
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["variant"] == "hf-static"}
    own = {(r["batch"], r["sampling"]): r["tokens_per_s"] for r in rows if r["variant"] == "flowrl-vllm"}
    own_any = {}  # raw-vLLM rows run unseeded: compare them to the unseeded flowrl-vllm row first
    for (b, _sampling), v in sorted(own.items(), key=lambda kv: kv[0][1].endswith("+unseeded")):
        own_any[b] = v
    head = ["variant", "sampling", "sequences", "mean len", "tok/s", "seconds", "× hf-static",
            "× flowrl-vllm", "% of floor", "settings"]
    table = []
    for r in sorted(rows, key=lambda r: (r["batch"], -r["tokens_per_s"])):
        f = floor.get(str(r["batch"]))
        table.append([r["variant"], r["sampling"], r["batch"],
                      f"{r.get('mean_response_len', r['tokens'] / r['batch']):.1f}",
                      f"{r['tokens_per_s']:,.0f}", f"{r['seconds']:.2f}",
                      _ratio(r["tokens_per_s"], base.get(r["batch"])),
                      _ratio(r["tokens_per_s"], own.get((r["batch"], r["sampling"]), own_any.get(r["batch"]))),
                      f"{100 * r['tokens_per_s'] / f:.1f}" if f else "-",
                      json.dumps(r.get("effective", r["settings"]), separators=(",", ":"))])
    lines += ["", "## Throughput", "", markdown_table(head, table), "",
              "× flowrl-vllm: against the in-process `flowrl-vllm` row of the same batch and sampling "
              "(other rows: its `+unseeded` row). flowrl rows: `+seeded` = `generate` given a "
              "`torch.Generator` (what flowrl's rollout op passes; vLLM then samples each row with its "
              "own generator), `+unseeded` = None; settings are per engine process.", "",
              "Floor (conservative, `floor_tokens_per_s`): per decode step matmul FLOPs at "
              f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s plus bytes (bf16 weights, KV cache at mean context, "
              f"fp32 logits written and read) at {PEAK_BW / 1e12:.1f} TB/s, no overlap: " +
              ", ".join(f"{float(v):,.0f} tok/s at {k}" for k, v in sorted(floor.items(), key=lambda kv: int(kv[0]))) + "."]
    lines += _switch_section([r for res in results for r in res["rows"] if "switch" in r])
    errs = {k: v for res in results for k, v in res["errors"].items()}
    if errs:
        lines += ["", "Failed variants: " + ", ".join(f"{k} ({v})" for k, v in errs.items())]
    if notes:
        lines += ["", notes.strip()]
    return "\n".join(lines) + "\n"


def _switch_section(sw: list[dict]) -> list[str]:
    """One column per switch row: raw ``vllm.LLM`` (variant "switch") and each flowrl engine."""
    if not sw:
        return []
    names = ["vllm.LLM" if s["variant"] == "switch" else s["variant"] for s in sw]
    phases = list(dict.fromkeys(k for s in sw for k in s["switch"]))
    level = lambda k: 2 if "2" in k else 1  # noqa: E731
    table = [[k] + [f"{s['switch'][k]:.3f}" if k in s["switch"] else "-" for s in sw] for k in phases]
    table += [[f"**level {n} total**"] + [f"{sum(v for k, v in s['switch'].items() if level(k) == n):.3f}"
                                          for s in sw] for n in (1, 2)]
    lines = ["", "## Colocated switch cost per step (seconds, median of 3)", "",
             markdown_table(["phase"] + names, table), ""]
    for name, s in zip(names, sw):
        if s["variant"] == "switch":
            lines.append(f"- {name}: {s['weight_gb']:.2f} GB bf16 loaded from a training-side module on "
                         "the same GPU (`model.load_weights(named_parameters())` + `reset_prefix_cache`); "
                         f"max |vLLM − source| after load {s['load_max_abs_diff']:g}; generate after the "
                         f"switch ok: {s['generate_after_switch_ok']}.")
        else:
            wall = {n: sum(v for k, v in s["switch_wall"].items() if level(k) == n) for n in (1, 2)}
            lines.append(f"- {name}: `engine.last_timings` (procs: slowest engine; load = parent's wall "
                         f"time incl. CUDA IPC to every engine); benchmark wall time level 1 {wall[1]:.3f} s, "
                         f"level 2 {wall[2]:.3f} s; {s['weight_gb']:.2f} GB loaded; greedy output changed "
                         f"by the load: {s['weights_changed']}; generate after the switch ok: "
                         f"{s['generate_after_switch_ok']}; sleep frees memory: {s['sleep_supported']}.")
    return lines
