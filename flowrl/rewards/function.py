"""The user reward-function contract: your own Python function, named by import path in config.

    def my_reward(response_text: str, fields: dict, metadata: dict) -> float | dict[str, float]:
        ...

- ``response_text``: the decoded RESPONSE (never the prompt), starting with
  ``data.response_prefix`` when one pre-fills the response (``<think>\n``).
- ``fields``: the prompt's fields: ``ground_truth``, ``question`` (when the prompt source knows
  it), ``prompt`` (the rendered prompt text) and the ``data.extra_keys`` columns of the row.
- ``metadata``: ``group_id`` (int, the prompt instance), ``index`` (row in the batch), ``step``.
- return: a float, or a dict of named float components (combined by weights in the op config).

Failures never stop the run: a raise, a non-number, a non-finite value (or one that overflows
the float32 ``rewards`` tensor, |x| > 3.4e38), a call longer than ``timeout_s`` or a worker
process that dies on the sample (``os._exit``, a segfault, an OOM kill) makes that sample's reward
NaN (unscorable), counted by kind (see :class:`Outcome`). Only the sample that killed a worker is
lost: the samples the broken pool took down with it are scored again, one at a time, in a fresh
pool, so the one that dies alone is the one marked.

Timeouts: each call runs under ``SIGALRM`` (``setitimer``) in the process that runs it, which
interrupts Python code and sleeps. With ``num_workers >= 1`` calls run in a
``concurrent.futures.ProcessPoolExecutor`` (spawned workers); a worker stuck where no signal
reaches it (a C call that blocks the alarm) cannot be cancelled by the pool, so the parent also
waits at most ``timeout_s * ceil(B / num_workers) + max(timeout_s, 5)`` seconds in total (after the
workers have started and imported the function), then kills
the pool's workers, marks what is left as timeouts and starts a fresh pool for the next call.
In-process (``num_workers = 0``) the alarm works only on the main thread of a platform with
``SIGALRM``; elsewhere calls run without a timeout (a warning says so once).
"""
from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import signal
import threading
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

log = logging.getLogger(__name__)

OK, ERROR, TIMEOUT, NONFINITE = "ok", "error", "timeout", "nonfinite"
# largest float32: a larger finite float64 becomes inf in the (B,) float32 rewards tensor
FLOAT32_MAX = 3.4028234663852886e38
_LOST = (ERROR, "lost with a broken worker pool")  # placeholder until re-scored alone


def fits_float32(x: float) -> bool:
    """Finite, and still finite once cast to float32."""
    return math.isfinite(x) and abs(x) <= FLOAT32_MAX


def load_reward_function(path: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` (attribute paths like ``mod:Class.method`` work).

    Raises:
        ValueError: a malformed path, a module that does not import, a missing attribute or a
            non-callable, naming the path.
    """
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"reward function path must look like 'package.module:function', got {path!r}")
    mod_name, attr = path.split(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as e:  # any import-time failure is the user's module, not ours
        raise ValueError(f"reward function {path!r}: cannot import {mod_name!r}: {e!r}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward function {path!r}: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward function {path!r} is not callable")
    return obj


class _Timeout(BaseException):
    """Raised by the alarm handler; BaseException so a user's ``except Exception`` can't eat it."""


def _on_alarm(signum, frame):  # pragma: no cover - runs inside the signal handler
    raise _Timeout()


def _alarm_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _call(fn: Callable, text: str, fields: dict, meta: dict,
          timeout_s: Optional[float]) -> tuple[str, Any]:
    """Run one call: ``(OK, value)``, ``(ERROR, repr)`` or ``(TIMEOUT, None)``."""
    delay = float(timeout_s) if timeout_s and _alarm_usable() else None  # None: no alarm
    old = signal.signal(signal.SIGALRM, _on_alarm) if delay is not None else None
    try:
        if delay is not None:
            signal.setitimer(signal.ITIMER_REAL, delay)
        try:
            return OK, fn(text, fields, meta)
        finally:
            if delay is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:
        return TIMEOUT, None
    except Exception as e:
        return ERROR, repr(e)
    finally:
        if delay is not None:
            signal.signal(signal.SIGALRM, old)


_WORKER_FNS: dict[str, Callable] = {}


def _worker_call(path: str, text: str, fields: dict, meta: dict,
                 timeout_s: Optional[float]) -> tuple[str, Any]:
    """Process-pool entry point (top level: picklable); caches the imported function."""
    if path not in _WORKER_FNS:
        try:
            _WORKER_FNS[path] = load_reward_function(path)
        except ValueError as e:
            return ERROR, str(e)
    return _call(_WORKER_FNS[path], text, fields, meta, timeout_s)


def _worker_load(path: str) -> bool:
    """Pool warm-up task: import the function in a worker before any timed call."""
    if path not in _WORKER_FNS:
        _WORKER_FNS[path] = load_reward_function(path)
    return True


def to_components(value: Any) -> dict[str, float]:
    """A return value as named floats: a number → ``{"reward": x}``, a dict → its items.

    Raises:
        TypeError: anything else (a string, None, a dict with a non-number value).
    """
    if isinstance(value, Mapping):
        if not value:
            raise TypeError("reward function returned an empty dict")
        out = {}
        for k, v in value.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
                raise TypeError(f"reward component {k!r} is {type(v).__name__}, not a number")
            out[str(k)] = float(v)
        return out
    if isinstance(value, (int, float)) or hasattr(value, "__float__"):
        return {"reward": float(value)}
    raise TypeError(f"reward function returned {type(value).__name__}, not a float or dict")


@dataclass
class Outcome:
    """One sample's result. status: ok | error | timeout | nonfinite; components: name → float
    (empty unless ok); detail: the error's repr for logs."""

    status: str
    components: dict[str, float]
    detail: str = ""


class RewardFunctionRunner:
    """Calls a user reward function on a batch, in-process or in a process pool.

    Args:
        path: ``"module:function"`` (imported here, so a bad path fails at construction).
        num_workers: 0 = call in this process; >= 1 = a spawned ``ProcessPoolExecutor`` of that
            size, created on first use and reused across steps (``close()`` ends it).
        timeout_s: per-call limit in seconds (None or 0 = no limit).
    """

    def __init__(self, path: str, num_workers: int = 0, timeout_s: Optional[float] = None):
        self.path, self.num_workers, self.timeout_s = path, int(num_workers), timeout_s
        self.fn = load_reward_function(path)
        self._pool: Optional[ProcessPoolExecutor] = None
        self._warned = False

    def score(self, texts: Sequence[str], fields: Sequence[dict], metas: Sequence[dict]) -> list[Outcome]:
        """One :class:`Outcome` per text (same order)."""
        if self.num_workers == 0:
            if self.timeout_s and not _alarm_usable() and not self._warned:
                log.warning("reward function %s: no SIGALRM on this thread, timeout_s is not "
                            "enforced in-process; set num_workers >= 1", self.path)
                self._warned = True
            raw = [_call(self.fn, t, f, m, self.timeout_s) for t, f, m in zip(texts, fields, metas)]
        else:
            raw = self._score_pool(texts, fields, metas)
        return [self._outcome(status, value) for status, value in raw]

    def _outcome(self, status: str, value: Any) -> Outcome:
        if status != OK:
            return Outcome(status, {}, "" if value is None else str(value))
        try:
            comps = to_components(value)
        except TypeError as e:
            return Outcome(ERROR, {}, str(e))
        if not all(fits_float32(v) for v in comps.values()):
            return Outcome(NONFINITE, {}, f"{comps!r} (not finite in float32)")
        return Outcome(OK, comps)

    def _score_pool(self, texts, fields, metas) -> list[tuple[str, Any]]:
        items = list(zip(texts, fields, metas))
        out = self._run_batch(items)
        lost = [i for i, r in enumerate(out) if r is _LOST]
        if lost:
            log.warning("reward function %s: a worker process died (os._exit, a crash, an OOM "
                        "kill?); scoring the %d sample(s) it took down one at a time in a fresh "
                        "pool", self.path, len(lost))
            for i in lost:  # alone, a death is this sample's own
                r = self._run_batch([items[i]])[0]
                out[i] = (ERROR, "the reward worker process died while scoring this sample") \
                    if r is _LOST else r
        return out

    def _run_batch(self, items) -> list[tuple[str, Any]]:
        """Submit ``items`` to the pool and collect them; a sample lost to a broken pool is
        ``_LOST``, and the broken pool is replaced on the next call."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.num_workers,
                                             mp_context=multiprocessing.get_context("spawn"))
            # start every worker and import the function before the clock runs: spawning and
            # importing (seconds on a loaded machine) must not count against timeout_s
            wait([self._pool.submit(_worker_load, self.path) for _ in range(self.num_workers)])
        try:
            futures: list[Future] = [self._pool.submit(_worker_call, self.path, t, f, m,
                                                       self.timeout_s) for t, f, m in items]
        except BrokenProcessPool:  # broke while submitting (a worker died already)
            self._kill_pool()
            return [_LOST] * len(items)
        budget = None
        if self.timeout_s:
            rounds = -(-len(futures) // self.num_workers)
            budget = self.timeout_s * rounds + max(self.timeout_s, 5.0)
        _, pending = wait(futures, timeout=budget)
        if pending:
            log.warning("reward function %s: %d call(s) still running after %.1f s; killing the "
                        "worker pool", self.path, len(pending), budget)
            self._kill_pool()
        out: list[tuple[str, Any]] = []
        for fut in futures:
            if fut in pending:
                out.append((TIMEOUT, None))
                continue
            try:
                out.append(fut.result())
            except BrokenProcessPool:  # a worker died: this sample may or may not be the cause
                out.append(_LOST)
                self._kill_pool()
            except Exception as e:  # an unpicklable result
                out.append((ERROR, repr(e)))
        return out

    def _kill_pool(self) -> None:
        """Kill the workers now: a pool cannot cancel a task that is already running.

        Python >= 3.14 has ``kill_workers``; before it the pool's processes are only
        reachable through its ``_processes`` attribute.
        """
        pool, self._pool = self._pool, None
        if pool is None:
            return
        procs = list((getattr(pool, "_processes", None) or {}).values())
        killer = getattr(pool, "kill_workers", None)
        if killer is not None:
            killer()
        else:
            for p in procs:
                p.kill()
        for p in procs:
            p.join(timeout=5)  # reap: no zombie left behind
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Shut the pool down (workers killed if a call is still running)."""
        if self._pool is not None:
            self._kill_pool()


def combine(components: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """Weighted sum of one sample's components; a component without a weight counts 1.0."""
    return float(sum(weights.get(k, 1.0) * v for k, v in components.items()))
