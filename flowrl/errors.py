"""Errors that any layer may raise (no flowrl imports here)."""
from __future__ import annotations


class RunStopped(RuntimeError):
    """A running job stopped for a reason its message explains in full, naming the setting to
    change (e.g. dynamic sampling that kept too few groups after ``max_attempts``).
    ``flowrl train`` reports it in one line with the resume command, without a traceback
    (``runtime/control/recovery.report_crash``): the traceback would show flowrl's internals, not
    the user's mistake."""
