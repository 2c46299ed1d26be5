"""A graph's own ops: the modules in its ``imports`` register them before any check, from the
directory flowrl runs in (``flowrl.cli.cwd_importable``); ``examples/custom_op`` is the example."""
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flowrl import cli
from flowrl.graph.graph import GraphError
from flowrl.graph.validate import graph_from_yaml, load_graph
from flowrl.ops.context import StageContext
from flowrl.ops.registry import OPS

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_op"


def test_cwd_is_importable_like_python_dash_m(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    cli.cwd_importable()
    assert sys.path[0] == str(tmp_path)
    cli.cwd_importable()  # once
    assert sys.path.count(str(tmp_path)) == 1


def test_the_example_graph_validates_and_plans_from_its_directory(monkeypatch, capsys):
    monkeypatch.chdir(EXAMPLE)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    assert cli.main(["graph", "validate", "grpo_brevity.yaml"]) == 0
    assert capsys.readouterr().out.strip() == "grpo_brevity.yaml: ok"
    assert "reward.brevity" in OPS
    assert load_graph(EXAMPLE / "grpo_brevity.yaml").imports == ["brevity"]


def test_brevity_op_values(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import brevity

    rewards = torch.tensor([1.0, 0.0, float("nan"), 1.0, 1.0])
    lengths = torch.tensor([32, 32, 10, 100, 200])
    mask = torch.arange(200)[None, :] < lengths[:, None]
    ctx = StageContext(stage="brevity", step=1)
    out = brevity.brevity(ctx, brevity.BrevityConfig(max_tokens=64, bonus=0.1), rewards=rewards,
                          response_mask=mask)["rewards"]
    want = [1.1, 0.0, float("nan"), 1.0 + 0.1 * (2 - 100 / 64), 1.0]
    assert all(math.isnan(a) if math.isnan(b) else a == pytest.approx(b, abs=1e-6)
               for a, b in zip(out.tolist(), want))
    assert ctx.metrics["reward/brevity/bonus_mean"] == pytest.approx((0.1 + 0.1 * (2 - 100 / 64)) / 5)


def test_a_module_that_does_not_import_is_one_line_naming_imports():
    text = textwrap.dedent("""\
        name: g
        imports: [no_such_module_xyz]
        stages:
        - name: sample
          op: data.sample
        """)
    with pytest.raises(GraphError) as e:
        graph_from_yaml(text)
    assert str(e.value) == "field 'imports': cannot import 'no_such_module_xyz': " \
           "ModuleNotFoundError: No module named 'no_such_module_xyz' (looked in the working " \
           "directory, the graph file's directory and sys.path)"


def test_imports_must_be_a_list_of_names():
    with pytest.raises(GraphError) as e:
        graph_from_yaml("name: g\nimports: brevity\nstages:\n- name: sample\n  op: data.sample\n")
    assert "field 'imports': must be a list of module names (e.g. [my_ops]), got 'brevity'" \
        in str(e.value)


def test_round_trip_keeps_imports():
    g = load_graph(EXAMPLE / "grpo_brevity.yaml")
    assert graph_from_yaml(g.to_yaml()).imports == ["brevity"]


def test_imports_are_found_beside_the_graph_file(tmp_path, monkeypatch):
    """Validated from another directory, the graph's modules are looked for beside it."""
    here = tmp_path / "graphdir"
    here.mkdir()
    (here / "beside_ops_mod.py").write_text(textwrap.dedent("""\
        from flowrl.ops.registry import register_op

        @register_op("test.beside_identity", inputs=("rewards",), outputs=("rewards",))
        def identity(ctx, cfg, *, rewards):
            return {"rewards": rewards}
        """))
    text = (EXAMPLE / "grpo_brevity.yaml").read_text().replace("- brevity\n", "- beside_ops_mod\n")
    text = text.replace("op: reward.brevity", "op: test.beside_identity").replace(
        "    response_mask: rollout.response_mask\n  params:\n    max_tokens: 64\n    bonus: 0.1\n",
        "")
    (here / "g.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the graph's directory is appended
    assert load_graph(here / "g.yaml").imports == ["beside_ops_mod"]
    assert "test.beside_identity" in OPS


def test_a_failed_import_is_the_only_problem_of_its_ops(tmp_path):
    """No second, misleading 'unknown op' line for the op the module would register."""
    text = (EXAMPLE / "grpo_brevity.yaml").read_text().replace("- brevity\n", "- not_here_mod\n")
    (tmp_path / "g.yaml").write_text(text)
    with pytest.raises(GraphError) as e:
        load_graph(tmp_path / "g.yaml")
    assert str(e.value) == (
        f"{tmp_path / 'g.yaml'}: field 'imports': cannot import 'not_here_mod': "
        "ModuleNotFoundError: No module named 'not_here_mod' (looked in the working directory, "
        "the graph file's directory and sys.path)")
