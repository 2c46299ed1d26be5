"""Greedy accuracy of SmolLM2-135M-Instruct on held-out ``arith`` items at several difficulties:
the measured baseline the default task and difficulty are chosen from (issue 25).

Each candidate is a set of ``data.arith.*`` settings; the model answers the first ``--limit``
items of its ``test`` split greedily through the same path as the run's eval
(``PromptSource.eval_batches`` -> the HF rollout engine -> ``evaluate_greedy`` scored by the
default graph's verifier, ``graphs/grpo.yaml``'s ``reward.rule gsm8k``: the number after the
last ``####`` compared exactly). Writes ``benchmarks/results/task_baseline_cpu.md``.

Run: python benchmarks/task_baseline.py                       (the 4 candidates, 128 items each)
     python benchmarks/task_baseline.py --limit 32 --candidates "digits=2,num_operands=2,ops=+"
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT, command_line, git_revision, machine_info, markdown_table, utc_now  # noqa: E402

CANDIDATES = ("digits=2,num_operands=2,ops=+", "digits=3,num_operands=2,ops=+",
              "digits=2,num_operands=3,ops=+", "digits=1,num_operands=3,ops=+*")


def parse_candidate(text: str) -> dict[str, object]:
    """``"digits=2,ops=+"`` -> ``{"digits": 2, "ops": "+"}`` (``ArithConfig`` field values)."""
    out: dict[str, object] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        out[key.strip()] = value if key.strip() == "ops" else int(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=128, help="held-out items per candidate")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--candidates", nargs="*", default=list(CANDIDATES))
    ap.add_argument("--instruction", default=None, help="data.instruction (default: arith's own)")
    ap.add_argument("--response-prefix", default="", help="data.response_prefix")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/task_baseline_cpu.md")
    args = ap.parse_args()

    import torch

    from flowrl.compiler.plan import compile_plan
    from flowrl.config import REPO_ROOT as FLOWRL_ROOT
    from flowrl.data import ArithConfig, DataConfig, PromptSource
    from flowrl.engines.rollout.hf import HFRolloutEngine
    from flowrl.graph import Graph
    from flowrl.models.loading import ModelConfig, load_model, load_tokenizer
    from flowrl.runtime.step.evaluate import eval_scorer, evaluate_greedy

    torch.manual_seed(0)
    mcfg = ModelConfig()  # path=smollm2: the real model, as model=smollm2
    tokenizer, model = load_tokenizer(mcfg), load_model(mcfg).eval()
    engine = HFRolloutEngine(model, tokenizer)
    # the default graph's own scorer, as the run's eval builds it
    run = {"algorithm": {"recompute_old_logprobs": True, "kl_coef": 0.0}}
    scorer = eval_scorer(compile_plan(Graph.load(FLOWRL_ROOT / "graphs/grpo.yaml"), run))
    assert scorer is not None
    rows, examples = [], []
    for text in args.candidates:
        arith = ArithConfig(**parse_candidate(text))  # type: ignore[arg-type]
        data = DataConfig(name="arith", arith=arith, instruction=args.instruction,
                          response_prefix=args.response_prefix)
        source = PromptSource(data, tokenizer)
        t0 = time.perf_counter()
        samples = args.out.with_suffix(f".{text.replace(',', '_').replace('=', '')}.jsonl")
        m = evaluate_greedy(engine, source, tokenizer, scorer, split="test", limit=args.limit,
                            batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                            samples_path=samples)
        rows.append([text, f"{m['eval/accuracy']:.3f}", f"{m['eval/accuracy_math_verify']:.3f}",
                     f"{m['eval/format_frac']:.2f}", f"{m['eval/response_length_mean']:.0f}",
                     f"{m['eval/truncated_frac']:.2f}", int(m["eval/n"]),
                     f"{time.perf_counter() - t0:.0f}"])
        first = samples.read_text().splitlines()[0]
        examples.append(f"- `{text}`: {first[:300]}")
        samples.unlink()
        print(" | ".join(map(str, rows[-1])), flush=True)

    headers = ["data.arith", "greedy accuracy (eval/accuracy)", "math-verify", "#### format",
               "resp. tokens", "truncated", "items", "seconds"]
    info = machine_info()
    md = f"""# Task baseline: SmolLM2-135M-Instruct greedy accuracy on held-out `arith` items (CPU)

- Command: `{command_line()}`
- Commit: `{git_revision()}`, date: {utc_now()}
- Machine: {info.get('cpu', '?')}, {info.get('logical_cpus', '?')} logical CPUs (shared with other jobs), {info.get('memory', '?')}
- Model: SmolLM2-135M-Instruct (`model=smollm2`, the bundled GGUF dequantized to fp32), greedy,
  <= {args.max_new_tokens} new tokens, the default chat template and the `arith` instruction
  {data.instruction!r}.
- Items: the first {args.limit} of each candidate's held-out `test` split
  (`flowrl/data/arith.py`, seed 0), scored as the run's eval scores them (`eval/accuracy`: the default
  graph's `reward.rule gsm8k` verifier: the number after the last `####`, else the last number
  of the response, equals the answer exactly); math-verify and the `####` share are the eval's
  other views.

{markdown_table(headers, rows)}

First answer of each candidate (index, ground truth, response, reward):

{chr(10).join(examples)}
"""
    args.out.write_text(md)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
