"""The user reward-function contract: your own Python function, named by import path in config.

    def my_reward(response_text: str, fields: dict, metadata: dict) -> float | dict[str, float]:
        ...

- ``response_text``: the decoded RESPONSE (never the prompt), starting with
  ``data.response_prefix`` when one pre-fills the response (``<think>\n``).
- ``fields``: the prompt's fields: ``ground_truth``, ``question`` (when the prompt source knows
  it), ``prompt`` (the rendered prompt text) and the ``data.extra_keys`` columns of the row.
- ``metadata``: ``group_id`` (int, the prompt instance), ``index`` (row in the batch), ``step``.
- return: a float, or a dict of named float components (combined by weights in the op config).

The call is always positional, ``fn(response_text, fields, metadata)``; a function it cannot bind
to is refused when the graph is compiled, before any model loads (:func:`check_reward_signature`).

Failures never stop the run: a raise, a non-number, a non-finite value (or one that overflows
the float32 ``rewards`` tensor, |x| > 3.4e38), a call longer than ``timeout_s`` or a worker
process that dies on the sample (``os._exit``, a segfault, an OOM kill) makes that sample's reward
NaN (unscorable), counted by kind (see :class:`Outcome`). Only the sample that killed a worker is
lost: the samples the broken pool took down with it are scored again, one at a time, in a fresh
pool, so the one that dies alone is the one marked.

Timeouts: each call runs under ``SIGALRM`` (``setitimer``) in the process that runs it, which
interrupts Python code and sleeps. With ``num_workers >= 1`` calls run in a
``concurrent.futures.ProcessPoolExecutor`` (spawned workers); each worker reports when it starts a
call, and a call still running ``timeout_s + 1`` s later (stuck where no signal reaches it: a C
call, or code that blocks ``SIGALRM``) has its worker process killed (SIGKILL): that sample is a
timeout, and the other calls the broken pool took down with it are scored again in a fresh pool.
A backstop bounds the whole batch too (``timeout_s * ceil(B / num_workers) + max(timeout_s, 5)``
seconds after the workers have started and imported the function).
In-process (``num_workers = 0``) the alarm works only on the main thread of a platform with
``SIGALRM``; elsewhere calls run without a timeout (a warning says so once), and a call that
blocks the alarm cannot be stopped: use workers.
"""
from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

log = logging.getLogger(__name__)

OK, ERROR, TIMEOUT, NONFINITE = "ok", "error", "timeout", "nonfinite"
# largest float32: a larger finite float64 becomes inf in the (B,) float32 rewards tensor
FLOAT32_MAX = 3.4028234663852886e38
_LOST = (ERROR, "lost with a broken worker pool")  # placeholder until re-scored alone
_REQUEUE = (ERROR, "taken down by a killed worker")  # placeholder until re-scored (as a batch)
# seconds past timeout_s before a worker whose call ignored the alarm is killed: the alarm's own
# exception and the result's trip back through the pool take well under this
KILL_GRACE_S = 1.0


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


# how every call is made (``_call``): three positional arguments
CALL = "fn(response_text, fields, metadata)"


def check_reward_signature(fn: Callable[..., Any], path: str) -> None:
    """Refuse a function flowrl's call :data:`CALL` cannot bind to (too few or too many
    parameters, a required keyword-only one), which would otherwise fail on every sample at run
    time. ``*args`` / ``**kwargs`` and parameters with defaults bind as Python binds them; a
    callable ``inspect`` has no signature for (some builtins) is accepted (nothing to check).

    Raises:
        ValueError: naming ``path``, the function's signature and the reason it cannot bind.
    """
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature: the call itself will tell
        return
    try:
        sig.bind("", {}, {})
    except TypeError as e:
        raise ValueError(f"path: reward function {path!r} takes {sig}, but flowrl calls it as "
                         f"{CALL} ({e}); define it as def f(response_text: str, fields: dict, "
                         "metadata: dict) -> float | dict[str, float]") from None


class _Timeout(BaseException):
    """Raised by the alarm handler; BaseException so a user's ``except Exception`` can't eat it."""


def _on_alarm(signum, frame):  # pragma: no cover - runs inside the signal handler
    raise _Timeout()


def _alarm_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


class _Row(dict):
    """A row's fields as the function gets them, remembering a key it asked for and lacked."""

    missing: object = None

    def __missing__(self, key: object) -> Any:
        self.missing = key
        raise KeyError(key)


def _call(fn: Callable, text: str, fields: dict, meta: dict,
          timeout_s: Optional[float]) -> tuple[str, Any]:
    """Run one call: ``(OK, value)``, ``(ERROR, repr)`` or ``(TIMEOUT, None)``."""
    delay = float(timeout_s) if timeout_s and _alarm_usable() else None  # None: no alarm
    old = signal.signal(signal.SIGALRM, _on_alarm) if delay is not None else None
    row = _Row(fields)
    try:
        if delay is not None:
            signal.setitimer(signal.ITIMER_REAL, delay)
        try:
            return OK, fn(text, row, meta)
        finally:
            if delay is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:
        return TIMEOUT, None
    except KeyError as e:  # a data column the row does not carry: say how to bring it
        key = e.args[0] if e.args else None
        if isinstance(key, str) and row.missing == key:
            return ERROR, (f"{e!r}: the row's fields are {sorted(fields)}; another column of the "
                           f"data file comes with data.extra_keys=[{key}]")
        return ERROR, repr(e)
    except Exception as e:
        return ERROR, repr(e)
    finally:
        if delay is not None:
            signal.signal(signal.SIGALRM, old)


_WORKER_FNS: dict[str, Callable] = {}
_STARTS: Any = None  # the worker's end of the parent's SimpleQueue of call starts


def _worker_init(starts: Any) -> None:
    """Pool initializer: keep the queue each call reports its start on."""
    global _STARTS
    _STARTS = starts


def _worker_call(path: str, text: str, fields: dict, meta: dict,
                 timeout_s: Optional[float], task: int = -1) -> tuple[str, Any]:
    """Process-pool entry point (top level: picklable); caches the imported function. Reports
    ``(task, pid, time.monotonic())`` first (a SimpleQueue writes at once, no feeder thread), so
    the parent can kill this process if the call outlives its alarm."""
    if _STARTS is not None:
        _STARTS.put((task, os.getpid(), time.monotonic()))
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
        self._starts: Any = None  # the SimpleQueue the pool's workers report call starts on
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
        # calls a killed worker's pool took down with it: not suspects, scored again together
        while again := [i for i, r in enumerate(out) if r is _REQUEUE]:
            for i, r in zip(again, self._run_batch([items[i] for i in again])):
                out[i] = r
        lost = [i for i, r in enumerate(out) if r is _LOST]
        if lost:
            log.warning("reward function %s: a worker process died (os._exit, a crash, an OOM "
                        "kill?); scoring the %d sample(s) it took down one at a time in a fresh "
                        "pool", self.path, len(lost))
            for i in lost:  # alone, a death is this sample's own
                r = self._run_batch([items[i]])[0]
                while r is _REQUEUE:  # cannot happen alone (nothing else to take down): defensive
                    r = self._run_batch([items[i]])[0]
                out[i] = (ERROR, "the reward worker process died while scoring this sample") \
                    if r is _LOST else r
        return out

    def _run_batch(self, items) -> list[tuple[str, Any]]:
        """Submit ``items`` to the pool and collect them, killing the worker of any call that
        runs ``timeout_s + KILL_GRACE_S`` past its start (its sample: a timeout). A sample lost
        to a pool a worker's own death broke is ``_LOST``; one lost to a kill of ours is
        ``_REQUEUE``; the broken pool is replaced on the next call."""
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            self._starts = ctx.SimpleQueue()
            self._pool = ProcessPoolExecutor(self.num_workers, mp_context=ctx,
                                             initializer=_worker_init, initargs=(self._starts,))
            # start every worker and import the function before the clock runs: spawning and
            # importing (seconds on a loaded machine) must not count against timeout_s
            wait([self._pool.submit(_worker_load, self.path) for _ in range(self.num_workers)])
        try:
            futures: list[Future] = [self._pool.submit(_worker_call, self.path, t, f, m,
                                                       self.timeout_s, i)
                                     for i, (t, f, m) in enumerate(items)]
        except BrokenProcessPool:  # broke while submitting (a worker died already)
            self._kill_pool()
            return [_LOST] * len(items)
        killed = self._watch(futures)
        if killed:  # a killed worker broke the pool: the next call gets a fresh one
            self._kill_pool()
        out: list[tuple[str, Any]] = []
        for i, fut in enumerate(futures):
            if i in killed:
                out.append((TIMEOUT, None))
                continue
            try:
                out.append(fut.result())
            except BrokenProcessPool:  # a worker died: this sample may or may not be the cause
                out.append(_REQUEUE if killed else _LOST)
                self._kill_pool()
            except Exception as e:  # an unpicklable result
                out.append((ERROR, repr(e)))
        return out

    def _watch(self, futures: list[Future]) -> set[int]:
        """Wait for ``futures``; returns the tasks that timed out: those whose worker was killed
        past its deadline and, past the backstop budget (the whole pool is killed then), those
        still pending. Without ``timeout_s`` this only waits."""
        if not self.timeout_s:
            wait(futures)
            return set()
        limit = self.timeout_s + KILL_GRACE_S
        rounds = -(-len(futures) // self.num_workers)
        budget = self.timeout_s * rounds + max(self.timeout_s, 5.0)
        end = time.monotonic() + budget
        starts: dict[int, tuple[int, float]] = {}  # task -> (worker pid, start)
        killed: set[int] = set()
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=0.05)
            while self._starts is not None and not self._starts.empty():
                task, pid, t = self._starts.get()
                starts[task] = (pid, t)
            now = time.monotonic()
            for i, fut in enumerate(futures):
                if fut in pending and i in starts and i not in killed and \
                        now - starts[i][1] > limit:
                    log.warning("reward function %s: a call still running %.1f s after its "
                                "timeout_s=%g (it ignores SIGALRM?); killing its worker "
                                "process %d", self.path, now - starts[i][1] - self.timeout_s,
                                self.timeout_s, starts[i][0])
                    try:
                        os.kill(starts[i][0], signal.SIGKILL)
                    except ProcessLookupError:  # it ended on its own meanwhile
                        pass
                    killed.add(i)
            if pending and now > end:
                log.warning("reward function %s: %d call(s) still running after %.1f s; killing "
                            "the worker pool", self.path, len(pending), budget)
                self._kill_pool()
                killed |= {i for i, fut in enumerate(futures) if fut in pending}
                break
        return killed

    def _kill_pool(self) -> None:
        """Kill the workers now: a pool cannot cancel a task that is already running.

        Python >= 3.14 has ``kill_workers``; before it the pool's processes are only
        reachable through its ``_processes`` attribute.
        """
        pool, self._pool, self._starts = self._pool, None, None
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
