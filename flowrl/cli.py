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
            from flowrl.plan import plan_main

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
