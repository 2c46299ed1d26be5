"""A graph built in Python is checked with the rules of `flowrl graph validate` by
`validate_graph` (the example and the README call it: the builder takes a duplicate name, an
unknown op and an unknown role without a word until `flowrl train` reads the file; fresh-user
report)."""
import pytest

from flowrl.graph import Graph, GraphError, validate_graph


def test_a_built_graph_validates_like_a_file():
    g = Graph("x")
    g.stage("s", "data.sample")
    g.stage("s", "rollout.generat", role="rollot")
    with pytest.raises(GraphError) as e:
        validate_graph(g)
    assert str(e.value).splitlines() == [
        "stage 's', field 'name': duplicate stage name; rename one of them",
        "stage 's', field 'op': unknown op 'rollout.generat' (did you mean 'rollout.generate'?)",
        "stage 's', field 'role': unknown role 'rollot' (did you mean 'rollout'?); known: "
        "['actor', 'critic', 'genrm', 'ref', 'reward_model', 'rollout', 'teacher', "
        "'teacher_rollout']"]


def test_the_python_api_example_validates():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "python_api.py"
    spec = importlib.util.spec_from_file_location("python_api", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert validate_graph(module.overlong_grpo_graph()) == []
