"""The user reward-function contract: a function by import path, failures (raise, non-finite,
non-number, timeout, a worker that ignores the alarm) become NaN and are counted; the run goes on.

The functions below are the "user's" (this module is importable as ``test_rewards_function``
by spawned pool workers too: pytest puts this folder on sys.path).
"""
import math
import signal
import time

import pytest
import torch

from flowrl.ops.context import StageContext
from flowrl.ops.registry import get_op
from flowrl.rewards.function import (ERROR, NONFINITE, OK, TIMEOUT, RewardFunctionRunner,
                                     load_reward_function, to_components)

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
    assert time.perf_counter() - t0 < 20.0  # worker spawn included


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


class Tok:
    """Byte-level stand-in tokenizer: id = character code."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


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


def test_op_dict_components_weighted_and_logged():
    r, m = run_op({"path": f"{MOD}:components", "weights": {"correct": 2.0, "group": 0.5}},
                  ["7", "8", "7", "7"], truths=["7"] * 4)
    # correct * 2 + group_id * 0.5; group ids [0, 0, 1, 1]
    assert r.tolist() == [2.0, 0.0, 2.5, 2.5]
    assert m["reward/fn/correct"] == 0.75 and m["reward/fn/group"] == 0.5


def test_op_bad_config_names_the_stage():
    spec = get_op("reward.function")
    with pytest.raises(ValueError, match="stage 'fn': params: .*cannot import"):
        spec.make_config({"path": "nope_xyz:f"}, stage="fn")
    with pytest.raises(ValueError, match="num_workers must be >= 0"):
        spec.make_config({"path": f"{MOD}:raises", "num_workers": -1}, stage="fn")
