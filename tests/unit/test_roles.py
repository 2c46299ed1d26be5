"""The role table (``flowrl/graph/roles.ROLES`` + ``flowrl/runtime/step/resources.ENGINE_BUILDERS``)
covers every role: a role a graph file names, a declared role without a builder or an
``Engines`` field, or a field typed by another Protocol than its entry fails here."""
import dataclasses
import typing
from pathlib import Path

import yaml

from flowrl.compiler.placement import DEFAULT_ROLE_POOL
from flowrl.engines import base
from flowrl.graph.roles import ROLES, TRAINED_ROLES
from flowrl.runtime.step.resources import ENGINE_BUILDERS, TRAINABLE_ROLES, Engines

REPO = Path(__file__).resolve().parents[2]


def _graph_roles() -> set[str]:
    roles = set()
    for f in sorted((REPO / "graphs").glob("*.yaml")):
        for stage in yaml.safe_load(f.read_text())["stages"]:
            if stage.get("role"):
                roles.add(stage["role"])
    return roles


def test_every_role_of_the_graph_files_is_in_the_table():
    used = _graph_roles()
    assert used == {"actor", "critic", "genrm", "ref", "rollout", "teacher", "teacher_rollout"}
    assert used <= set(ROLES) and used <= set(ENGINE_BUILDERS)


def test_table_builders_and_engines_fields_name_the_same_roles():
    fields = [f.name for f in dataclasses.fields(Engines)]
    assert sorted(ROLES) == sorted(ENGINE_BUILDERS) == sorted(fields) == [
        "actor", "critic", "genrm", "ref", "reward_model", "rollout", "teacher", "teacher_rollout"]


def test_each_engines_field_is_typed_by_its_entrys_protocol():
    hints = typing.get_type_hints(Engines, {**vars(base), "Optional": typing.Optional})
    for role, spec in ROLES.items():
        proto = getattr(base, spec.protocol)
        assert proto._is_protocol  # a Protocol of engines/base.py
        assert hints[role] == typing.Optional[proto], role


def test_what_the_table_derives():
    assert TRAINED_ROLES == TRAINABLE_ROLES == ("actor", "critic")
    assert DEFAULT_ROLE_POOL == {"actor": "train", "critic": "train", "ref": "train",
                                 "teacher": "train", "teacher_rollout": "rollout",
                                 "rollout": "rollout", "reward_model": "rollout", "genrm": "rollout"}
    assert [r for r, s in ROLES.items() if s.synced] == ["rollout"]
    assert ROLES["rollout"].weights_from == "actor"
    # the rollout engine is built last; only builders reading `model` after the actor make it copy
    assert list(ENGINE_BUILDERS)[0] == "actor" and list(ENGINE_BUILDERS)[-1] == "rollout"
    assert sorted(r for r, b in ENGINE_BUILDERS.items() if b.reads_model) == ["critic", "genrm", "rollout"]


def test_engines_sets_and_syncs_by_the_table():
    class Fake:
        def __init__(self):
            self.closed = 0

        def close(self):
            self.closed += 1

    actor, rollout, critic, genrm = Fake(), Fake(), Fake(), Fake()
    e = Engines(actor=actor, rollout=rollout, critic=critic, genrm=genrm)  # type: ignore[arg-type]
    assert list(e.by_role()) == ["actor", "critic", "rollout", "genrm"]
    assert e.trainable() == {"actor": actor, "critic": critic}
    assert e.weight_source("actor") is actor and e.weight_sink("rollout") is rollout
    for bad in ("critic", "ref", "nope"):
        try:
            e.weight_source(bad)
            raise AssertionError(bad)
        except KeyError as err:
            assert str(err) == f'"no trained engine serves weights as role {bad!r} on this rank"'
    for bad in ("actor", "genrm"):  # genrm generates but is never synced
        try:
            e.weight_sink(bad)
            raise AssertionError(bad)
        except KeyError as err:
            assert str(err) == f'"no generation engine takes weights as role {bad!r} on this rank"'

    e.close()
    assert (actor.closed, rollout.closed, critic.closed, genrm.closed) == (1, 1, 1, 1)
    assert e.by_role() == {}
