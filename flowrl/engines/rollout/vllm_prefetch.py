"""vLLM's model-class inspection, done while the trainer loads its model instead of after it.

Why: vLLM looks up what a model class supports (``ModelRegistry``: ``_ModelInfo``) in a file cache
(``$VLLM_CACHE_ROOT/modelinfos``); on a miss it starts a Python process that imports vLLM and the
model's module only to answer that, so that the caller's process does not initialise CUDA. On a
fresh H200 that process took 27 s of the default job's engine build (between vLLM's
"Enabling cumem allocator" and "Resolved architecture" lines, ``first_step_h200_logs/2026-12-04``,
round 1; 0 s on the warm round 2), and an engine process each pays it again where the cache is
cold. On this repo's 2-core CPU box the in-process engine builds in 16-21 s with a cold cache
against 6.3 s with a warm one.

:func:`start` answers it in a background process of its own (the registry's inspection in that
process, which holds no CUDA context either, so the registry's own extra process is not needed),
started as soon as ``flowrl train`` has accepted the run, so it runs beside the machine check and
the model load; the rollout builder :meth:`ModelInfoPrefetch.wait`\\ s for it, so vLLM then finds
its cache. Started at the model load instead (through ce93b88), the H100's cold default job
waited 10.5 s of its 17.8 s; started after looking up the model type's class name in
transformers' tables (through b1cbc10), it began 10.9 s into a cold H100's start-up, 6.7 s of
them that import, and the build still waited 6.9 s for it (``first_step_h200.md``, 2026-12-07): the
process now looks the class up itself. One prefetch per model type per process
(:data:`_RUNNING`): the builder takes the one already running. Nothing is started when the
cache evidently holds the class (:func:`likely_cached`); a failure of the prefetch changes
nothing (vLLM inspects the class itself, as without it); :func:`cancel_all` ends them where the
run is refused after all.
"""
from __future__ import annotations

import atexit
import glob
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger("flowrl")

# run by the background process, given a transformers model type (this module's own lookups): the
# causal-LM class of the type (transformers' table: importing it took ~6.7 s of a cold H100's
# start-up in the parent, before this process could start), nothing more when vLLM's cache has
# it, else vLLM's own inspection of the class, with the registry's "run it in a fresh process"
# done in this (already fresh) process, then its cache written
_SCRIPT = """
import sys
from flowrl.engines.rollout.vllm_prefetch import cached, causal_lm_architecture
arch = causal_lm_architecture(sys.argv[1])
if arch is None:
    sys.exit(4)
if cached(arch):
    sys.exit(5)
from vllm.model_executor.models import registry
model = registry.ModelRegistry.models.get(arch)
if model is None:
    sys.exit(3)
registry._run_in_subprocess = lambda fn: fn()
model.inspect_model_cls()
"""
# the script's exits that are not failures: 5 = vLLM's cache had the class already
_EXIT_CACHED = 5


def cache_dir() -> Path:
    """vLLM's model-info cache folder (``VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm``, else
    ``~/.cache/vllm``; then ``modelinfos``), found without importing vLLM."""
    root = os.environ.get("VLLM_CACHE_ROOT")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "vllm")
    return Path(os.path.expanduser(root)) / "modelinfos"


def cached(architecture: str) -> bool:
    """vLLM's cache holds an entry for ``architecture`` (its file is named
    ``<module>-<class>.json``). A stale entry (vLLM upgraded) counts as cached: vLLM then
    inspects the class itself, once."""
    return any(cache_dir().glob(f"*-{architecture}.json"))


def likely_cached(model_type: str) -> bool:
    """vLLM's cache holds a causal-LM class of vLLM's module named like ``model_type``
    (``vllm-model_executor-models-llama-LlamaForCausalLM.json`` for ``llama``), told without
    importing transformers for the type's class name. A type whose vLLM module is named
    otherwise reads as not cached: the prefetch process then finds the entry itself and exits."""
    return any(cache_dir().glob(f"*-models-{glob.escape(model_type)}-*ForCausalLM.json"))


def causal_lm_architecture(model_type: Optional[str]) -> Optional[str]:
    """The transformers causal-LM class name of ``model_type`` (``llama`` -> ``LlamaForCausalLM``,
    what flowrl's vLLM export writes in ``config.json``), None when transformers has none.
    Imports transformers' auto-model tables (seconds on a cold machine)."""
    if model_type is None:
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


class ModelInfoPrefetch:
    """A running (or finished) prefetch of one model type's model info.

    Attributes:
        model_type: the transformers model type (``llama``) whose causal-LM class is inspected.
        proc: the background process (None: it was waited for, or cancelled).
    """

    def __init__(self, model_type: str, proc: Optional[subprocess.Popen]) -> None:
        self.model_type, self.proc = model_type, proc
        self.started = time.perf_counter()

    def wait(self, timeout_s: float = 180.0) -> Optional[float]:
        """Block until the prefetch ends (at most ``timeout_s``; then it is killed and vLLM
        inspects the class itself). Returns the seconds waited here, None when nothing ran."""
        if self.proc is None:
            return None
        t0 = time.perf_counter()
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = None
        waited = time.perf_counter() - t0
        took = time.perf_counter() - self.started
        if rc == 0:
            log.info("start-up: vLLM's model info for model type %r prefetched in %.1f s "
                     "(waited %.1f s for it)", self.model_type, took, waited)
        elif rc == _EXIT_CACHED:
            log.info("start-up: vLLM's model info for model type %r was in its cache (checked in "
                     "%.1f s, waited %.1f s)", self.model_type, took, waited)
        else:  # vLLM inspects the class itself: slower, not wrong
            log.info("start-up: vLLM's model-info prefetch for model type %r did not finish (%s); "
                     "vLLM inspects the class itself", self.model_type,
                     "timed out" if rc is None else
                     "no transformers causal-LM class" if rc == 4 else f"exit {rc}")
        self.proc = None
        return waited


# this process's prefetches by model type: started early by `flowrl train`, taken by the builder
_RUNNING: dict[str, ModelInfoPrefetch] = {}


def start(model_type: Optional[str]) -> Optional[ModelInfoPrefetch]:
    """Start the prefetch of ``model_type``'s causal-LM class unless vLLM's cache evidently has
    it (:func:`likely_cached`) or the type is None; the one this process already started for
    it, while that has not been waited for. The class name is looked up in the background
    process, not here: this returns in milliseconds whatever is imported yet.

    Returns the handle to :meth:`ModelInfoPrefetch.wait` on before the engine is built, or None.
    The process inherits this environment (``VLLM_CACHE_ROOT`` included), writes nothing but
    vLLM's cache file, and prints nothing (its output is discarded).
    """
    if model_type is None:
        return None
    running = _RUNNING.get(model_type)
    if running is not None and running.proc is not None:
        return running
    if likely_cached(model_type):
        return None
    try:
        proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, model_type],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError as e:  # no process to spare: vLLM does it later itself
        log.info("start-up: vLLM's model-info prefetch not started (%s)", e)
        return None
    if not _RUNNING:  # a run that fails inside its job (a refused resume) leaves none behind
        atexit.register(cancel_all)
    _RUNNING[model_type] = handle = ModelInfoPrefetch(model_type, proc)
    return handle


def cancel_all() -> None:
    """End every prefetch this process started and nobody waited for (a run refused after its
    prefetch started): no process outlives the refusal."""
    for handle in list(_RUNNING.values()):
        if handle.proc is not None:
            handle.proc.kill()
            handle.proc.wait()
            handle.proc = None
    _RUNNING.clear()


__all__ = ["ModelInfoPrefetch", "cache_dir", "cached", "cancel_all", "causal_lm_architecture",
           "likely_cached", "start"]
