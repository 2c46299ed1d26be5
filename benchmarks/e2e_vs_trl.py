"""flowrl vs TRL's GRPOTrainer: the same GRPO run in both, side by side, on this CPU machine.

Run (SmolLM2-135M-Instruct; about 10 min on a quiet 2-core CPU):
    python benchmarks/e2e_vs_trl.py
Quick check (tiny random model, a few minutes):
    python benchmarks/e2e_vs_trl.py --model tiny --steps 2

Both runs are built from ONE flowrl config (``flowrl.cli.compose`` of the overrides below): flowrl
trains it through its public API (``flowrl.train.train``); the TRL child maps the same TrainConfig
onto a ``GRPOConfig`` (``trl_kwargs``), loads the same model with ``flowrl.models.load_model``,
gets the same prompts, in the same order, from flowrl's ``PromptSource`` (chat template already
applied, passed as plain text so TRL tokenizes them without re-templating, same ids), and scores
with the reward stage of the same compiled graph. Each framework runs in a fresh subprocess with
the same torch thread count; its own peak RSS comes from ``wait4``. Generated tokens = valid
completion tokens including the stop token, counted the same way in both. The step time of the
first (warm-up) step is excluded when there is more than one step.
Writes ``benchmarks/results/e2e_vs_trl.md`` (``--out``) and prints the tables.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (REPO_ROOT, command_line, git_revision, machine_info, markdown_table,  # noqa: E402
                     run_child, text_table, utc_now, versions)

FRAMEWORKS = ("flowrl", "trl")
# stages TRL's GRPOTrainer also performs; any other stage in the graph has no TRL counterpart
# TRL with num_iterations=1 runs no old-logprob pass (π_old = π_θ.detach()); flowrl does the same
# work with algorithm.recompute_old_logprobs=false, which prunes that stage
_TRL_STAGES = {"sample": "data.sample", "rollout": "rollout.generate", "reward": "reward.rule",
               "advantage": "advantage.grpo", "update": "update.policy"}


@dataclass
class BenchConfig:
    """The knobs both frameworks share; everything else is flowrl's default config (see the
    settings table of the report). ``micro_batch_size`` must divide ``prompts_per_step * n``
    (TRL accumulates whole micro-batches); ``n >= 2`` (TRL refuses smaller groups)."""

    model: str = "smollm2"
    steps: int = 5
    prompts_per_step: int = 4
    n: int = 4
    max_new_tokens: int = 128
    micro_batch_size: int = 4
    temperature: float = 0.7
    top_p: float = 1.0
    lr: float = 1e-5
    seed: int = 0
    threads: int = os.cpu_count() or 1

    def __post_init__(self) -> None:
        if self.model not in ("smollm2", "tiny"):
            raise ValueError(f"--model must be smollm2 or tiny, got {self.model!r}")
        for name in ("steps", "prompts_per_step", "max_new_tokens", "micro_batch_size", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.n < 2:
            raise ValueError(f"--n must be >= 2 (TRL's GRPOTrainer needs groups), got {self.n}")
        if self.batch % self.micro_batch_size:
            raise ValueError(f"--micro-batch-size {self.micro_batch_size} must divide the batch "
                             f"prompts_per_step*n = {self.batch} (TRL accumulates whole micro-batches)")

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.n


def flowrl_overrides(bc: BenchConfig, out_dir: str) -> list[str]:
    """Hydra overrides of the run. adv_eps=1e-4 because TRL adds a fixed 1e-4 to the group std;
    rollout.hf.batch_size=B so flowrl, like TRL, generates the whole batch in one call."""
    return [*(["model=tiny"] if bc.model == "tiny" else []),
            f"trainer.total_steps={bc.steps}", f"trainer.prompts_per_step={bc.prompts_per_step}",
            f"algorithm.n={bc.n}", "algorithm.kl_coef=0.0", "algorithm.adv_eps=1e-4",
            "algorithm.recompute_old_logprobs=false",
            f"rollout.sampling.max_new_tokens={bc.max_new_tokens}",
            f"rollout.sampling.temperature={bc.temperature}", f"rollout.sampling.top_p={bc.top_p}",
            "rollout.sampling.top_k=0", f"rollout.hf.batch_size={bc.batch}",
            f"trainer.engine.lr={bc.lr}", f"trainer.engine.micro_batch_size={bc.micro_batch_size}",
            f"trainer.seed={bc.seed}", "trainer.device=cpu", f"trainer.output_dir={out_dir}",
            "trainer.eval.before=false", "trainer.eval.after=false",
            "logger.progress=false", "logger.tensorboard=false"]


def prepare_run(bc: BenchConfig, out_dir: str):
    """(TrainConfig, ExecutionPlan) of the shared run; raises when the graph holds a stage or an
    algorithm setting TRL's GRPOTrainer has no equivalent for."""
    from flowrl.cli import compose
    from flowrl.train import prepare

    tc, plan = prepare(compose(flowrl_overrides(bc, out_dir)))
    ops = {c.stage.name: c.stage.op for c in plan.stages}
    if ops != _TRL_STAGES:
        raise ValueError(f"graph stages {ops} differ from the GRPO stages TRL runs {_TRL_STAGES}")
    a = tc.algorithm
    if (a.policy_loss, a.loss_agg_mode, a.ppo_epochs, a.entropy_coef, a.clip_ratio_c) != \
            ("ppo_clip", "token-mean", 1, 0.0, None) or a.mini_batch_size not in (None, bc.batch):
        raise ValueError("benchmark needs policy_loss=ppo_clip, loss_agg_mode=token-mean, one "
                         "optimizer step per batch, no entropy bonus, no dual-clip")
    return tc, plan


def trl_kwargs(tc, bc: BenchConfig, out_dir: str) -> dict:
    """GRPOConfig arguments equal to flowrl's TrainConfig ``tc`` (TRL 1.16 semantics):
    loss_type="dapo" = token-mean over the whole generation batch (TRL rescales each micro-batch
    by the batch's token count); steps_per_generation = gradient_accumulation_steps, so one
    optimizer step per generated batch (flowrl: mini_batch_size=None) and no old-logprob pass
    (num_iterations=1). Every TRL feature flowrl does not run here is off."""
    e, a, s = tc.trainer.engine, tc.algorithm, tc.rollout.sampling
    accum = bc.batch // e.micro_batch_size
    return dict(
        output_dir=out_dir, report_to="none", use_cpu=True, bf16=False, fp16=False,
        seed=tc.trainer.seed, max_steps=tc.trainer.total_steps, logging_steps=1,
        save_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        per_device_train_batch_size=e.micro_batch_size, gradient_accumulation_steps=accum,
        steps_per_generation=accum, num_generations=a.n, shuffle_dataset=False,
        max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k, min_p=None, repetition_penalty=1.0, use_vllm=False,
        optim="adamw_torch", learning_rate=e.lr, adam_beta1=e.betas[0], adam_beta2=e.betas[1],
        adam_epsilon=e.eps, weight_decay=e.weight_decay, max_grad_norm=e.max_grad_norm,
        lr_scheduler_type=e.lr_scheduler, warmup_steps=e.warmup_steps,
        gradient_checkpointing=e.gradient_checkpointing or tc.model.gradient_checkpointing,
        disable_dropout=e.disable_dropout,
        beta=a.kl_coef, num_iterations=a.ppo_epochs, epsilon=a.clip_ratio_low,
        epsilon_high=a.clip_ratio_high, loss_type="dapo", importance_sampling_level="token",
        scale_rewards="group" if a.norm_adv_by_std else "none",
        mask_truncated_completions=a.mask_truncated, top_entropy_quantile=1.0,
        log_completions=False, remove_unused_columns=False)


def settings_rows(tc, kw: dict, reward_cfg) -> list[tuple[str, str, str]]:
    e, a, s = tc.trainer.engine, tc.algorithm, tc.rollout.sampling
    model = "tiny random Llama" if tc.model.tiny else f"{tc.model.path} ({tc.model.gguf_file})"
    return [
        ("model", f"{model}, {tc.model.dtype}", "the same `load_model` output, bf16=False fp16=False"),
        ("batch", f"prompts_per_step={tc.trainer.prompts_per_step} × n={a.n}",
         f"num_generations={kw['num_generations']}, generation batch "
         f"{kw['per_device_train_batch_size'] * kw['steps_per_generation']}"),
        ("micro-batch", f"micro_batch_size={e.micro_batch_size}",
         f"per_device_train_batch_size={kw['per_device_train_batch_size']} × "
         f"gradient_accumulation_steps={kw['gradient_accumulation_steps']}"),
        ("optimizer steps / batch", f"ppo_epochs={a.ppo_epochs}, mini_batch_size={a.mini_batch_size}",
         f"num_iterations={kw['num_iterations']}, steps_per_generation={kw['steps_per_generation']}"),
        ("sampling", f"T={s.temperature} top_p={s.top_p} top_k={s.top_k} max_new_tokens={s.max_new_tokens}",
         f"T={kw['temperature']} top_p={kw['top_p']} top_k={kw['top_k']} "
         f"max_completion_length={kw['max_completion_length']}"),
        ("prompts", f"GSM8K {tc.data.split}, PromptSource (seed {tc.data.seed}), "
         f"≤ {tc.data.max_prompt_tokens} tokens", "the same texts in the same order, plain-text "
         "column, shuffle_dataset=False"),
        ("optimizer", f"AdamW lr={e.lr} betas={list(e.betas)} eps={e.eps} wd={e.weight_decay} "
         f"clip={e.max_grad_norm} {e.lr_scheduler}",
         f"{kw['optim']} lr={kw['learning_rate']} betas=[{kw['adam_beta1']}, {kw['adam_beta2']}] "
         f"eps={kw['adam_epsilon']} wd={kw['weight_decay']} clip={kw['max_grad_norm']} "
         f"{kw['lr_scheduler_type']}"),
        ("loss", f"{a.policy_loss} ε={a.clip_ratio_low}/{a.clip_ratio_high}, {a.loss_agg_mode}",
         f"loss_type={kw['loss_type']} ε={kw['epsilon']}/{kw['epsilon_high']}"),
        ("advantage", f"advantage.grpo, std-normalised={a.norm_adv_by_std}, eps={a.adv_eps}",
         f"scale_rewards={kw['scale_rewards']} (eps 1e-4, fixed)"),
        ("KL", f"kl_coef={a.kl_coef} (no ref stage)", f"beta={kw['beta']} (no ref model)"),
        ("truncated completions", f"mask_truncated={a.mask_truncated}",
         f"mask_truncated_completions={kw['mask_truncated_completions']}"),
        ("reward", f"reward.rule {reward_cfg.verifier} format_score={reward_cfg.format_score} "
         f"fallback_last_number={reward_cfg.fallback_last_number}", "the same function and arguments"),
        ("dropout / grad ckpt", f"disable_dropout={e.disable_dropout}, "
         f"gradient_checkpointing={e.gradient_checkpointing}",
         f"disable_dropout={kw['disable_dropout']}, gradient_checkpointing={kw['gradient_checkpointing']}"),
        ("seed", str(tc.trainer.seed), str(kw["seed"])),
    ]


# ---------------------------------------------------------------------------- children
def child_flowrl(bc: BenchConfig, out_dir: str) -> dict:
    """Train through flowrl's public API; per-step numbers from metrics.jsonl."""
    from flowrl.cli import compose
    from flowrl.train import train

    train(compose(flowrl_overrides(bc, out_dir)))
    by_step: dict[int, dict] = {}
    for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], {}).update(row)
    steps = []
    for k in sorted(s for s in by_step if s >= 1):
        m = by_step[k]
        steps.append({"step": k, "step_s": m["perf/step_s"],
                      # length_mean = mean valid tokens (stop token included) per completion
                      "gen_tokens": round(m["response/length_mean"] * bc.batch),
                      "reward_mean": m["reward/mean"], "length_mean": m["response/length_mean"],
                      "generate_s": m["time/rollout"],
                      "stages": {key[5:]: v for key, v in m.items() if key.startswith("time/")}})
    return {"steps": steps}


def child_trl(bc: BenchConfig, out_dir: str) -> dict:
    """The same run in TRL's GRPOTrainer, configured from flowrl's TrainConfig."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from flowrl.data import PromptSource
    from flowrl.models.loading import load_model, load_tokenizer
    from flowrl.rewards import REWARD_FUNCTIONS

    tc, plan = prepare_run(bc, out_dir)
    rcfg = next(c.config for c in plan.stages if c.stage.op == "reward.rule")
    tok = load_tokenizer(tc.model)
    source = PromptSource(tc.data, tok)
    prompts, truths = [], []
    for _ in range(bc.steps):  # exactly the prompts flowrl's data.sample draws, step by step
        b = source.sample(bc.prompts_per_step, 1)
        prompts += b.prompt_text
        truths += b.ground_truth
    dataset = Dataset.from_dict({"prompt": prompts, "ground_truth": truths})
    torch.manual_seed(tc.trainer.seed)
    model = load_model(tc.model)
    # flowrl stops on the tokenizer's EOS only; TRL also stops on the model's generation eos ids
    model.generation_config.eos_token_id = tok.eos_token_id
    verifier = REWARD_FUNCTIONS[rcfg.verifier]
    per_gen: list[dict] = []

    def gsm8k_reward(prompts, completions, completion_ids, ground_truth, **_):
        scores = []
        for text, gt in zip(completions, ground_truth):
            try:  # as flowrl's reward.rule: a verifier error marks the sample unscorable (NaN)
                r = float(verifier(text, gt, format_score=rcfg.format_score,
                                   fallback_last_number=rcfg.fallback_last_number))
                scores.append(r if math.isfinite(r) else None)
            except Exception:
                scores.append(None)
        ok = [s for s in scores if s is not None]
        per_gen.append({"gen_tokens": sum(len(c) for c in completion_ids),  # EOS kept, pads cut
                        "length_mean": sum(len(c) for c in completion_ids) / len(completion_ids),
                        "reward_mean": sum(ok) / len(ok) if ok else float("nan")})
        return scores

    times: list[float] = []
    gen_times: list[float] = []

    class StepTimer(TrainerCallback):  # generation + scoring + all micro-batches + optimizer step
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(model=model, reward_funcs=gsm8k_reward, args=GRPOConfig(**trl_kwargs(tc, bc, out_dir)),
                          train_dataset=dataset, processing_class=tok, callbacks=[StepTimer()])
    generate = trainer._generate_single_turn  # timing wrapper only, behaviour unchanged

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            gen_times.append(time.perf_counter() - t0)

    trainer._generate_single_turn = timed_generate
    trainer.train()
    if not len(times) == len(per_gen) == len(gen_times) == bc.steps:
        raise RuntimeError(f"TRL ran {len(times)} steps / {len(per_gen)} generations, expected {bc.steps}")
    return {"steps": [{"step": i + 1, "step_s": t, "generate_s": g, **p}
                      for i, (t, g, p) in enumerate(zip(times, gen_times, per_gen))]}


# ---------------------------------------------------------------------------- parent
def summarize(result: dict, peak_rss: int, wall_s: float) -> dict:
    steps = result["steps"]
    timed = steps[1:] if len(steps) > 1 else steps  # drop the warm-up step
    step_s = sum(s["step_s"] for s in timed)
    return {"measured": f"{len(timed)} of {len(steps)}",
            "tokens_per_s": sum(s["gen_tokens"] for s in timed) / max(step_s, 1e-9),
            "step_s": step_s / len(timed),
            "generate_s": sum(s["generate_s"] for s in timed) / len(timed),
            "length_mean": sum(s["length_mean"] for s in timed) / len(timed),
            "peak_rss_gib": peak_rss / 2**30, "wall_s": wall_s,
            "reward_last": steps[-1]["reward_mean"],
            "reward_mean": sum(s["reward_mean"] for s in steps) / len(steps)}


_COLS = [("framework", None), ("steps timed", "measured"), ("gen tokens/s", "tokens_per_s"),
         ("step s (mean)", "step_s"), ("generate s", "generate_s"), ("completion len", "length_mean"),
         ("peak RSS GiB", "peak_rss_gib"), ("reward last step", "reward_last"),
         ("reward mean", "reward_mean"), ("process wall s", "wall_s")]


def _fmt(v) -> str:
    return v if isinstance(v, str) else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def results_rows(summ: dict) -> list[list]:
    rows = [[fw, *(_fmt(s[k]) for _, k in _COLS[1:])] for fw, s in summ.items()]
    if len(summ) == 2:
        f, t = summ["flowrl"], summ["trl"]
        ratio = ["flowrl/TRL", "", *(f"{f[k] / t[k]:.2f}×" if t[k] else "n/a"
                                     for _, k in _COLS[2:])]
        rows.append(ratio)
    return rows


def write_report(path: Path, bc: BenchConfig, settings, summ: dict, raw: dict,
                 load: tuple[float, float]) -> str:
    machine = machine_info()
    vers = versions(["torch", "transformers", "trl", "accelerate", "datasets", "flowrl"])
    per_step = [[fw, s["step"], f"{s['step_s']:.2f}", f"{s['generate_s']:.2f}", s["gen_tokens"],
                 f"{s['reward_mean']:.3f}"] for fw, r in raw.items() for s in r["steps"]]
    stages = {}
    for s in raw.get("flowrl", {}).get("steps", [])[1:] or raw.get("flowrl", {}).get("steps", []):
        for k, v in s["stages"].items():
            stages.setdefault(k, []).append(v)
    lines = [
        "# flowrl vs TRL GRPOTrainer: end-to-end GRPO on CPU", "",
        "Produced by `benchmarks/e2e_vs_trl.py` (the same GRPO run in both frameworks, each in a "
        "fresh subprocess; see the script's docstring for what is shared).", "",
        f"- command: `{command_line()}`",
        f"- date: {utc_now()}; flowrl commit {git_revision()}",
        f"- machine: {machine['cpu']}, {machine['physical_cores']} cores / "
        f"{machine['logical_cpus']} logical CPUs, {machine['memory']}, {machine['os']}",
        f"- load average (1 min) at start / end: {load[0]:.2f} / {load[1]:.2f} (other work on "
        f"the machine slows both frameworks; compare runs made at a quiet moment)",
        f"- torch threads: {bc.threads} (torch.set_num_threads and OMP/MKL_NUM_THREADS in both)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()) + f", python {machine['python']}",
        "", "## Settings", "", markdown_table(["setting", "flowrl", "TRL"], settings),
        "", "## Results", "",
        "gen tokens/s = valid completion tokens (stop token included) / step time, over the timed "
        "steps (the first, warm-up step is excluded when there are several). step s: flowrl "
        "`perf/step_s` (all stages of one iteration); TRL: `on_step_begin` → `on_step_end` "
        "(generation, scoring, every micro-batch, optimizer step). generate s: flowrl rollout "
        "stage; TRL `_generate_single_turn`. Peak RSS: the child process (`wait4`). Ratios: > 1 "
        "means flowrl is higher (better for tokens/s, worse for seconds and RSS).", "",
        markdown_table([c for c, _ in _COLS], results_rows(summ)), ""]
    if stages:
        lines += ["flowrl seconds per stage (mean over timed steps): " + ", ".join(
            f"{k} {sum(v) / len(v):.2f}" for k, v in stages.items()), ""]
    lines += ["### Per step", "", markdown_table(["framework", "step", "step s", "generate s",
                                                  "gen tokens", "reward mean"], per_step), "",
              "## What could not be made identical", "", NOTES]
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


NOTES = """\
- **Sampled tokens differ.** Both sample from the same model with the same settings, but from
  different RNG streams, so completions (and their lengths) differ; tokens/s normalises for length,
  step time does not (compare the completion length column).
- **Old-logprob pass.** With one optimizer step per batch TRL skips the old-policy forward pass and
  uses the detached current logprobs (ratio ≡ 1). flowrl does the same here with
  `algorithm.recompute_old_logprobs=false` (its default recomputes them in a separate stage); the
  update's own forward then also gives the sampler/trainer mismatch metric. Same gradient, same
  work.
- **LM head.** TRL 1.16 patches the model with a chunked fused LM head that returns logprobs and
  entropy without materialising (B, L, V) logits; off Triton devices (this CPU) it scores every
  position of prompt+completion. flowrl materialises logits for the R+1 completion positions only.
- **Rollout logprobs.** flowrl records the sampler's logprob of every token during generation (a
  logits processor, one (B, V) copy per decoding step); TRL without vLLM records none.
- **Advantage eps.** TRL adds a fixed 1e-4 to the group std; flowrl is run with
  `algorithm.adv_eps=1e-4` to match (its default is 1e-6).
- **Stop tokens.** TRL stops on the tokenizer EOS plus the model's generation-config EOS ids; the
  benchmark sets the model's to the tokenizer EOS so both stop on the same single id.
- **Prompt length cap.** TRL 1.16 has no prompt cap; it receives only the prompts flowrl kept
  (≤ `data.max_prompt_tokens`), so both see the same prompts.
- **End of run.** flowrl writes a DCP checkpoint after the last step (outside the step time, inside
  the process wall time); TRL runs with `save_strategy="no"`.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = BenchConfig()
    p.add_argument("--model", choices=("smollm2", "tiny"), default=d.model)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step)
    p.add_argument("--n", type=int, default=d.n)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--only", choices=FRAMEWORKS)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "e2e_vs_trl.md")
    p.add_argument("--child", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        bc = BenchConfig(model=args.model, steps=args.steps, prompts_per_step=args.prompts_per_step,
                         n=args.n, max_new_tokens=args.max_new_tokens, threads=args.threads,
                         micro_batch_size=args.micro_batch_size, temperature=args.temperature)
    except ValueError as e:
        p.error(str(e))

    if args.child:  # inside a fresh subprocess
        import torch

        torch.set_num_threads(bc.threads)
        out_dir = str(args.result.parent / f"{args.child}_run")
        res = (child_flowrl if args.child == "flowrl" else child_trl)(bc, out_dir)
        args.result.write_text(json.dumps(res))
        return 0

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="flowrl_bench_") as tmp:
        tc, plan = prepare_run(bc, str(Path(tmp) / "check"))  # fail before any model loads
        rcfg = next(c.config for c in plan.stages if c.stage.op == "reward.rule")
        settings = settings_rows(tc, trl_kwargs(tc, bc, tmp), rcfg)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "WANDB_DISABLED": "true", "WANDB_MODE": "disabled",
               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(bc.threads),
               "MKL_NUM_THREADS": str(bc.threads), "PYTHONPATH": str(REPO_ROOT)}
        summ, raw = {}, {}
        for fw in ([args.only] if args.only else FRAMEWORKS):
            result = Path(tmp) / fw / "result.json"
            result.parent.mkdir()
            print(f"== {fw}: {bc.steps} steps × {bc.prompts_per_step}×{bc.n}, "
                  f"max_new_tokens {bc.max_new_tokens}, model {bc.model}", flush=True)
            child = run_child([sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:]),
                               "--child", fw, "--result", str(result)], env=env, cwd=REPO_ROOT)
            if child.returncode != 0:
                print(f"{fw} run failed with exit code {child.returncode}", file=sys.stderr)
                return 1
            raw[fw] = json.loads(result.read_text())
            summ[fw] = summarize(raw[fw], child.peak_rss_bytes, child.wall_s)
    write_report(args.out, bc, settings, summ, raw, (load_start, os.getloadavg()[0]))
    print("\n" + text_table([c for c, _ in _COLS], results_rows(summ)))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
