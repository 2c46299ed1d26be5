"""Rank 0 says what the job does once; other ranks keep their warnings and per-rank lines."""
from __future__ import annotations

import logging

from flowrl.runtime.io import distributed as fdist


def record(name: str, level: int, **extra) -> logging.LogRecord:
    r = logging.LogRecord(name, level, __file__, 1, "msg", None, None)
    r.__dict__.update(extra)
    return r


def test_rank_zero_info_keeps_warnings_per_rank_lines_and_other_libraries():
    f = fdist.RankZeroInfo()
    assert f.filter(record("flowrl", logging.INFO)) is False
    assert f.filter(record("flowrl.runtime.step.resources", logging.DEBUG)) is False
    assert f.filter(record("flowrl", logging.WARNING)) is True
    assert f.filter(record("flowrl.engines", logging.ERROR)) is True
    assert f.filter(record("flowrl.runtime.io.distributed", logging.INFO, **{fdist.EVERY_RANK: True}))
    assert f.filter(record("vllm.engine", logging.INFO)) is True  # not flowrl's to silence


def test_quiet_other_ranks_filters_the_root_handlers_once_and_never_on_rank_0():
    root = logging.getLogger()
    h = logging.StreamHandler()
    kept = root.handlers[:]  # pytest's own capture handlers must not get the filter
    root.handlers = [h]
    try:
        fdist.quiet_other_ranks(0)
        fdist.quiet_other_ranks(2, speakers={0, 2})  # the first rank of a partitioned run's pool
        assert h.filters == []
        fdist.quiet_other_ranks(1)
        fdist.quiet_other_ranks(1)  # a second job in the same process (a sweep) adds none
        assert [type(f) for f in h.filters] == [fdist.RankZeroInfo]
    finally:
        root.handlers = kept


def test_pool_tag_prefixes_flowrl_records_once_across_handlers():
    """A partitioned run's rollout-pool rank: its lines on the shared console and train.log read
    ``rollout pool: ...``; a record every handler sees is prefixed once, other libraries never."""
    root = logging.getLogger()
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    kept, level = root.handlers[:], root.level
    root.handlers = [Keep(), Keep()]
    root.setLevel(logging.INFO)
    try:
        fdist.tag_rank_lines("rollout pool")
        fdist.tag_rank_lines("rollout pool")  # a second job in the same process adds none
        assert [len(h.filters) for h in root.handlers] == [1, 1]
        logging.getLogger("flowrl.engines").info("engines built in %.1f s", 2.0)
        logging.getLogger("vllm.engine").warning("not ours")
        said = logging.getLogger("flowrl").makeRecord("flowrl", logging.INFO, __file__, 1,
                                                      "pool: said", (), None,
                                                      extra={fdist.POOL_TAGGED: True})
        root.handle(said)
    finally:
        root.handlers = kept
        root.setLevel(level)
    assert seen == ["rollout pool: engines built in 2.0 s"] * 2 + ["not ours"] * 2 + ["pool: said"] * 2


def test_other_pool_speaker_is_the_first_rank_of_a_pool_the_logging_rank_is_not_in():
    from types import SimpleNamespace

    from flowrl.runtime.control.job import other_pool_speaker

    def pools(**ranks):  # other_pool_speaker reads PlacementPlan.pools[name].ranks only
        return SimpleNamespace(pools={k: SimpleNamespace(ranks=r) for k, r in ranks.items()})

    # the train pool's first rank logs the run, wherever it is
    assert [other_pool_speaker(pools(train=[2, 3], rollout=[0, 1]), r) for r in range(4)] == [
        "rollout", None, None, None]
    assert [other_pool_speaker(pools(train=[0], rollout=[1]), r) for r in range(2)] == [
        None, "rollout"]
    assert [other_pool_speaker(pools(all=[0, 1]), r) for r in range(2)] == [None, None]
