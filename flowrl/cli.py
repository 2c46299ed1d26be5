"""flowrl: declarative dataflow-graph RL post-training. Commands:

    flowrl train [hydra overrides...]        run a job (Hydra: -m sweeps, --cfg job, ...)
    flowrl plan  [hydra overrides...]        print the compiled execution plan; loads no model
                 [--format text|mermaid|dot]  placement=auto: explains the choice without training
    flowrl plan  cluster=<name> model.path=DIR   a cluster you do not have (conf/cluster/): step
                                             time, best split and memory per GPU, no GPU
    flowrl graph validate FILE [FILE ...]    check graph files: every problem, one line each (exit 1)
    flowrl export CKPT OUT_DIR [overrides]   checkpoint -> plain HF model dir (save_pretrained;
                                             LoRA: merged, or --adapter-only: the PEFT dir)

    flowrl train launcher.nproc=N ...        the same job on N processes (re-executes under torchrun)
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path


# Every import below is inside a function: a command pays only for what it uses (graph
# validation never loads torch; a rejected config answers before the model code is imported).
def compose(overrides: list[str]):
    """The run config Hydra would build for ``flowrl train <overrides>`` (``flowrl.config.compose``)."""
    from flowrl.config import compose as compose_config

    return compose_config(overrides)


def one_line(e: BaseException) -> str:
    """A Hydra/OmegaConf error as one line (``flowrl.config.one_line``)."""
    from flowrl.config import one_line as config_one_line

    return config_one_line(e)


def plan_main(argv: list[str]) -> int:
    """``flowrl plan [--format text|mermaid|dot] [overrides]``: the placement plan (per-pool
    timelines, transfers, predicted step time and memory; ``placement=auto``: the choice and why)."""
    from flowrl.compiler.modes import format_placement
    from flowrl.compiler.render import FORMATS
    from flowrl.config import task_section
    from flowrl.train import prepare, role_parallelism, world_size

    fmt, rest = "text", []
    it = iter(argv)
    for a in it:
        if a == "--format":
            fmt = next(it, "")
        elif a.startswith("--format="):
            fmt = a.split("=", 1)[1]
        else:
            rest.append(a)
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {fmt!r}")
    raw = task_section(compose(rest), "(none: plan only)")  # no Hydra run dir exists when planning
    if raw.get("cluster") is not None:
        print(cluster_plan(raw, fmt))
        return 0
    spec = prepare(raw, rest, plan_only=True)  # a teacher may be left unset
    cfg, plan, pp = spec.config, spec.plan, spec.placement
    if pp.estimate is None:  # auto attached its own; a missing model file only loses predictions
        from flowrl.compiler.cost import StageCosts
        from flowrl.compiler.modes import estimate

        w = world_size(cfg)
        try:
            p_tokens = measured_prompt_tokens(cfg, pp.notes)
            pp.estimate = estimate(pp, StageCosts.from_config(plan, cfg, w,
                                                              parallelism=role_parallelism(cfg),
                                                              prompt_tokens=p_tokens))
        except (FileNotFoundError, OSError, ValueError) as e:
            pp.notes.append(f"no predictions: {e}")
    print(format_placement(pp, fmt))
    if fmt == "text":  # mermaid / dot stay valid diagrams
        print("machine defaults (auto settings resolved on this machine):")
        for r in spec.resolved:
            print(f"  {r}")
        from flowrl.machine import machine_problems

        for problem in machine_problems(cfg):  # planned anyway: a GPU job may be planned anywhere
            print(f"  cannot run on this machine: {problem}")
    return 0


def measured_prompt_tokens(cfg, notes: list[str]) -> "int | None":
    """P for the cost model: the longest of the first 256 training prompts rendered by the
    policy's tokenizer (``flowrl.data.prompts.longest_prompt_tokens``; a step pads to its longest
    prompt), or None (the ``data.max_prompt_tokens`` bound) when it cannot be read. The bound
    alone made ``flowrl plan`` of the default job predict 177 s a step (P = 256) where arith
    prompts are 56 tokens. Appends a line saying which P the prediction uses to ``notes``."""
    from flowrl.data.prompts import longest_prompt_tokens
    from flowrl.models.loading import load_tokenizer

    bound = cfg.data.max_prompt_tokens
    r = cfg.rollout.sampling.max_new_tokens
    tail = (f"; R = {r} response tokens (rollout.sampling.max_new_tokens: an upper bound, "
            "responses may stop earlier)")
    try:
        p, rows = longest_prompt_tokens(cfg.data, load_tokenizer(cfg.model))
    except (OSError, ValueError) as e:  # no tokenizer or data here: the bound, said so
        notes.append(f"workload: P = {bound} prompt tokens (data.max_prompt_tokens; the prompts "
                     f"could not be read: {e})" + tail)
        return None
    if p is None:
        notes.append(f"workload: P = {bound} prompt tokens (data.max_prompt_tokens: image or "
                     "over-long prompts)" + tail)
        return None
    notes.append(f"workload: P = {p} prompt tokens, the longest of the first {rows} training "
                 f"prompts as the tokenizer renders them (data.max_prompt_tokens = {bound} only "
                 "skips longer ones)" + tail)
    return p


def build_cluster_plan(raw):
    """``flowrl plan cluster=<name>``: the ClusterPlan of the composed config ``raw`` on the
    cluster it names (``flowrl.compiler.cost.plan_cluster``). Nothing of this machine is read: no
    machine defaults, no data rows, no tokenizer; the model is read by shape from its config
    (``model.path`` may hold only a config.json), no weights.

    The workload is the run's: B = trainer.prompts_per_step × algorithm.n × the cluster's GPUs
    (prompts_per_step counts per data-parallel rank, as in ``flowrl train``), P =
    data.max_prompt_tokens, R = rollout.sampling.max_new_tokens; the engine settings are
    ``rollout.vllm``'s and ``trainer.engine``'s.

    Raises:
        ValueError / FileNotFoundError / GraphError: a bad field, graph or model folder.
    """
    from omegaconf import OmegaConf

    from flowrl.compiler.cost import ClusterCosts, Workload, plan_cluster, stage_kind
    from flowrl.compiler.plan import compile_plan
    from flowrl.config import to_train_config
    from flowrl.graph.validate import load_graph
    from flowrl.models.size import model_size

    cfg = to_train_config(raw)
    tree = OmegaConf.to_container(raw, resolve=True)
    plan = compile_plan(load_graph(cfg.graph.resolve()), tree, placement="colocated")
    cl = cfg.cluster
    world = cl.world
    w = Workload(cfg.trainer.prompts_per_step * cfg.algorithm.n * world, cfg.data.max_prompt_tokens,
                 cfg.rollout.sampling.max_new_tokens, cfg.algorithm.ppo_epochs)
    eng, vl = cfg.trainer.engine, cfg.rollout.vllm
    costs = ClusterCosts(cl, model_size(cfg.model), w, cfg.algorithm.n,
                         {c.stage.name: (c.stage.role, stage_kind(c.stage.op, c.stage.role))
                          for c in plan.stages},
                         rollout_tp=vl.tensor_parallel_size if vl.tensor_parallel_size > 1 else 0,
                         micro_batch_tokens=eng.max_tokens_per_micro_batch or 16384,
                         activation_checkpointing=eng.gradient_checkpointing,
                         max_num_seqs=vl.max_num_seqs)
    # k >= 1 trains on older weights' batches: the old-logprob stage must run (preflight's rule)
    ks = (0, 1) if cfg.algorithm.recompute_old_logprobs else (0,)
    return plan_cluster(plan, costs, cfg.placement, cfg.placement.auto.min_gain, ks)


def cluster_plan(raw, fmt: str) -> str:
    """What ``flowrl plan cluster=<name>`` prints: the chosen placement rendered in ``fmt`` (text:
    its timelines, then the candidate table, every term with its formula, the memory check)."""
    from flowrl.compiler.cost import cluster_placement
    from flowrl.compiler.modes import format_placement

    return format_placement(cluster_placement(build_cluster_plan(raw)), fmt)


def graph_main(argv: list[str]) -> int:
    """``flowrl graph validate FILE...``: every problem of every file, one line each (``FILE:
    stage 'x', field 'y': what to change``), exit 1 when any file is invalid; warnings (outputs
    nobody reads, inputs a ``when`` can disable) do not fail it. Needs no run config."""
    import argparse

    from flowrl.graph import GraphError, GraphWarning, validate_graph
    from flowrl.graph.validate import load_graph

    p = argparse.ArgumentParser(prog="flowrl graph")
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check graph YAML files")
    v.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    status = 0
    for f in args.files:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", GraphWarning)
                validate_graph(load_graph(f))
        except GraphError as e:
            print(str(e.with_source(f)), file=sys.stderr)
            status = 1
            continue
        except FileNotFoundError as e:
            print(f"{f}: {e}", file=sys.stderr)
            status = 1
            continue
        for w in caught:
            print(f"{f}: warning: {w.message}")
        print(f"{f}: ok")
    return status


def cwd_importable() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m`` does: the reward
    functions, tools and ops of a run are importable from where ``flowrl`` runs (the console
    script's own ``sys.path[0]`` is its bin directory). Spawned workers inherit the path."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cwd_importable()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        from flowrl.train import main as train_main

        sys.argv = [sys.argv[0] + " train", *rest]  # Hydra's own command line (-m, --help) reads it
        train_main(rest)  # launcher.nproc > 1: becomes torchrun, never returns
        return 0
    try:
        if cmd == "plan":
            return plan_main(rest)
        if cmd == "graph":
            return graph_main(rest)
        if cmd == "export":
            from flowrl.export import export_main

            return export_main(rest)
    except BrokenPipeError:  # `flowrl plan | head`: the reader left; nothing more to say
        sys.stdout = open(os.devnull, "w")  # the interpreter's final flush must not raise again
        return 0
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"flowrl {cmd}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # Hydra/OmegaConf composition (misspelled key, bad override type)
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if not isinstance(e, (HydraException, OmegaConfBaseException)):
            raise
        from flowrl.config_errors import explain

        print(f"flowrl {cmd}: error: {explain(e, rest)}", file=sys.stderr)
        return 2
    print(f"flowrl: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
