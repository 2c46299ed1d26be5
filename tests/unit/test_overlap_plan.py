"""placement.staleness=1 on a colocated run (runtime/control/overlap.py): how the plan is cut,
what is refused before any model loads, how the two halves' metrics merge."""
import re
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.compiler.modes import place
from flowrl.compiler.placement import PlacementConfig, PlacementError
from flowrl.compiler.plan import compile_plan
from flowrl.config import compose
from flowrl.graph.graph import Graph
from flowrl.runtime.control.overlap import merge_halves
from flowrl.train import ConfigError, prepare

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
BASE = ["model=tiny", "trainer=smoke", "trainer.output_dir=/tmp/unused"]


def plan_of(name: str, **algorithm):
    return compile_plan(Graph.load(GRAPHS / f"{name}.yaml"),
                        {"algorithm": {"kl_coef": 0.01, "recompute_old_logprobs": True, **algorithm}})


def test_colocated_staleness_1_cuts_the_plan_as_partitioned_does():
    plan = plan_of("grpo")
    pp = place(plan, PlacementConfig(mode="colocated", staleness=1), 1)
    split = place(plan, PlacementConfig(mode="partitioned"), 2)
    assert pp.overlapped and pp.staleness == 1 and list(pp.pools) == ["all"]
    assert pp.halves["rollout"].plan.order == ["sample", "rollout", "reward", "advantage"]
    assert pp.halves["train"].plan.order == ["ref_logprobs", "old_logprobs", "update"]
    assert pp.halves["rollout"].ranks == pp.halves["train"].ranks == [0]
    assert pp.transfers == split.transfers and pp.halves["rollout"].sends == split.transfers
    assert pp.pools["all"].plan is plan and pp.weight_sync == [("actor", "rollout")]
    assert not place(plan, PlacementConfig(mode="colocated"), 1).overlapped


@pytest.mark.parametrize("graph, staleness, msg", [
    ("grpo", 2, "placement.staleness=2 with placement=colocated: the rollout can run at most one "
                "step ahead of the update on the same devices (set placement.staleness=1, or "
                "placement=partitioned for a deeper queue between two pools)"),
])
def test_overlaps_the_colocated_runtime_cannot_run(graph, staleness, msg):
    with pytest.raises(PlacementError) as e:
        place(plan_of(graph), PlacementConfig(mode="colocated", staleness=staleness), 1)
    assert str(e.value) == msg


@pytest.mark.parametrize("extra, msg", [
    (["algorithm.recompute_old_logprobs=false"],
     "placement.staleness=1 trains on batches one weight version old: the trainer must recompute "
     "old logprobs (set algorithm.recompute_old_logprobs=true, or placement.staleness=0)"),
    (["trainer.offload=always"],
     "trainer.offload=always with placement.staleness=1: the rollout runs while the update does, "
     "so no model can leave the device (set trainer.offload=auto or never, or placement.staleness=0)"),
])
def test_overlap_settings_are_refused_before_any_model_loads(extra, msg):
    with pytest.raises(ConfigError) as e:
        prepare(compose(BASE + ["placement.staleness=1", *extra]))
    assert msg in str(e.value)
    prepare(compose(BASE + ["placement.staleness=0", *extra]))  # on-policy: both are fine


def test_merge_halves_keeps_each_half_under_its_pool_name():
    rollout = {"time/rollout": 2.0, "perf/step_s": 2.5, "store/peak_bytes": 10.0, "reward/mean": 0.5}
    train = {"time/update": 1.0, "perf/step_s": 1.5, "store/peak_bytes": 30.0,
             "perf/peak_device_gib": 4.0}
    assert merge_halves(rollout, train) == {
        "time/rollout": 2.0, "reward/mean": 0.5, "time/update": 1.0, "perf/peak_device_gib": 4.0,
        "perf/step_s": 1.5, "store/peak_bytes": 30.0,
        "perf/step_s/rollout": 2.5, "store/peak_bytes/rollout": 10.0,
        "perf/step_s/train": 1.5, "store/peak_bytes/train": 30.0, "perf/peak_device_gib/train": 4.0}


def test_flowrl_plan_says_what_runs_beside_what(capsys):
    assert main(["plan", "model=tiny", "placement.staleness=1"]) == 0
    out = capsys.readouterr().out
    assert ("Overlap (placement.staleness=1, one-step off-policy): the rollout half (sample -> "
            "rollout -> reward -> advantage) of step s+1 runs beside the train half (old_logprobs "
            "-> update) of step s, with the weights of update s-1") in out
    # the step is the longer half; the memory every model at once (nothing is swapped)
    step = float(re.search(r"step ([\d.]+) s\n", out).group(1))
    rollout, train = (float(x) for x in re.search(r"= max\(rollout=([\d.]+)s train=([\d.]+)s\)",
                                                   out).groups())
    assert step == pytest.approx(max(rollout, train), rel=0.01)
    resident = re.search(r"every model resident \(no swaps\) ([\d.]+ MiB)", out).group(1)
    assert f"Predicted peak memory per device: pool all {resident}\n" in out


def test_a_partitioned_staleness_needs_recomputed_old_logprobs():
    """The same refusal for a partitioned run's queue, in the singular for one version (it said
    "1 weight versions old")."""
    with pytest.raises(ConfigError) as e:
        prepare(compose(BASE + ["placement=partitioned", "launcher.nproc=2", "placement.staleness=1",
                                "algorithm.recompute_old_logprobs=false"]))
    assert str(e.value).startswith("placement.staleness=1 trains on batches up to 1 weight version "
                                   "old: the trainer must recompute old logprobs (set ")
