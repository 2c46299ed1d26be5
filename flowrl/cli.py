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


# Every import below is inside a function: a command pays only for what it uses (graph
# validation never loads torch; a rejected config answers before the model code is imported).
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
        try:
            from flowrl.train import main as train_main

            sys.argv = [sys.argv[0] + " train", *rest]  # Hydra's command line (-m, --help) reads it
            train_main(rest)  # launcher.nproc > 1: becomes torchrun, never returns
        except KeyboardInterrupt:
            # Ctrl-C while the run is checked, before its job (the job says its own resume line):
            # nothing was written yet, and a traceback of whichever import it hit says nothing
            print("\nflowrl train: interrupted before the run started (no step ran)",
                  file=sys.stderr)
            return 130
        return 0
    try:
        if cmd == "plan":
            from flowrl.plan import plan_main

            return plan_main(rest)
        if cmd == "graph":
            from flowrl.graph.validate import graph_main

            return graph_main(rest, check_interpolations=_interpolations_resolve)
        if cmd == "export":
            from flowrl.export import export_main

            return export_main(rest)
    except BrokenPipeError:  # `flowrl plan | head`: the reader left; nothing more to say
        sys.stdout = open(os.devnull, "w")  # the interpreter's final flush must not raise again
        return 0
    except (ValueError, FileNotFoundError, KeyError) as e:
        why = str(e)  # an error of the command's own names it already ("export: ...")
        print(f"flowrl {cmd}: error: {why.removeprefix(f'{cmd}: ')}", file=sys.stderr)
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



def _interpolations_resolve(graph) -> None:
    """``${...}`` in the stages' ``when`` / ``params`` resolved against the default run config
    (every key a run can set is in it: its schema refuses any other), as ``flowrl train`` resolves
    them against the run's.

    Raises:
        GraphError: naming the stage, the field and the nearest key (``compiler.plan.resolve``).
    """
    from omegaconf import OmegaConf

    from flowrl.compiler.plan import check_interpolations
    from flowrl.config import compose, task_section

    run_cfg = OmegaConf.to_container(task_section(compose([], with_hydra=True),
                                                  "(none: graph validate)"), resolve=True)
    assert isinstance(run_cfg, dict)  # a composed config's container is a mapping
    check_interpolations(graph, run_cfg)

if __name__ == "__main__":
    sys.exit(main())
