"""The executor's offload keeps the actor's weights on the device only when the rollout engine
really reads the actor's module (HF shared=True); a rollout engine with its own copy (vLLM, FSDP)
must not pin them there."""
from pathlib import Path

import pytest
import torch

from flowrl.compiler.plan import compile_plan
from flowrl.graph import Graph
from flowrl.runtime.step.executor import Executor
from flowrl.runtime.step.resources import Engines

GRPO = Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml"


class FakeTrain:
    device = torch.device("cpu")

    def __init__(self):
        self.calls = []

    def offload(self, keep_weights=False):
        self.calls.append(("offload", keep_weights))

    def onload(self):
        self.calls.append(("onload",))


class FakeRollout:
    device = torch.device("cpu")

    def __init__(self, shared):
        self.shared = shared

    def offload(self, keep_weights=False):
        pass

    def onload(self):
        pass


@pytest.mark.parametrize("shared,kept", [(True, True), (False, False)])
def test_keep_weights_only_when_rollout_shares_the_module(shared, kept):
    plan = compile_plan(Graph.load(GRPO), {"algorithm": {"kl_coef": 0.0,
                                                         "recompute_old_logprobs": True}})
    actor = FakeTrain()
    ex = Executor(plan, Engines(actor=actor, rollout=FakeRollout(shared)), {})
    ex.ensure_resident("rollout")  # the swap before a rollout: actor offloaded
    assert actor.calls == [("offload", kept)]


class TimedSource(FakeTrain):
    def __init__(self):
        super().__init__()
        # an earlier offload's time must not be reported as part of the sync
        self.last_timings = {"offload_s": 9.0}

    def named_weights(self):
        yield "w", torch.ones(2)
        self.last_timings = {"gather_s": 0.25, "gather_bytes": 8.0}


class TimedSink(FakeRollout):
    def __init__(self):
        super().__init__(shared=False)
        self.loaded = []

    def load_weights(self, named_tensors):
        self.loaded = [n for n, _ in named_tensors]
        self.last_timings = {"engine_load_weights_s": 0.5, "ipc_collect_s": 0.125,
                             "load_weights_s": 0.75}


def test_sync_reports_the_bytes_and_the_parts_of_the_load():
    plan = compile_plan(Graph.load(GRPO), {"algorithm": {"kl_coef": 0.0,
                                                         "recompute_old_logprobs": True}})
    src, sink = TimedSource(), TimedSink()
    ex = Executor(plan, Engines(actor=src, rollout=sink), {})
    assert ex._sync("actor", "rollout") == {
        "perf/weight_sync_bytes": 8.0, "perf/weight_sync/gather_s": 0.25,
        "perf/weight_sync/engine_load_weights_s": 0.5, "perf/weight_sync/ipc_collect_s": 0.125,
        "perf/weight_sync/load_weights_s": 0.75}
    assert sink.loaded == ["w"]
