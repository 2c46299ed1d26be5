"""Multi-turn vs single-turn rollouts of the same total length: trajectories/s, tokens/s, tool
time, and the rollout-vs-trainer logprob mismatch.

    python benchmarks/multi_turn.py                     # CPU, HF engine, writes results/multi_turn_cpu.md
    python benchmarks/multi_turn.py --device cuda --backend vllm --trajectories 256 \\
        --out benchmarks/results/multi_turn_h200.md     # the lent GPU

Workload: ``--trajectories`` prompts (GSM8K questions with the calculator's schema in the system
prompt, as ``graph=grpo_tools`` renders them) on a random-init model of ``--shape`` (weights do
not change the cost; a random model never stops, so every turn has exactly its token budget).

- multi-turn: ``rollout.multi_turn``'s loop (``flowrl/envs/rollout.py``) with the ``tools``
  environment and the calculator: ``--turns`` policy turns of ``--tokens-per-turn`` tokens
  (``continue_cut_turns``), each followed by one calculator call in the tool worker pool and its
  result as a tool message; one generate call per round for every trajectory;
- single-turn: one ``generate`` of ``turns x tokens-per-turn`` tokens per prompt (the same policy
  tokens, no observations).

The random model writes no tool calls, so the benchmark parses one from every turn (the
``bench_every_turn`` format: ``calculator("<turn length> * 3")``); the call still runs through
the real pool (spawned workers, timeout, memory cap). Numbers: median of ``--repeats`` runs
after one warm-up; tokens/s counts policy tokens per wall second of the whole rollout (tools and
environments included); the mismatch is mean / max |rollout - trainer| logprob over the policy
tokens, the trainer (``LocalTrainEngine.logprobs``) scoring the multi-turn rows with their
observation tokens as context.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import command_line, git_revision, machine_info, utc_now, versions  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=128),
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True),
    "qwen05b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
}


def bench_every_turn(text: str):
    """Benchmark tool-call format: one calculator call in every turn, whatever its text."""
    from flowrl.envs.parsers import ParsedCall

    return [ParsedCall("calculator", {"expression": f"{len(text)} * 3"})]


def build(args):
    import transformers

    from flowrl.envs.parsers import TOOL_CALL_FORMATS
    from flowrl.models.bundled import bundled_tokenizer_dir

    TOOL_CALL_FORMATS["bench_every_turn"] = bench_every_turn
    tok = transformers.AutoTokenizer.from_pretrained(bundled_tokenizer_dir())
    shape = {**SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {})}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), bos_token_id=1, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, max_position_embeddings=4096, **shape))
    model = model.to(args.device).eval()
    if args.backend == "vllm":
        from flowrl.engines.rollout.vllm import VLLMRolloutEngine
        from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig

        on_cpu = args.device == "cpu"
        engine = VLLMRolloutEngine(model, tok, VLLMRolloutConfig(
            kv_cache_memory_gb=1.0 if on_cpu else None, enforce_eager=on_cpu, max_model_len=4096,
            max_num_seqs=max(16, args.trajectories)))
    else:
        from flowrl.engines.config import HFRolloutConfig
        from flowrl.engines.rollout.hf import HFRolloutEngine

        engine = HFRolloutEngine(model, tok, HFRolloutConfig(batch_size=args.trajectories))
    return tok, model, engine


def prompts(tok, n: int, device: str):
    from flowrl.data import DataConfig, PromptSource
    from flowrl.data.prompts import collate_prompts
    from flowrl.envs.tools import resolve_tools

    cfg = DataConfig(limit=n, max_prompt_tokens=1024, tools=[t.schema for t in resolve_tools(["calculator"])],
                     instruction="Use the calculator tool for arithmetic you are not sure of. Then "
                                 "write the final answer on its own line as '#### <number>'.")
    src = PromptSource(cfg, tok)
    ids, mask = collate_prompts([src.render(i)[1] for i in range(n)], tok.pad_token_id)
    return ids.to(device), mask.to(device)


def mismatch(model, ids, mask, out) -> tuple[float, float]:
    from flowrl.engines.config import TrainEngineConfig
    from flowrl.engines.train.local import LocalTrainEngine

    trainer = LocalTrainEngine(model, TrainEngineConfig(micro_batch_size=8), trainable=False)
    lp = trainer.logprobs({"prompt_ids": ids, "prompt_mask": mask, "response_ids": out.response_ids,
                           "response_mask": out.response_mask}, temperature=1.0).logprobs
    m = out.response_mask.to(lp.device)
    d = (lp - out.rollout_logprobs.to(lp.device)).abs()[m]
    return float(d.mean()), float(d.max())


def run(args) -> list[dict]:
    from flowrl.engines.base import SamplingConfig
    from flowrl.envs.config import MultiTurnConfig
    from flowrl.envs.rollout import MultiTurnSession

    tok, model, engine = build(args)
    ids, mask = prompts(tok, args.trajectories, args.device)
    total = args.turns * args.tokens_per_turn
    cfg = MultiTurnConfig(env="tools", tools=["calculator"], tool_call_format="bench_every_turn",
                          max_turns=args.turns, max_new_tokens_per_turn=args.tokens_per_turn,
                          max_total_tokens=total + args.turns * 64, continue_cut_turns=True,
                          tool_workers=args.tool_workers, tool_timeout_s=10.0)
    session = MultiTurnSession(cfg, tok)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.tokens_per_turn)
    single = SamplingConfig(temperature=1.0, max_new_tokens=total)
    rows = {"multi-turn": [], "single-turn": []}
    try:
        for rep in range(args.repeats + 1):  # run 0 warms up (pool start, allocator, kernels)
            gen = torch.Generator().manual_seed(rep)
            t0 = time.perf_counter()
            mt = session.run(engine, ids, mask, sampling, generator=gen)
            wall = time.perf_counter() - t0
            if rep:
                rows["multi-turn"].append(dict(
                    wall=wall, policy=int(mt.response_mask.sum()), gen=mt.generate_s, tool=mt.tool_s,
                    rounds=mt.rounds, env_tokens=float((mt.response_mask.flip(1).cummax(1).values
                                                        & ~mt.response_mask).sum()) / len(mt.finish_reason),
                    calls=int(mt.num_tool_calls.sum()), errors=int(mt.num_tool_errors.sum()),
                    cache=mt.cached_tokens / max(mt.context_tokens, 1), out=mt))
            t0 = time.perf_counter()
            st = engine.generate(ids, mask, single, generator=gen)
            wall = time.perf_counter() - t0
            if rep:
                rows["single-turn"].append(dict(wall=wall, policy=int(st.response_mask.sum()), gen=wall,
                                                tool=0.0, rounds=1, env_tokens=0.0, calls=0, errors=0,
                                                cache=0.0, out=st))
        results = []
        for mode, runs in rows.items():
            walls = [r["wall"] for r in runs]
            med = runs[walls.index(statistics.median_low(walls))]
            mm, mx = mismatch(model, ids, mask, med["out"])
            results.append(dict(mode=mode, traj_s=args.trajectories / med["wall"],
                                tok_s=med["policy"] / med["wall"], wall=med["wall"], gen=med["gen"],
                                tool=med["tool"], rounds=med["rounds"], env_tokens=med["env_tokens"],
                                calls=med["calls"], errors=med["errors"], cache=med["cache"],
                                policy=med["policy"], mismatch_mean=mm, mismatch_max=mx))
        return results
    finally:
        session.close()
        if hasattr(engine, "close"):
            engine.close()


def table(results: list[dict]) -> str:
    head = ("| rollout | trajectories/s | policy tokens/s | wall s | generate s | tool s | rounds "
            "| tool calls (errors) | env tokens / traj | prefix-cache hit | mismatch mean / max |")
    lines = [head, "|---" * 11 + "|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['traj_s']:.2f} | {r['tok_s']:.1f} | {r['wall']:.2f} | "
                     f"{r['gen']:.2f} | {r['tool']:.3f} | {r['rounds']} | {r['calls']} ({r['errors']}) | "
                     f"{r['env_tokens']:.1f} | {r['cache']:.2f} | "
                     f"{r['mismatch_mean']:.2e} / {r['mismatch_max']:.2e} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tokens-per-turn", type=int, default=32)
    p.add_argument("--tool-workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="results file (default results/multi_turn_<device>.md)")
    args = p.parse_args(argv)
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    results = run(args)
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out = Path(args.out or Path(__file__).parent / "results" / f"multi_turn_{args.device}.md")
    m = machine_info()
    v = versions(["torch", "transformers", "vllm"])
    text = f"""# Multi-turn vs single-turn rollouts ({args.device}, {args.backend})

- Command: `{command_line(argv)}`
- Date: {utc_now()} · commit {git_revision()}
- Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory']}; {m['os']}; Python {m['python']}
  {('· GPU ' + torch.cuda.get_device_name()) if args.device.startswith('cuda') else ''}
- Versions: torch {v['torch']}, transformers {v['transformers']}, vllm {v['vllm']}
- Load average (1 min) at start / end: {load0:.1f} / {load1:.1f} (other jobs on the machine)
- Workload: {args.trajectories} GSM8K prompts with the calculator's schema; random-init
  `{args.shape}` shape{f' ({args.layers} layers)' if args.layers else ''}; multi-turn = {args.turns}
  turns x {args.tokens_per_turn} tokens, one calculator call after each turn
  ({args.tool_workers} tool workers); single-turn = {args.turns * args.tokens_per_turn} tokens in one
  generate call. Median of {args.repeats} runs after one warm-up (see the script's docstring).

{table(results)}

Policy tokens per run: multi-turn {results[0]['policy']}, single-turn {results[1]['policy']}.
Tokens/s and trajectories/s are over the whole rollout's wall time (tools, environments and
observation rendering included); "generate s" is the time inside the engine.
"""
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
