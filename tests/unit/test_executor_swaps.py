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
    assert ex.sync_weights("actor", "rollout") == {
        "perf/weight_sync_bytes": 8.0, "perf/weight_sync/gather_s": 0.25,
        "perf/weight_sync/engine_load_weights_s": 0.5, "perf/weight_sync/ipc_collect_s": 0.125,
        "perf/weight_sync/load_weights_s": 0.75}
    assert sink.loaded == ["w"]


class ReadbackSink(FakeRollout):
    """Holds what it is sent; ``stale`` makes later loads keep nothing (a broken sync)."""

    def __init__(self):
        super().__init__(shared=False)
        self.held: dict[str, torch.Tensor] = {}
        self.stale = False
        self.last_timings: dict[str, float] = {}

    def load_weights(self, named_tensors):
        for n, t in named_tensors:
            if not self.stale:
                self.held[n] = t.clone()

    def weight_samples(self, index):
        return {n: self.held[n].flatten()[i] for n, i in index.items()}


class ChangingSource(FakeTrain):
    def __init__(self):
        super().__init__()
        self.version = 0.0
        self.last_timings = {}
        self.model = torch.nn.Linear(2, 2)  # no LoRA layers: check_effective has nothing to judge

    def named_weights(self):
        self.version += 1.0
        yield "w", torch.full((8,), self.version)


def test_the_first_sync_and_every_nth_are_checked():
    """``rollout.verify_sync_every=3``: syncs 1, 4, 7 of the process are read back (a check costs
    a round trip per engine, 0.46 s for the 0.5B shape on the H200); a broken load between two
    checks is caught at the next one."""
    from flowrl.runtime.step.weight_check import WeightSyncError

    plan = compile_plan(Graph.load(GRPO), {"algorithm": {"kl_coef": 0.0,
                                                         "recompute_old_logprobs": True}})
    src, sink = ChangingSource(), ReadbackSink()
    ex = Executor(plan, Engines(actor=src, rollout=sink), {}, verify_sync=True, verify_sync_every=3)
    checked = [ex.sync_weights("actor", "rollout", step)["perf/weight_sync_checked"] for step in (1, 2, 3)]
    assert checked == [1.0, 0.0, 0.0]
    sink.stale = True  # syncs 4 on keep the engine at version 3
    with pytest.raises(WeightSyncError, match="after step 4"):
        ex.sync_weights("actor", "rollout", 4)
    every = Executor(plan, Engines(actor=ChangingSource(), rollout=ReadbackSink()), {},
                     verify_sync=True)  # the executor's own default: every sync
    assert [every.sync_weights("actor", "rollout")["perf/weight_sync_checked"] for _ in range(2)] == [1.0, 1.0]


def test_verify_sync_every_below_one_is_refused():
    from flowrl.config import RolloutConfig

    assert RolloutConfig().verify_sync_every == 100
    with pytest.raises(ValueError, match="rollout.verify_sync_every must be >= 1, got 0"):
        RolloutConfig(verify_sync_every=0)


class CountingRollout(FakeRollout):
    def __init__(self):
        super().__init__(shared=False)
        self.calls = []

    def offload(self, keep_weights=False):
        self.calls.append(("offload", keep_weights))

    def onload(self):
        self.calls.append(("onload",))


@pytest.mark.parametrize("swap, actor_calls, rollout_calls", [
    # trainer.offload=always: every role moves at both swap points of the GRPO plan
    ("all", [("offload", False), ("onload",)], [("onload",), ("offload", False)]),
    # trainer.offload=rollout: the vLLM engine sleeps for the update, the actor never moves
    ("generate", [], [("onload",), ("offload", False)]),
    # trainer.offload=never / auto with room: nothing moves
    ("none", [], []),
])
def test_swap_mode_decides_which_engines_move(swap, actor_calls, rollout_calls):
    """One GRPO step's swap points (offload actor, onload rollout before the rollout; offload
    rollout, onload actor before old_logprobs) under each ``swap`` mode."""
    plan = compile_plan(Graph.load(GRPO), {"algorithm": {"kl_coef": 0.0,
                                                         "recompute_old_logprobs": True}})
    actor, rollout = FakeTrain(), CountingRollout()
    ex = Executor(plan, Engines(actor=actor, rollout=rollout), {}, swap=swap)
    ex.ensure_resident("rollout")
    assert ex.resident == ({"rollout"} if swap == "all" else {"actor", "rollout"})
    ex.ensure_resident("actor")
    assert actor.calls == actor_calls and rollout.calls == rollout_calls
    # a role that moved is resident only while onloaded; a role that never moves stays resident
    assert ex.resident == ({"actor"} if swap in ("all", "generate") else {"actor", "rollout"})


def test_an_unknown_swap_mode_is_refused():
    plan = compile_plan(Graph.load(GRPO), {"algorithm": {"kl_coef": 0.0,
                                                         "recompute_old_logprobs": True}})
    with pytest.raises(ValueError, match="swap must be one of"):
        Executor(plan, Engines(actor=FakeTrain(), rollout=CountingRollout()), {}, swap=True)


@pytest.mark.parametrize("offload, expected", [
    ("always", "all"), ("never", "none"), ("rollout", "generate"), ("auto", "none")])
def test_trainer_offload_resolves_to_the_executors_swap(offload, expected):
    """On CPU ``auto`` is none (nothing to free); the explicit modes map one to one."""
    from flowrl.config import TrainConfig, TrainerConfig
    from flowrl.runtime.step.resources import resolve_offload

    cfg = TrainConfig(trainer=TrainerConfig(offload=offload, device="cpu"))
    swap, why = resolve_offload(cfg, Engines())
    assert swap == expected
    assert why == ("CPU run: nothing to free" if offload == "auto" else f"trainer.offload={offload}")


def test_trainer_offload_names_its_choices():
    from flowrl.config import TrainerConfig

    with pytest.raises(ValueError, match="auto, always, never or rollout, got 'sometimes'"):
        TrainerConfig(offload="sometimes")
