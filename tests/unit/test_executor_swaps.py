"""The executor's offload keeps the actor's weights on the device only when the rollout engine
really reads the actor's module (HF shared=True); a rollout engine with its own copy (vLLM, FSDP)
must not pin them there."""
from pathlib import Path

import pytest
import torch

from flowrl.compiler.plan import compile_plan
from flowrl.graph import Graph
from flowrl.runtime.executor import Executor
from flowrl.runtime.resources import Engines

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
