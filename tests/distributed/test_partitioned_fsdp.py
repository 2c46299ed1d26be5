"""A partitioned train pool of several ranks: FSDP2 over the pool's own process group.

The distributed test runs 3 gloo processes under torchrun: train pool [0, 1] (one FSDP group of
2), rollout pool [2], staleness 0, 3 steps, and compares with a 1-process colocated run with the
same ``prompts_per_step``: the rollout pool's rank 0 draws the prompts and stage seeds colocated
rank 0 draws, its rows are cut in two halves for the two train ranks, and the update's global
denominators make the 2-rank FSDP update the 1-rank update on the whole batch (fp32, up to float
summation order).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.config import compose
from flowrl.runtime.control.partitioned import check_partitioned, pool_peers, split_batch
from flowrl.runtime.control.preflight import prepare_placement
from flowrl.train import prepare, train

sys.path.insert(0, str(Path(__file__).parent))
from test_partitioned import ARGS, ENV, REPO, actor_weights, metrics  # noqa: E402


def test_routing_peers_both_ways():
    # more train ranks: rollout i cuts its rows for train ranks j ≡ i (mod n_roll)
    assert [pool_peers("rollout", i, 1, 2) for i in range(1)] == [[0, 1]]
    assert [pool_peers("train", j, 1, 2) for j in range(2)] == [[0], [0]]
    assert [pool_peers("rollout", i, 2, 4) for i in range(2)] == [[0, 2], [1, 3]]
    assert [pool_peers("train", j, 2, 4) for j in range(4)] == [[0], [1], [0], [1]]
    # more rollout ranks: train j concatenates the whole batches of rollout i ≡ j (mod n_train)
    assert [pool_peers("rollout", i, 6, 2) for i in range(6)] == [[0], [1], [0], [1], [0], [1]]
    assert [pool_peers("train", j, 6, 2) for j in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert pool_peers("train", 0, 1, 1) == [0] and pool_peers("rollout", 0, 1, 1) == [0]


def test_split_batch_cuts_rows_and_copies_the_rest():
    data = {"sample.prompt_ids": torch.arange(10).view(5, 2), "sample.ground_truth": list("abcde"),
            "rollout.truncated": torch.tensor([0, 1, 0, 1, 1]).bool(), "scale": torch.tensor(2.0)}
    a, b = split_batch(data, 2)
    assert a["sample.prompt_ids"].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert b["sample.prompt_ids"].tolist() == [[6, 7], [8, 9]]
    assert (a["sample.ground_truth"], b["sample.ground_truth"]) == (list("abc"), list("de"))
    assert (a["rollout.truncated"].tolist(), b["rollout.truncated"].tolist()) == \
        ([False, True, False], [True, True])
    assert a["scale"].item() == b["scale"].item() == 2.0
    assert split_batch(data, 1)[0].keys() == data.keys()
    with pytest.raises(ValueError, match="5 rows for 6 train ranks.*trainer.prompts_per_step"):
        split_batch(data, 6)


def test_train_pool_of_two_ranks_is_accepted_before_models_load():
    base = ["model=tiny", "trainer=smoke", "trainer.output_dir=/tmp/unused", "placement=partitioned"]
    for train_ranks, roll_ranks, n in (("[0,1]", "[2]", 3), ("[0,1]", "[2,3,4,5,6,7]", 8)):
        spec = prepare(compose(base + [f"launcher.nproc={n}", f"placement.pools.train={train_ranks}",
                                            f"placement.pools.rollout={roll_ranks}"]))
        cfg, plan = spec.config, spec.plan
        check_partitioned(prepare_placement(cfg, plan, n))


def dcp_index(ckpt: Path) -> dict:
    """FQN → DCP metadata (``.chunks``: one per rank shard of a sharded tensor)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata


EVAL = ["trainer.eval.after=true"]  # smoke: greedy on 4 test prompts, 16 tokens


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_two_fsdp_train_ranks_match_one_colocated_rank(tmp_path):
    colo, part = tmp_path / "colocated", tmp_path / "partitioned"
    train(compose(ARGS + [f"trainer.output_dir={colo}"]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           "-m", "flowrl.train", *ARGS, *EVAL, "placement=partitioned", "placement.staleness=0",
           "placement.pools.train=[0,1]", "placement.pools.rollout=[2]", f"trainer.output_dir={part}"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = part / "checkpoints" / "step_000003"
    # the actor really is sharded over the 2 train ranks (one DCP chunk each), not replicated
    index = dcp_index(ckpt)
    keys = [k for k in index if k.startswith("actor.model.") and k.endswith("q_proj.weight")]
    assert keys and all(len(index[k].chunks) == 2 for k in keys)
    m, mc = metrics(part), metrics(colo)
    for s in (1, 2, 3):
        assert m[s]["placement/version_lag"] == 0.0
        # the rollout copy holds the weights gathered from the FSDP shards (k = 0: the same
        # weights the train pool scores the batch with)
        assert m[s]["rollout/logprob_mismatch"] < 1e-4
        # the rollout rank's metrics travel once (with chunk 0): counts are not doubled
        assert m[s]["data/prompts"] == mc[s]["data/prompts"] == 2
        assert m[s]["reward/mean"] == mc[s]["reward/mean"]
        assert m[s]["response/length_mean"] == mc[s]["response/length_mean"]
        assert m[s]["actor/grad_norm"] > 0
        assert m[s]["actor/grad_norm"] == pytest.approx(mc[s]["actor/grad_norm"], rel=1e-4)
    # the final eval: every train rank joins the gather, rank 0 decodes the whole eval slice
    # (not its pool shard of it) with a full copy
    ev = json.loads((part / "summary.json").read_text())["eval_after"]
    assert ev["eval/n"] == 4.0 and ev["eval/response_length_mean"] > 0
    a, b = actor_weights(colo / "checkpoints" / "step_000003"), actor_weights(ckpt)
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)



@pytest.mark.slow
def test_fsdp_train_pool_resumes_like_an_uninterrupted_run(tmp_path):
    """2 steps, checkpoint (DCP over the job: 2 train shards, the rollout rank empty), resume to
    3 = 3 colocated steps on one rank."""
    colo, part = tmp_path / "colocated", tmp_path / "partitioned"
    train(compose(ARGS + [f"trainer.output_dir={colo}"]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           "-m", "flowrl.train", *ARGS, "placement=partitioned", "placement.pools.train=[0,1]",
           "placement.pools.rollout=[2]", f"trainer.output_dir={part}"]
    for extra in (["trainer.total_steps=2"], ["trainer.resume=true"]):
        proc = subprocess.run(cmd + extra, cwd=REPO, env=ENV, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(metrics(part)) == [1, 2, 3]
    a = actor_weights(colo / "checkpoints" / "step_000003")
    b = actor_weights(part / "checkpoints" / "step_000003")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)
