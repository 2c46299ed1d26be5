"""Malformed graphs and configs (issue 15, item 10): each rejected before any model loads, in
one line that names the field and what to change."""
from __future__ import annotations

import re

import pytest

from flowrl.cli import compose
from flowrl.config import to_train_config
from flowrl.graph import Graph, GraphError

STAGE = {"name": "sample", "op": "data.sample"}


@pytest.mark.parametrize("override, message", [
    ("+algorithm.kl_coeff=0.5", "unknown key algorithm.kl_coeff (did you mean algorithm.kl_coef?)"),
    ("+trainer.engine.lrr=1e-5", "unknown key trainer.engine.lrr (did you mean trainer.engine.lr?)"),
    ("+nonsense=1", "unknown key nonsense: nothing reads it"),
])
def test_an_appended_unknown_key_is_rejected_not_ignored(tmp_path, override, message):
    """Hydra's `+key=` adds a key without checking its name: KL silently stayed off."""
    cfg = compose([override, f"trainer.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match=re.escape(message)):
        to_train_config(cfg)


def test_known_keys_and_free_form_sections_still_pass(tmp_path):
    cfg = to_train_config(compose(["algorithm.kl_coef=0.1", "+launcher=multinode",
                                   f"trainer.output_dir={tmp_path}"]))
    assert cfg.algorithm.kl_coef == 0.1 and cfg.launcher.nnodes == 2


@pytest.mark.parametrize("weight_sync", ["update", 3, {"from": "update", "to": "rollout"}])
def test_weight_sync_that_is_not_a_list_is_one_clear_problem(weight_sync):
    with pytest.raises(GraphError) as e:
        Graph.from_dict({"name": "g", "stages": [STAGE], "weight_sync": weight_sync})
    assert e.value.problems == [("<graph>", "weight_sync", "must be a list of {from, to, "
                                 "staleness} mappings, got a " + type(weight_sync).__name__)]


@pytest.mark.parametrize("field, value, shape", [
    ("inputs", ["sample.prompt_ids"], "op argument: stage.output"),
    ("params", "lr=1", "config field: value"),
])
def test_inputs_or_params_that_are_not_a_mapping_say_what_to_write(field, value, shape):
    with pytest.raises(GraphError) as e:
        Graph.from_dict({"name": "g", "stages": [{**STAGE, field: value}]})
    assert e.value.problems == [("sample", field, f"must be a mapping ({shape} lines), got a "
                                 f"{type(value).__name__}")]
