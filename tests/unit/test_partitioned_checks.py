"""Partitioned runtime pieces that need no process group: config rejection before models load,
batch concatenation across rollout ranks, per-pool metric names."""
import pytest
import torch

from flowrl.config import compose
from flowrl.runtime.control.partitioned import (
    check_partitioned,
    concat_batches,
    merge_rank_metrics,
    pool_metrics,
)
from flowrl.runtime.control.preflight import prepare_placement
from flowrl.train import ConfigError, prepare

BASE = ["model=tiny", "trainer=smoke", "trainer.output_dir=/tmp/unused", "placement=partitioned"]


def test_staleness_without_recomputed_old_logprobs_is_rejected_in_prepare():
    with pytest.raises(ConfigError, match=r"placement.staleness=1 .*algorithm.recompute_old_logprobs"):
        prepare(compose(BASE + ["launcher.nproc=2", "placement.staleness=1",
                                "algorithm.recompute_old_logprobs=false"]))
    prepare(compose(BASE + ["launcher.nproc=2", "placement.staleness=0",
                            "algorithm.recompute_old_logprobs=false"]))  # k = 0 is on-policy


def test_pool_shapes_the_runtime_cannot_run():
    with pytest.raises(ConfigError, match="larger pool's size must be a multiple"):
        prepare(compose(BASE + ["launcher.nproc=5", "placement.pools.train=[0,1]",
                                "placement.pools.rollout=[2,3,4]"]))
    spec = prepare(compose(BASE + ["launcher.nproc=3", "placement.pools.train=[0]",
                                        "placement.pools.rollout=[1,2]"]))
    cfg, plan = spec.config, spec.plan
    check_partitioned(prepare_placement(cfg, plan, 3))  # two rollout ranks feed one trainer
    spec = prepare(compose(BASE + ["launcher.nproc=3", "placement.pools.train=[0,1]",
                                        "placement.pools.rollout=[2]"]))
    cfg, plan = spec.config, spec.plan
    check_partitioned(prepare_placement(cfg, plan, 3))  # one rollout rank feeds 2 FSDP ranks


def test_concat_pads_prompts_left_and_responses_right():
    a = {"sample.prompt_ids": torch.tensor([[0, 5]]), "rollout.response_ids": torch.tensor([[7, 8, 9]]),
         "rollout.truncated": torch.tensor([True]), "sample.ground_truth": ["1"]}
    b = {"sample.prompt_ids": torch.tensor([[3, 4, 5]]), "rollout.response_ids": torch.tensor([[6]]),
         "rollout.truncated": torch.tensor([False]), "sample.ground_truth": ["2"]}
    out = concat_batches([a, b])
    assert out["sample.prompt_ids"].tolist() == [[0, 0, 5], [3, 4, 5]]
    assert out["rollout.response_ids"].tolist() == [[7, 8, 9], [6, 0, 0]]
    assert out["rollout.truncated"].tolist() == [True, False]
    assert out["sample.ground_truth"] == ["1", "2"]


def test_pool_metric_names_and_merge():
    m = pool_metrics({"store/peak_bytes": 10.0, "perf/step_s": 2.0, "time/rollout": 1.5,
                      "time/reward": 0.25, "reward/mean": 0.5}, "rollout")
    assert m == {"store/peak_bytes/rollout": 10.0, "perf/step_s/rollout": 2.0, "time/rollout": 1.5,
                 "time/reward": 0.25, "reward/mean": 0.5, "perf/busy_s/rollout": 1.75}
    merged = merge_rank_metrics([{"reward/mean": 0.2, "data/prompts": 2, "time/rollout": 1.0},
                                 {"reward/mean": 0.4, "data/prompts": 2, "time/rollout": 3.0}])
    assert merged == pytest.approx({"reward/mean": 0.3, "data/prompts": 4.0, "time/rollout": 3.0})
