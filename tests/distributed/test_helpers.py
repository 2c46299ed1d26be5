"""Single-process behaviour of the distributed helpers, the launcher argv and metric rules."""

import pytest
import torch

from flowrl.config import LauncherConfig
from flowrl.ops import collectives as coll
from flowrl.runtime.control.supervise import torchrun_args
from flowrl.runtime.io import distributed as fdist


def test_world_size_1_is_the_plain_path(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = fdist.init_distributed("cpu", timeout_s=LauncherConfig().collective_timeout_s,
                                  heartbeat_timeout_s=LauncherConfig().heartbeat_timeout_s)
    assert (info.rank, info.world_size, info.group) == (0, 1, None)
    assert not coll.is_initialized()
    assert coll.all_reduce_sum(2.5) == 2.5
    t = torch.tensor([1.0, 2.0])
    assert coll.all_reduce(t, "max") is t
    assert coll.all_reduce_floats([1.0, 3.0]) == [1.0, 3.0]
    assert fdist.reduce_metrics({"a": 1.0}) == {"a": 1.0}
    with pytest.raises(ValueError, match="op must be"):
        coll.all_reduce(1.0, "prod")


def test_metric_rules():
    assert fdist.metric_rule("response/length_max") == "max"
    assert fdist.metric_rule("perf/step_s") == "max"
    assert fdist.metric_rule("time/rollout") == "max"
    assert fdist.metric_rule("reward/unscorable") == "sum"
    assert fdist.metric_rule("perf/rollout_tokens_per_s") == "sum"
    assert fdist.metric_rule("reward/mean") == "mean"
    assert fdist.metric_rule("actor/grad_norm") == "mean"


def test_launcher_argv_and_validation():
    single = torchrun_args(LauncherConfig(nproc=2), ["model=tiny"])
    assert single == ["--nproc_per_node=2", "--standalone", "-m", "flowrl.train", "model=tiny"]
    multi = torchrun_args(LauncherConfig(nproc=4, nnodes=2, rdzv_endpoint="h0:29400",
                                         rdzv_id="j1", max_restarts=1), [])
    assert multi == ["--nproc_per_node=4", "--nnodes=2", "--rdzv_backend=c10d",
                         "--rdzv_endpoint=h0:29400", "--rdzv_id=j1", "--max_restarts=1",
                         "-m", "flowrl.train"]
    assert not LauncherConfig().distributed
    with pytest.raises(ValueError, match="launcher.nproc"):
        LauncherConfig(nproc=0)
    with pytest.raises(ValueError, match="launcher.node_rank"):
        LauncherConfig(nnodes=2, node_rank=2)
