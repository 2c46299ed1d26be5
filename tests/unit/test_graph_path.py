"""Which graph file ``graph.path`` names (``GraphConfig.resolve``): the working directory's first,
then flowrl's own; a working-directory file that shadows a built-in one is said once."""
import logging

from flowrl.config import REPO_ROOT, GraphConfig


def test_a_local_graph_shadowing_a_builtin_is_said_once(tmp_path, monkeypatch, caplog):
    (tmp_path / "graphs").mkdir()
    local = tmp_path / "graphs" / "grpo.yaml"
    local.write_text((REPO_ROOT / "graphs" / "grpo.yaml").read_text() + "# my copy\n")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="flowrl"):
        assert GraphConfig(path="graphs/grpo.yaml").resolve() == local.resolve()
        assert GraphConfig(path="graphs/grpo.yaml").resolve() == local.resolve()  # said once
    assert [r.getMessage() for r in caplog.records] == [
        f"graph.path=graphs/grpo.yaml: using {local.resolve()} from the working directory, not "
        f"flowrl's own {(REPO_ROOT / 'graphs' / 'grpo.yaml').resolve()}"]


def test_the_builtin_graph_from_anywhere_says_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="flowrl"):
        assert GraphConfig(path="graphs/ppo.yaml").resolve() == (REPO_ROOT / "graphs/ppo.yaml").resolve()
    monkeypatch.chdir(REPO_ROOT)  # the repository's own file is the built-in one
    with caplog.at_level(logging.WARNING, logger="flowrl"):
        GraphConfig(path="graphs/grpo.yaml").resolve()
    assert not caplog.records
