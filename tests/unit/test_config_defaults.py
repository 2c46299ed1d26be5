"""Defaults live once, in the dataclasses (flowrl/config.py and the sections it imports): a YAML
file of conf/ (and a graph's ``algorithm`` block) states only what differs from them."""
from pathlib import Path

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

from flowrl.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
CONF_FILES = sorted((REPO / "conf").rglob("*.yaml"))
GRAPH_FILES = sorted((REPO / "graphs").glob("*.yaml"))


def package(path: Path) -> list[str]:
    """Where a conf file's keys land: ``# @package _global_`` = the root, else its group."""
    if path.name == "train.yaml" or "# @package _global_" in path.read_text().splitlines()[:3]:
        return []
    return list(path.relative_to(REPO / "conf").parent.parts)


def repeats(node, default, prefix: str) -> list[str]:
    """Dotted keys whose value equals the schema default at the same place (interpolations and
    sections the schema leaves None/free-form never count as repeats)."""
    out = []
    for key in node:
        key = str(key)
        if key in ("defaults", "hydra"):
            continue
        value = node._get_node(key)
        if not isinstance(default, DictConfig) or key not in default or \
                OmegaConf.is_interpolation(node, key) or OmegaConf.is_interpolation(default, key):
            continue
        d = default._get_node(key)
        if d._is_none() or d._is_missing():
            if not isinstance(value, DictConfig) and value._is_none() and d._is_none():
                out.append(f"{prefix}{key}")  # null where the default is None
            continue
        if isinstance(value, DictConfig):
            out += repeats(value, d, f"{prefix}{key}.")
        elif isinstance(value, ListConfig) or isinstance(d, ListConfig):
            if isinstance(d, ListConfig) and OmegaConf.to_container(value) == OmegaConf.to_container(d):
                out.append(f"{prefix}{key}")
        elif value._value() == d._value():
            out.append(f"{prefix}{key}")
    return out


def schema_at(keys: list[str]):
    node = OmegaConf.structured(TrainConfig)
    for k in keys:
        node = node[k]
    return node


def test_the_check_finds_a_repeated_default():
    yaml = OmegaConf.create({"sampling": {"top_p": 1.0, "temperature": 0.5}, "backend": "${x}"})
    assert repeats(yaml, schema_at(["rollout"]), "rollout.") == ["rollout.sampling.top_p"]
    assert repeats(OmegaConf.create({"n": 4.0}), schema_at(["algorithm"]), "") == ["n"]


@pytest.mark.parametrize("path", CONF_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_conf_file_states_only_what_differs_from_the_dataclass(path):
    keys = package(path)
    prefix = "".join(f"{k}." for k in keys)
    found = repeats(OmegaConf.load(path), schema_at(keys), prefix)
    assert found == [], f"{path.relative_to(REPO)} repeats the dataclass default of {found}"


@pytest.mark.parametrize("path", GRAPH_FILES, ids=lambda p: p.name)
def test_graph_algorithm_block_states_only_what_differs(path):
    block = OmegaConf.load(path).get("algorithm") or OmegaConf.create({})
    found = repeats(block, schema_at(["algorithm"]), "algorithm.")
    assert found == [], f"{path.name} repeats the AlgorithmConfig default of {found}"
