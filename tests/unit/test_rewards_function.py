"""The user reward-function contract: a function by import path, failures (raise, non-finite,
non-number, timeout, a worker that ignores the alarm) become NaN and are counted; the run goes on.

The functions below are the "user's" (this module is importable as ``test_rewards_function``
by spawned pool workers too: pytest puts this folder on sys.path).
"""
import logging
import math
import signal
import time

import pytest
import torch

from flowrl.ops.context import StageContext
from flowrl.ops.registry import get_op
from flowrl.rewards.function import (
    ERROR,
    KILL_GRACE_S,
    NONFINITE,
    OK,
    TIMEOUT,
    RewardFunctionRunner,
    load_reward_function,
    to_components,
)

MOD = "test_rewards_function"


def length_reward(response_text, fields, metadata):
    return len(response_text) / 10.0


def components(response_text, fields, metadata):
    return {"correct": 1.0 if response_text.strip() == fields["ground_truth"] else 0.0,
            "group": float(metadata["group_id"])}


def raises(response_text, fields, metadata):
    if "bad" in response_text:
        raise RuntimeError("user bug")
    return 1.0


def reads_a_column(response_text, fields, metadata):
    return float(fields["keyword"] in response_text)  # a column data.extra_keys must carry


def reads_a_dict(response_text, fields, metadata):
    return float({"a": 1.0}["b"])  # a KeyError of the function's own


def returns_inf(response_text, fields, metadata):
    return math.inf if "inf" in response_text else 0.5


def returns_text(response_text, fields, metadata):
    return "1.0"


def hangs(response_text, fields, metadata):
    if "hang" in response_text:
        time.sleep(3600)
    return 1.0


def hangs_deaf(response_text, fields, metadata):
    """Blocks SIGALRM first: only the parent's watchdog can end it."""
    if "hang" in response_text:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    return 1.0


def returns_huge(response_text, fields, metadata):
    """Finite in float64, inf once in the float32 rewards tensor."""
    return {"reward": 1e39 if "huge" in response_text else 0.5}


def score(path, texts, workers=0, timeout=None):
    runner = RewardFunctionRunner(f"{MOD}:{path}", num_workers=workers, timeout_s=timeout)
    try:
        return runner.score(texts, [{"ground_truth": "x"}] * len(texts),
                            [{"group_id": i // 2, "index": i, "step": 1} for i in range(len(texts))])
    finally:
        runner.close()


@pytest.mark.parametrize("path, message", [
    ("nodots", "must look like 'package.module:function'"),
    ("a:b:c", "must look like"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    (f"{MOD}:missing", "has no attribute 'missing'"),
    (f"{MOD}:MOD", "is not callable"),
])
def test_bad_paths_fail_fast(path, message):
    with pytest.raises(ValueError, match=message):
        load_reward_function(path)


def test_to_components():
    assert to_components(2) == {"reward": 2.0}
    assert to_components({"a": 1, "b": 0.5}) == {"a": 1.0, "b": 0.5}
    for bad in ("1.0", None, {}, {"a": "x"}, {"a": True}):
        with pytest.raises(TypeError):
            to_components(bad)


def test_in_process_statuses():
    out = score("raises", ["good", "bad", "good"])
    assert [o.status for o in out] == [OK, ERROR, OK]
    assert out[1].components == {} and "user bug" in out[1].detail
    out = score("returns_inf", ["inf", "fine"])
    assert [o.status for o in out] == [NONFINITE, OK] and out[1].components == {"reward": 0.5}
    assert [o.status for o in score("returns_text", ["a"])] == [ERROR]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_missing_data_column_says_extra_keys(workers):
    """A reward function reading a column the row lacks: the warning said KeyError('keyword')
    only; it now names the row's fields and data.extra_keys (fresh-user report)."""
    out = score("reads_a_column", ["a", "b"], workers=workers)
    assert [o.status for o in out] == [ERROR, ERROR]
    assert out[0].detail == ("KeyError('keyword'): the row's fields are ['ground_truth']; another "
                             "column of the data file comes with data.extra_keys=[keyword]")
    assert score("reads_a_dict", ["a"])[0].detail == "KeyError('b')"  # not a row field: as is


def test_in_process_hang_times_out():
    t0 = time.perf_counter()
    out = score("hangs", ["ok", "hang", "ok"], timeout=0.5)
    assert [o.status for o in out] == [OK, TIMEOUT, OK]
    assert time.perf_counter() - t0 < 3.0


def test_pool_hang_times_out_and_the_pool_survives():
    t0 = time.perf_counter()
    out = score("hangs", ["ok", "hang", "ok", "ok"], workers=2, timeout=1.0)
    assert [o.status for o in out] == [OK, TIMEOUT, OK, OK]
    assert [o.components for o in out if o.status == OK] == [{"reward": 1.0}] * 3
    # a generous bound (worker spawn included, on a loaded 2-core CI machine): a pool that waited
    # for the hung worker would never return
    assert time.perf_counter() - t0 < 90.0


def test_pool_worker_deaf_to_the_alarm_is_killed():
    """A task stuck where SIGALRM cannot reach: ProcessPoolExecutor cannot cancel a running
    task, so the parent's deadline kills the workers and the next call gets a fresh pool."""
    runner = RewardFunctionRunner(f"{MOD}:hangs_deaf", num_workers=1, timeout_s=0.5)
    try:
        t0 = time.perf_counter()
        out = runner.score(["hang"], [{}], [{}])
        assert [o.status for o in out] == [TIMEOUT]
        assert time.perf_counter() - t0 < 20.0
        assert runner._pool is None  # killed
        again = runner.score(["fine", "fine"], [{}, {}], [{}, {}])
        assert [o.status for o in again] == [OK, OK]
    finally:
        runner.close()



def test_a_call_that_blocks_the_alarm_is_killed_at_its_timeout(caplog):
    """The worker of a call deaf to SIGALRM is killed ``timeout_s + KILL_GRACE_S`` after the
    call started, not at the batch's backstop (3 * 4 + 5 = 17 s here, what this cost before):
    that sample is a timeout, the sample the other worker was scoring when the pool broke is
    scored again, and every other one is scored once."""
    runner = RewardFunctionRunner(f"{MOD}:hangs_deaf", num_workers=2, timeout_s=3.0)
    texts = ["hang"] + [f"fine {i}" for i in range(7)]
    try:
        runner.score(["warm"], [{}], [{}])  # spawn the pool before the clock runs
        t0 = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="flowrl.rewards.function"):
            out = runner.score(texts, [{}] * 8, [{"index": i} for i in range(8)])
        took = time.perf_counter() - t0
    finally:
        runner.close()
    assert [o.status for o in out] == [TIMEOUT] + [OK] * 7
    assert [o.components for o in out[1:]] == [{"reward": 1.0}] * 7
    assert 3.0 + KILL_GRACE_S <= took < 12.0  # a fresh pool's spawn included
    assert "after its timeout_s=3 (it ignores SIGALRM?); killing its worker process" in caplog.text


EXITS_ON_THREE = """
import os, time

def exits_on_three(response_text, fields, metadata):
    # kills its worker on index 3, as a crashing C extension would; the others take 0.3 s, so
    # the crash finds index 2 running and 4-7 queued (the broken pool fails them all)
    if metadata["index"] == 3:
        os._exit(1)
    time.sleep(0.3)
    return float(metadata["index"])
"""


def test_a_worker_that_dies_loses_only_its_own_sample(tmp_path, monkeypatch, caplog):
    """os._exit in one call breaks the pool and fails every pending future; the runner scores
    those again alone, so exactly the sample that kills its worker is marked. (The function
    lives in a module without torch, so the three pool starts stay cheap.)"""
    (tmp_path / "crashing_reward.py").write_text(EXITS_ON_THREE)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit sys.path
    runner = RewardFunctionRunner("crashing_reward:exits_on_three", num_workers=2, timeout_s=10.0)
    t0 = time.perf_counter()
    try:
        with caplog.at_level(logging.WARNING):
            out = runner.score([f"s{i}" for i in range(8)], [{}] * 8,
                               [{"index": i} for i in range(8)])
    finally:
        runner.close()
    assert [o.status for o in out] == [OK, OK, OK, ERROR, OK, OK, OK, OK]
    assert [o.components["reward"] for i, o in enumerate(out) if i != 3] == [0, 1, 2, 4, 5, 6, 7]
    assert "died while scoring this sample" in out[3].detail
    assert "a worker process died" in caplog.text
    assert time.perf_counter() - t0 < 60.0  # three pool starts, spawn included


def test_a_reward_beyond_float32_is_nonfinite():
    out = score("returns_huge", ["huge", "fine"])
    assert [o.status for o in out] == [NONFINITE, OK]
    assert "float32" in out[0].detail


class Tok:
    """Byte-level stand-in tokenizer: id = character code."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))

    def batch_decode(self, rows, skip_special_tokens=True):
        return [self.decode(r, skip_special_tokens) for r in rows]


def encode(texts, width=8):
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.bool)
    for i, t in enumerate(texts):
        ids[i, :len(t)] = torch.tensor([ord(c) for c in t])
        mask[i, :len(t)] = True
    return ids, mask


def run_op(params, texts, truths=None):
    spec = get_op("reward.function")
    cfg = spec.make_config(params, stage="fn")
    ctx = StageContext(stage="fn", step=3, resources={"tokenizer": Tok()})
    ids, mask = encode(texts)
    out = spec.fn(ctx, cfg, response_ids=ids, response_mask=mask,
                  ground_truth=truths or ["x"] * len(texts),
                  group_id=torch.arange(len(texts)) // 2)
    return out["rewards"], ctx.metrics


def test_op_raise_inf_and_timeout_are_nan_and_counted():
    r, m = run_op({"path": f"{MOD}:raises"}, ["good", "bad", "good", "bad"])
    assert torch.equal(torch.isnan(r), torch.tensor([False, True, False, True]))
    assert r[0].item() == 1.0
    assert (m["reward/errors"], m["reward/unscorable"], m["reward/timeouts"]) == (2.0, 2.0, 0.0)
    r, m = run_op({"path": f"{MOD}:returns_inf"}, ["inf", "ok"])
    assert math.isnan(r[0].item()) and r[1].item() == 0.5
    assert (m["reward/nonfinite"], m["reward/unscorable"], m["reward/mean"]) == (1.0, 1.0, 0.5)
    r, m = run_op({"path": f"{MOD}:hangs", "timeout_s": 0.5}, ["hang", "ok"])
    assert math.isnan(r[0].item()) and r[1].item() == 1.0
    assert (m["reward/timeouts"], m["reward/unscorable"]) == (1.0, 1.0)


def test_op_logs_every_kind_of_unscorable_sample(caplog):
    """1e39 (and a weighted sum past float32) is counted as nonfinite and every kind of loss,
    timeouts included, gets one warning line per step."""
    with caplog.at_level(logging.WARNING, logger="flowrl.ops.reward"):
        r, m = run_op({"path": f"{MOD}:returns_huge"}, ["huge", "ok"])
    assert math.isnan(r[0].item()) and r[1].item() == 0.5
    assert (m["reward/nonfinite"], m["reward/unscorable"], m["reward/errors"]) == (1.0, 1.0, 0.0)
    assert "1 of 2 sample(s) unscorable (NaN): 1 non-finite (NaN, inf or beyond float32)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flowrl.ops.reward"):
        r, m = run_op({"path": f"{MOD}:returns_huge", "weights": {"reward": 1e39}}, ["ok", "ok"])
    assert torch.isnan(r).all() and m["reward/nonfinite"] == 2.0  # 0.5 * 1e39 > 3.4e38
    assert "weighted sum" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flowrl.ops.reward"):
        r, m = run_op({"path": f"{MOD}:hangs", "timeout_s": 0.5}, ["hang", "ok"])
    assert m["reward/timeouts"] == 1.0 and "1 timeout(s) (over timeout_s)" in caplog.text


def test_op_dict_components_weighted_and_logged():
    r, m = run_op({"path": f"{MOD}:components", "weights": {"correct": 2.0, "group": 0.5}},
                  ["7", "8", "7", "7"], truths=["7"] * 4)
    # correct * 2 + group_id * 0.5; group ids [0, 0, 1, 1]
    assert r.tolist() == [2.0, 0.0, 2.5, 2.5]
    assert m["reward/fn/correct"] == 0.75 and m["reward/fn/group"] == 0.5


def two_args(response_text, ground_truth):
    return 1.0


def needs_keyword(response_text, fields, metadata, *, scale):
    return scale


def takes_kwargs(response_text, fields, metadata, **kwargs):
    return 1.0


def takes_anything(*args, **kwargs):
    return 1.0


def with_default(response_text, fields, metadata, scale=2.0):
    return scale


@pytest.mark.parametrize("name, sig, reason", [
    ("two_args", "(response_text, ground_truth)", "too many positional arguments"),
    ("needs_keyword", "(response_text, fields, metadata, *, scale)",
     "missing a required argument: 'scale'"),
])
def test_op_refuses_a_signature_the_call_cannot_bind(name, sig, reason):
    """A function flowrl's positional call cannot bind to made every sample a TypeError (NaN) at
    run time (fresh-user report); now the graph's compile refuses it, naming stage and field."""
    spec = get_op("reward.function")
    with pytest.raises(ValueError) as e:
        spec.make_config({"path": f"{MOD}:{name}"}, stage="fn")
    assert str(e.value) == (
        f"stage 'fn': params: path: reward function '{MOD}:{name}' takes {sig}, but flowrl calls "
        f"it as fn(response_text, fields, metadata) ({reason}); define it as def "
        "f(response_text: str, fields: dict, metadata: dict) -> float | dict[str, float]")


@pytest.mark.parametrize("name", ["takes_kwargs", "takes_anything", "with_default",
                                  "length_reward"])
def test_op_accepts_every_signature_the_call_binds(name):
    cfg = get_op("reward.function").make_config({"path": f"{MOD}:{name}"}, stage="fn")
    assert cfg.path == f"{MOD}:{name}"


def test_op_bad_config_names_the_stage():
    spec = get_op("reward.function")
    with pytest.raises(ValueError, match="stage 'fn': params: .*cannot import"):
        spec.make_config({"path": "nope_xyz:f"}, stage="fn")
    with pytest.raises(ValueError, match="num_workers must be >= 0"):
        spec.make_config({"path": f"{MOD}:raises", "num_workers": -1}, stage="fn")
