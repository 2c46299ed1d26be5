"""The layers of DESIGN.md hold: import-linter's contracts in pyproject.toml (layers, the runtime's
own layers, no torch under graph validation and plans, no cycles between siblings), and validating
or compiling a graph imports no torch in a fresh interpreter."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    # the subprocess analyses / imports this checkout's flowrl, not an installed copy
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def test_import_contracts_are_kept():
    import importlinter  # noqa: F401  (in the test extras: pip install -e .[test])

    out = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports;"
                          " sys.exit(lint_imports(no_cache=True))"],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken." in out.stdout


def test_validating_and_compiling_graphs_imports_no_torch():
    code = """
import sys
from pathlib import Path
from omegaconf import OmegaConf
from flowrl.graph import Graph, validate_graph
from flowrl.compiler.plan import compile_plan
import warnings
warnings.simplefilter("ignore")
files = sorted(Path("graphs").glob("*.yaml"))
for f in files:
    validate_graph(Graph.load(f))
cfg = OmegaConf.create({"algorithm": {"kl_coef": 0.0, "recompute_old_logprobs": True},
                        "rollout": {"sampling": {"max_new_tokens": 256}}})
for f in files:
    compile_plan(Graph.load(f), cfg)
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "transformers")))
print(len(files), loaded)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    n, loaded = out.stdout.split(" ", 1)
    assert int(n) >= 8 and loaded.strip() == "[]"  # not torch.distributed, not torch at all


def test_the_acyclic_contract_covers_every_package():
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (acyclic,) = [c for c in contracts if c["type"] == "acyclic_siblings"]
    packages = sorted(".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "flowrl").rglob("__init__.py"))
    assert sorted(acyclic["ancestors"]) == packages


def _sibling_cycles(graph, package: str) -> list[list[str]]:
    import networkx as nx

    children = sorted(graph.find_children(package))
    g = nx.DiGraph()
    g.add_nodes_from(children)
    g.add_edges_from((a, b) for a in children for b in children
                     if a != b and graph.direct_import_exists(importer=a, imported=b, as_packages=True))
    return sorted(sorted(c) for c in nx.simple_cycles(g))


def test_no_sibling_cycle_even_through_type_checking_imports():
    """The contracts skip imports under ``if TYPE_CHECKING:`` (an annotation is no run-time
    dependency), which hid two circles: ``compiler.plan`` imported ``render`` (in a function) and
    ``render`` imported ``plan`` (for types); ``runtime.step.executor`` imported ``refill`` (in a
    function) and ``refill`` imported ``executor`` (for types). Counting every import, the
    compiler's and the runtime's modules form no cycle: render reads the plan, the refill loop
    types its executor by the ``StageRunner`` Protocol it declares."""
    import grimp

    graph = grimp.build_graph("flowrl", exclude_type_checking_imports=False, cache_dir=None)
    assert _sibling_cycles(graph, "flowrl.compiler") == []
    for package in ("flowrl.runtime", *(f"flowrl.runtime.{p}" for p in ("control", "step", "io"))):
        assert _sibling_cycles(graph, package) == [], package
