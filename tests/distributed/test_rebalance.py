"""Rows balanced across 2 gloo ranks: exact assignment, outputs restored, the update unchanged.

One ``torchrun --nproc_per_node=2 tests/distributed/rebalance_worker.py`` run (the time is mostly
imports) runs the real ops with ``balance_across_ranks`` on and off from the same weights.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import rebalance_worker  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("rebalance")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         str(Path(__file__).parent / "rebalance_worker.py"), str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def tokens(batch):
    return (batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)).tolist()


def test_rows_and_tokens_after_balancing(ranks):
    # global rows 0-3 on rank 0 carry [12, 10, 12, 8] tokens, rows 4-7 on rank 1 [5, 3, 5, 2]:
    # Karmarkar–Karp (equal size) gives {0, 3, 4, 5} = 28 and {1, 2, 6, 7} = 29
    assert [tokens(ranks[r]["batch"]) for r in range(2)] == [[12, 10, 12, 8], [5, 3, 5, 2]]
    got = [tokens(ranks[r]["on"]["balanced_rows"]) for r in range(2)]
    assert got == [[12, 8, 5, 3], [12, 10, 5, 2]]  # each rank's rows run longest first
    assert [sum(t) for t in got] == [28, 29]
    # KK's bound for equal-size bins: the spread is at most the largest row
    assert abs(sum(got[0]) - sum(got[1])) <= 12
    for r in range(2):
        bal = ranks[r]["on"]["balanced_rows"]
        # padded to the pool's widths (P 4, R 8) with their dtypes; left-padded prompts stay so
        assert bal["prompt_ids"].shape == (4, 4) and bal["response_ids"].shape == (4, 8)
        assert bal["prompt_mask"].dtype == torch.bool and bal["prompt_ids"].dtype == torch.long
        assert bool(bal["prompt_mask"][:, -1].all())
        assert ranks[r]["on"]["balance_metrics"] == {
            "balance/tokens_max_over_mean_before": pytest.approx(42 / 28.5, abs=1e-12),
            "balance/tokens_max_over_mean_after": pytest.approx(29 / 28.5, abs=1e-12),
            "balance/rows_moved": 4.0}
    # the rows that moved arrive intact: global row 4 (rank 1's first) is rank 0's third row
    src = ranks[1]["batch"]
    torch.testing.assert_close(ranks[0]["on"]["balanced_rows"]["response_ids"][2, :2],
                               src["response_ids"][0], rtol=0, atol=0)
    assert not ranks[0]["on"]["balanced_rows"]["response_mask"][2, 2:].any()


@pytest.mark.parametrize("key", ["old_logprobs", "values"])
def test_per_row_outputs_come_back_in_original_order(ranks, key):
    for r, R in ((0, 8), (1, 2)):
        on, off = ranks[r]["on"][key], ranks[r]["off"][key]
        assert on.shape == off.shape == (4, R)  # trimmed back to the rank's own response width
        torch.testing.assert_close(on, off, atol=1e-6, rtol=0)
        assert on.abs().sum() > 0
    assert ranks[0]["on"]["old_logprobs_metrics"] == pytest.approx(
        ranks[0]["off"]["old_logprobs_metrics"], abs=1e-6)


def test_update_step_is_invariant_to_which_rank_holds_a_row(ranks):
    on, off = ranks[0]["on"]["update_metrics"], ranks[0]["off"]["update_metrics"]
    for key in ("actor/pg_loss", "actor/loss", "actor/grad_norm", "actor/entropy"):
        assert on[key] == pytest.approx(off[key], abs=1e-5, rel=1e-5), key
    assert on["actor/grad_norm"] > 0.1
    # old logprobs and the first update forward saw the same balanced rows: ratio exactly 1
    assert on["actor/ratio_abs_dev"] == 0.0
    assert on["balance/tokens_max_over_mean_after"] == pytest.approx(29 / 28.5)
    assert "balance/tokens_max_over_mean_before" not in off
    for r in range(2):
        for k, w in ranks[r]["on"]["weights"].items():
            torch.testing.assert_close(w, ranks[r]["off"]["weights"][k], atol=1e-5, rtol=1e-5)


def test_worker_shapes_match_the_documented_case():
    assert [sum(p) + sum(q) for p, q, _, _ in rebalance_worker.SHAPES.values()] == [42, 15]
