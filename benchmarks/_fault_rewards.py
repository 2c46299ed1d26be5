"""User reward functions of ``benchmarks/faults.py`` (importable by spawned reward workers: the
benchmark puts this folder on ``PYTHONPATH``). Each scores ``len(text) % 5 / 4`` (deterministic,
varied, so the tiny model's weights move) and misbehaves on chosen rows of the batch."""
from __future__ import annotations

import os
import time


def length_reward(response_text, fields, metadata):
    return (len(response_text) % 5) / 4.0


def crash_on_first(response_text, fields, metadata):
    """Kills its worker process (as a segfaulting extension would) on row 0 of every batch."""
    if metadata["index"] == 0:
        os._exit(1)
    return length_reward(response_text, fields, metadata)


def hang_on_first(response_text, fields, metadata):
    if metadata["index"] == 0:
        time.sleep(3600)
    return length_reward(response_text, fields, metadata)


def garbage(response_text, fields, metadata):
    """Rows 0-3 return a string, None, NaN and 1e39 (finite in float64, inf in float32)."""
    bad = {0: "0.5", 1: None, 2: float("nan"), 3: 1e39}
    if metadata["index"] in bad:
        return bad[metadata["index"]]
    return length_reward(response_text, fields, metadata)


def constant(response_text, fields, metadata):
    """The same score for every answer: every group has zero reward variance (DAPO's dynamic
    sampling then keeps nothing)."""
    return 0.5


def deaf_hang_on_first(response_text, fields, metadata):
    """Blocks SIGALRM, then hangs on row 0 (a C extension that masks signals): only a process
    kill ends it."""
    if metadata["index"] == 0:
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    return length_reward(response_text, fields, metadata)


def huge(response_text, fields, metadata):
    """±3e38 (finite in float32, its advantages and loss are not): every optimizer step is
    skipped, the Dr.GRPO run of issue 27 that exited 0 having trained nothing."""
    return 3e38 if metadata["index"] % 2 == 0 else -3e38


def raise_always(response_text, fields, metadata):
    """A verifier that raises on every sample (no sample of the step can be scored)."""
    raise RuntimeError("verifier backend unreachable")
