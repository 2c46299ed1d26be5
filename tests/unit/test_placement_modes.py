"""Placement modes as objects (``flowrl/compiler/modes.py``): one registered class per
``placement.mode`` owns place / estimate / render; what ``flowrl plan`` prints is byte for byte
what it printed when the modes were strings (snapshots taken from the string-mode code, commit
8e5ecbb, before the change; the two auto ones retaken when `flowrl plan placement=auto` began to
choose for the measured prompt length, P=56, not the data.max_prompt_tokens bound, 256; the
partitioned ones retaken when the batch became prompts_per_step x n x the rollout ranks, not the
world: a 2-rank plan's transfers were twice what the run sends; the notes now say B), and an
unknown mode is one line with did-you-mean."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from flowrl.cli import main
from flowrl.compiler.modes import MODES, Auto, Colocated, Partitioned, estimate, mode_of, place
from flowrl.compiler.placement import Mode, PlacementConfig, PlacementError, parse_mode
from flowrl.compiler.plan import compile_plan
from flowrl.graph import Graph

SNAPSHOTS = Path(__file__).parent / "plan_snapshots"
REPO = Path(__file__).resolve().parents[2]

# snapshot file -> the `flowrl plan` arguments that printed it
CASES = {
    "grpo-colocated-2.txt": ["graph=grpo", "placement=colocated", "launcher.nproc=2"],
    "grpo-partitioned-2.txt": ["graph=grpo", "placement=partitioned", "launcher.nproc=2"],
    "ppo-partitioned-2.txt": ["graph=ppo", "placement=partitioned", "launcher.nproc=2"],
    "grpo-auto-8.txt": ["graph=grpo", "placement=auto", "launcher.nproc=8"],
    "ppo-auto-8-h200.txt": ["graph=ppo", "placement=auto", "launcher.nproc=8",
                            "placement.auto.device=h200"],
    "grpo-part-4.mermaid": ["graph=grpo", "placement=partitioned", "launcher.nproc=4",
                            "--format", "mermaid"],
    "grpo-part-4.dot": ["graph=grpo", "placement=partitioned", "launcher.nproc=4", "--format", "dot"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_flowrl_plan_prints_what_the_string_modes_printed(name, capsys):
    # trainer.device=cpu: the snapshots were taken on a CPU machine (device profile cpu, fp32)
    assert main(["plan", *CASES[name], "trainer.device=cpu"]) == 0
    out = capsys.readouterr().out
    out = out.split("machine defaults (auto settings")[0]  # the machine's lines follow the plan
    assert out == (SNAPSHOTS / name).read_text()


def test_one_class_registered_per_mode():
    assert set(MODES) == set(Mode) == {"colocated", "partitioned", "auto"}
    assert [type(MODES[m]) for m in Mode] == [Colocated, Partitioned, Auto]
    assert mode_of("partitioned") is MODES[Mode.PARTITIONED]
    assert (Colocated.concurrent_pools, Partitioned.concurrent_pools, Auto.concurrent_pools) == \
        (False, True, False)
    assert (Colocated.single_pool, Partitioned.single_pool, Auto.single_pool) == (True, False, False)


def test_config_mode_is_the_enum():
    pc = PlacementConfig(mode="partitioned")
    assert pc.mode is Mode.PARTITIONED and f"placement={pc.mode}" == "placement=partitioned"
    assert PlacementConfig().mode is Mode.COLOCATED


@pytest.mark.parametrize("bad, hint", [("colo", " (did you mean colocated?)"),
                                       ("partitoned", " (did you mean partitioned?)"),
                                       ("xyz", "")])
def test_unknown_mode_is_one_line_with_did_you_mean(bad, hint):
    msg = f"placement.mode must be one of ('colocated', 'partitioned', 'auto'), got '{bad}'{hint}"
    for call in (lambda: parse_mode(bad), lambda: PlacementConfig(mode=bad), lambda: mode_of(bad)):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == msg


def test_unknown_mode_from_the_command_line(capsys):
    assert main(["plan", "graph=grpo", "placement.mode=colo"]) == 2
    assert capsys.readouterr().err.strip() == (
        "flowrl plan: error: invalid config: placement.mode must be one of ('colocated', "
        "'partitioned', 'auto'), got 'colo' (did you mean colocated?)")


def _grpo():
    cfg = OmegaConf.create({"algorithm": {"kl_coef": 0.0, "recompute_old_logprobs": True},
                            "rollout": {"sampling": {"max_new_tokens": 256}}})
    return compile_plan(Graph.load(REPO / "graphs/grpo.yaml"), cfg)


def test_each_class_places_its_own_plan():
    colo = Colocated().place(_grpo(), PlacementConfig(), 2)
    part = Partitioned().place(_grpo(), PlacementConfig(mode="partitioned"), 4)
    assert (colo.mode, sorted(colo.pools), colo.pools["all"].ranks) == (Mode.COLOCATED, ["all"], [0, 1])
    assert (part.mode, {k: p.ranks for k, p in part.pools.items()}) == \
        (Mode.PARTITIONED, {"rollout": [2, 3], "train": [0, 1]})
    assert place(_grpo(), PlacementConfig(mode="partitioned"), 4).pools["train"].ranks == [0, 1]
    with pytest.raises(PlacementError, match="placement.mode=auto is resolved by"):
        place(_grpo(), PlacementConfig(mode="auto"), 4)
    with pytest.raises(PlacementError, match="launcher.nproc: world size must be >= 1, got 0"):
        place(_grpo(), PlacementConfig(mode="partitioned"), 0)


def test_estimate_dispatches_on_the_plans_mode(monkeypatch):
    """A colocated plan is estimated by Colocated (no broadcast, no transfer), a partitioned one
    by Partitioned; a plan resolved by auto is never estimated as ``auto``."""
    from flowrl.compiler.cost import PlacementEstimate

    class Costs:  # stage seconds 1 each, swaps 0.5, weights 100 B over 10 B/s links
        workload = type("W", (), {"batch": 4, "prompt_tokens": 2, "response_tokens": 3})()
        device = type("D", (), {"link_bw": 10.0, "name": "toy"})()
        sizes = {r: type("S", (), {"weight_bytes": 100 if r == "actor" else 0})() for r in ("actor", "rollout")}
        parallelism: dict = {}
        swap_measured = None

        def stage_seconds(self, s, p):
            return 1.0

        def swap_seconds(self, actions, p):
            return 0.5 * sum(a.kind == "onload" for a in actions)

    # memory is not what this test is about
    monkeypatch.setattr("flowrl.compiler.cost.pool_peak_memory", lambda roles, sizes, p, kv: (0, None))
    monkeypatch.setattr("flowrl.compiler.cost.role_memory", lambda role, size, p, kv: 0)
    colo = estimate(place(_grpo(), PlacementConfig(), 2), Costs())  # type: ignore[arg-type]
    part = estimate(place(_grpo(), PlacementConfig(mode="partitioned"), 2), Costs())  # type: ignore[arg-type]
    assert isinstance(colo, PlacementEstimate)
    # grpo colocated: 6 stages (ref_logprobs pruned) + 2 onloads x 0.5
    assert (colo.step_s, colo.sync_bytes, colo.sync_s, colo.transfer_s) == (6 + 1.0, 0, 0.0, 0.0)
    # partitioned k=0: rollout side 4 stages + train side 2 stages, 100 B / 10 B/s, no swaps
    assert (part.sides, part.sync_bytes, part.sync_s) == ({"rollout": 4.0, "train": 2.0}, 100, 10.0)
    assert part.step_s == pytest.approx(6 + 10.0 + part.transfer_s)
