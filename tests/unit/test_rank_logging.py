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
