"""vLLM engines in child processes (``rollout.vllm.engine_procs`` >= 1, or null on CUDA; always
on a partitioned rollout pool).

Why a process of its own: an in-process ``vllm.LLM`` initialises vLLM's parallel state on the
caller's torch world, creating process groups over *every* rank of the job. On a partitioned
rollout pool the train ranks never join those collectives and the rollout rank hangs. A child
started with ``spawn`` has no torch world; vLLM makes its own one-process world there. The same
mechanism runs several engines on one device, each with a slice of the batch: vLLM's scheduler and
output processing cost ~20 µs of host Python per running request per decode step
(benchmarks/results/rollout_h200.md), so N engines spread that work over N host cores.

Dataflow (one engine process per box; the parent is the rank's controller)::

    parent: generate(B prompts) ──split at group boundaries──▶ engine 0: rows [0, b1)
                                                          ├──▶ engine 1: rows [b1, b2) ...
            ◀── (response_ids, response_mask, rollout_logprobs, truncated) per slice, padded + joined
    parent: load_weights(named) ──buckets of (name, tensor) handles──▶ every engine (same tensors:
            CUDA IPC on GPU, pickled on CPU; the buffers kept for the next load: StagingBuffers)

Each child runs :class:`~flowrl.engines.rollout.vllm.VLLMRolloutEngine` in-process on the parent's
export, so sampling, logprob, sleep and load semantics are that engine's, per child. A child does
its imports first and then waits for its build request (the export and its share of the
config), so `flowrl train` can start the children before the model loads (:func:`start_ahead`).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import shutil
import signal
import time
import traceback
import weakref
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

from flowrl.engines.base import RolloutBatch, SamplingConfig
from flowrl.engines.rollout.vllm import (
    _groups,
    _prompt_rows,
    export_policy,
    weights_and_device_memory,
)
from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig, check_model_for_vllm
from flowrl.models.lora import LoraAdapterSpec

log = logging.getLogger("flowrl")

# the torchrun variables of the parent's job: vLLM must not see them (it would join that world)
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
_ERRORS = {"ValueError": ValueError, "KeyError": KeyError, "RuntimeError": RuntimeError}
_BUCKET_BYTES = 64 << 20  # tensor handles per message: fewer round trips, bounded message size


def engine_share(cfg: VLLMRolloutConfig, procs: int, index: int) -> VLLMRolloutConfig:
    """Engine ``index`` of ``procs``'s configuration: the rank's totals divided evenly.

    ``max_num_seqs`` (and a set ``max_cudagraph_capture_size``) become ceil(total / procs);
    ``gpu_memory_utilization`` and ``kv_cache_memory_gb`` total / procs; seeds differ per engine.
    """
    share = lambda v: None if v is None else math.ceil(v / procs)  # noqa: E731
    return dataclasses.replace(
        cfg, engine_procs=0, max_num_seqs=math.ceil(cfg.max_num_seqs / procs),
        max_cudagraph_capture_size=share(cfg.max_cudagraph_capture_size),
        gpu_memory_utilization=cfg.gpu_memory_utilization / procs,
        kv_cache_memory_gb=None if cfg.kv_cache_memory_gb is None else cfg.kv_cache_memory_gb / procs,
        seed=cfg.seed + index)


def split_groups(rows: list[list[int]], greedy: bool, parts: int,
                 images: Mapping[str, Tensor] | None = None) -> list[tuple[int, int]]:
    """Contiguous row ranges, one per engine, never splitting a group of identical prompts (its
    ``n`` samples are one vLLM request sharing the prefix cache); sizes as equal as groups allow.
    Fewer ranges than ``parts`` when there are fewer groups. Greedy rows are each their own group.
    With ``images``, a group's rows also have equal images.

    Returns:
        ``[(start, end), ...]`` covering ``range(len(rows))`` in order, each non-empty.
    """
    sizes = [1] * len(rows) if greedy else [k for _, k in _groups(rows, images)]
    bounds: list[tuple[int, int]] = []
    start = done = 0
    for k in sizes:
        done += k
        # close the range once it reaches its share of what is left for the remaining parts
        left_parts = parts - len(bounds)
        if left_parts > 1 and done - start >= (len(rows) - start) / left_parts:
            bounds.append((start, done))
            start = done
    if start < len(rows):
        bounds.append((start, len(rows)))
    return bounds


def _child_env(device: torch.device) -> dict[str, str]:
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
    return env


def _serve(conn, env: dict[str, str]) -> None:
    """Engine process main loop: the imports, then ``("build", export, cfg)`` (the engine), then
    one request in, one reply out, until ``close`` or EOF. The imports come first, before the
    parent has a model to export: a process started ahead (:func:`start_ahead`) pays them
    beside the parent's model load."""
    # Ctrl-C reaches the whole process group: the parent handles it and closes its engines (or
    # dies, and this loop sees EOF); a traceback from here would only be noise
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for k in list(os.environ):
        if k in _JOB_VARS or k.startswith("TORCHELASTIC_"):
            del os.environ[k]
    os.environ.update(env)
    failed: BaseException | None = None
    t0 = time.perf_counter()
    try:
        # vLLM's engine imports too, not only flowrl's module (which imports vLLM lazily): a
        # process started ahead pays them before the build request instead of after it
        from flowrl.engines.rollout.vllm import VLLMRolloutEngine, import_vllm_engine

        import_vllm_engine()
    except BaseException as e:  # noqa: BLE001 (reported when the build is asked for)
        failed = e
    imported = time.perf_counter()
    try:
        msg = conn.recv()
    except EOFError:  # the parent is gone (a run refused, or ended, before its engines were built)
        return
    # how long the imports took, and how long the process then waited for its build request
    # (0 when the request was already there: the imports were on the build's critical path)
    imports = {"imports_s": imported - t0, "idle_s": time.perf_counter() - imported}
    if msg[0] != "build":  # "close": started ahead, never needed
        return
    _, exported, cfg = msg
    try:
        if failed is not None:
            raise failed
        engine = VLLMRolloutEngine.from_export(exported, cfg)
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which raises it)
        conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
        return
    if engine.on_cuda and cfg.serve_threads is not None:
        # from here on this process only serves (rollout.vllm.serve_threads: why 1)
        torch.set_num_threads(cfg.serve_threads)
    conn.send(("ok", {"sleep_supported": engine.sleep_supported,
                      "weight_load_path": engine.weight_load_path,
                      "serve_threads": torch.get_num_threads(), **imports}))

    ended = [True]
    # bucket position -> the parent's staging buffer, mapped once (CUDA IPC): later loads refill
    # the same buffers (StagingBuffers), so nothing is exported again (see load_weights)
    mapped: dict[int, Tensor] = {}

    def stream() -> Iterator[tuple[str, Tensor]]:
        while True:
            msg = conn.recv()
            if msg[0] == "end":
                ended[0] = True
                return
            _, index, payload, metas = msg
            if isinstance(payload, _CudaHandle):  # a new buffer at this position
                mapped[index] = payload.tensor()
            # None: the buffer mapped at an earlier load, refilled; on CPU the bucket itself
            flat = payload if isinstance(payload, Tensor) else mapped[index]
            yield from unpack_bucket(flat, metas)

    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent is gone
            break
        op = msg[0]
        if op == "close":
            break
        try:
            if op == "generate":
                _, ids, mask, params, seed, images = msg
                gen = None if seed is None else torch.Generator().manual_seed(seed)
                out = engine.generate(ids, mask, params, generator=gen, images=images)
                reply: Any = (out.response_ids, out.response_mask, out.rollout_logprobs,
                              out.truncated, engine.last_prefix_cache)
            elif op == "load":
                ended[0] = False
                try:
                    engine.load_weights(stream())
                    if mapped:  # every read of the parent's buffers done before it refills them
                        torch.cuda.synchronize()
                finally:
                    while not ended[0]:  # an error mid-load: read up to "end", stay in step
                        ended[0] = conn.recv()[0] == "end"
                # no gc.collect() here: it cost 0.59 s per load in a training run's engine and
                # released nothing the parent's ipc_collect could then free
                # (benchmarks/results/weight_sync_h200.md)
                reply = engine.last_load_counts
            elif op == "samples":
                reply = engine.weight_samples(msg[1])
            elif op == "sleep":
                engine.sleep(msg[1])
                reply = None
            elif op == "wake":
                engine.wake()
                reply = None
            else:
                raise ValueError(f"unknown engine-process request {op!r}")
            conn.send(("ok", reply, engine.last_timings))
        except Exception as e:  # noqa: BLE001 (the parent re-raises it; the engine lives on)
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
    engine.close()
    conn.close()


class VLLMProcessEngine:
    """:class:`flowrl.engines.base.RolloutEngine` over ``procs`` vLLM engine processes on this
    rank's device; same contract as :class:`~flowrl.engines.rollout.vllm.VLLMRolloutEngine`.

    Args:
        model: the policy (HF causal LM, on the rank's device); exported once, read by every engine.
        tokenizer: gives EOS / pad ids.
        cfg: ``rollout.vllm``; memory and concurrency settings are this rank's totals
            (:func:`engine_share`).
        procs: engine processes (>= 1); None = ``cfg.engine_procs_for(..., own_process=True)``.
        image_processor: a vision-language model's image processor (``export_policy``).
        lora: a LoRA policy's adapters (``flowrl.models.lora.adapter_spec``); with
            ``cfg.lora_sync_for(lora) == "adapter"`` every engine serves them as a
            ``LoRARequest`` and a sync carries the adapter tensors only (as in-process).

    Attributes:
        sleep_supported: vLLM really frees memory on sleep (CUDA); False on CPU.
        last_timings: seconds of the last call; per key the slowest engine (``generate_s`` is the
            parent's wall time of the whole call).
        last_load_counts: ``{"tensors": n, "bytes": b}`` the last ``load_weights`` sent.
        weight_load_path: "direct" or "reload", as the engines resolved ``weight_load``.
        serve_threads: torch intra-op CPU threads of each engine process once built
            (``cfg.serve_threads`` on CUDA; torch's default on CPU).
        last_prefix_cache: prompt tokens of the last ``generate`` and how many the engines'
            prefix caches served, summed over the engines.

    Raises:
        ValueError: a model vLLM's CPU kernel cannot run; ``procs < 1``.
        RuntimeError / ValueError / KeyError: an engine process failed (its traceback is in the
            message); ``RuntimeError`` when one died.
    """

    # vLLM takes prompts as token lists and returns host tensors: its batch lives on the host
    # (the executor moves a stage's inputs here, the store moves the outputs home)
    device = torch.device("cpu")
    shared = False  # the engines hold their own copy of the weights

    def __init__(self, model: nn.Module, tokenizer, cfg: VLLMRolloutConfig | None = None,
                 procs: int | None = None, image_processor: Any = None,
                 lora: LoraAdapterSpec | None = None) -> None:
        self.cfg = cfg = cfg or VLLMRolloutConfig()
        self.lora_sync = cfg.lora_sync_for(lora)  # a refused adapter path fails before any start
        if procs is None:
            procs = cfg.engine_procs_for(*weights_and_device_memory(model), own_process=True)
        self.procs_n = procs
        if self.procs_n < 1:
            raise ValueError(f"VLLMProcessEngine: procs must be >= 1, got {procs}")
        device = next(model.parameters()).device
        check_model_for_vllm(model.config, on_cpu=device.type != "cuda")
        # the rank's cache total, split by engine_share (on CPU a fixed size: see the config)
        self.cfg = cfg = dataclasses.replace(cfg, kv_cache_memory_gb=cfg.kv_cache_gb_on(
            device.type != "cuda"))
        self.exported = dataclasses.replace(
            export_policy(model, tokenizer, cfg.model_dir, image_processor), lora=lora)
        tmp_dir = None  # model_dir (the caller's) or the content-addressed export: kept
        # what a sync delivers: the adapters (lora_sync="adapter") or the full weight set
        self.weight_names = lora.tensor_names if lora is not None and \
            self.lora_sync == "adapter" else self.exported.weight_names
        self.eos_token_id, self.pad_token_id = self.exported.eos_token_id, self.exported.pad_token_id
        env = _child_env(device)
        self._staging = StagingBuffers()
        # vLLM sizes its KV cache from the device-wide memory it sees used while it loads: engines
        # profiling side by side would count each other's allocations. They are built one after
        # the other unless the cache size is fixed (kv_cache_memory_gb), then side by side.
        one_by_one = device.type == "cuda" and cfg.kv_cache_memory_gb is None
        ready: list[tuple[Any, dict]] = []
        t0 = time.perf_counter()
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        try:
            # the processes: those `flowrl train` started ahead (imports done or under way), the
            # rest now; all are spawned before any builds (the imports need no device memory)
            spawned, ahead = _take(self.procs_n, env)
            self._conns += [sp.conn for sp in spawned]
            self._procs += [sp.proc for sp in spawned]
            how = "one after the other (vLLM sizes each KV cache)" if one_by_one else "side by side"
            log.info("building %d vLLM engine process(es) on %s, %s%s", self.procs_n, device, how,
                     f" ({ahead} started ahead, beside the model load)" if ahead else "")
            for i in range(self.procs_n):
                self._send(i, ("build", self.exported, engine_share(cfg, self.procs_n, i)))
                if one_by_one:
                    ready += self._collect([i])
                    log.info("  vLLM engine %d/%d ready at %.1f s", i + 1, self.procs_n,
                             time.perf_counter() - t0)
            if not one_by_one:
                for i in range(self.procs_n):  # in order: each line says when that one was up
                    ready += self._collect([i])
                    log.info("  vLLM engine %d/%d ready at %.1f s", i + 1, self.procs_n,
                             time.perf_counter() - t0)
        except BaseException:
            _shutdown(self._conns, self._procs, tmp_dir)
            raise
        # close(), garbage collection and interpreter exit all run this once; at exit it runs
        # before multiprocessing joins its children (it would wait for engine processes forever)
        self._finalizer = weakref.finalize(self, _shutdown, self._conns, self._procs, tmp_dir)
        self.sleep_supported = all(r["sleep_supported"] for r, _ in ready)
        # every engine resolves rollout.vllm.weight_load on the same model: one path
        self.weight_load_path = ready[0][0]["weight_load_path"]
        # torch CPU threads each engine process serves with (rollout.vllm.serve_threads)
        self.serve_threads = [r["serve_threads"] for r, _ in ready]
        log.info("vLLM engine processes serve with %s torch thread(s) each",
                 "/".join(map(str, sorted(set(self.serve_threads)))))
        # per process: its imports (torch's import precedes them) and its idle wait for the build
        self.import_timings = [{"imports_s": r["imports_s"], "idle_s": r["idle_s"]} for r, _ in ready]
        log.info("vLLM engine processes' imports (vLLM and its engine): %.1f s at most; %d of %d "
                 "done before their build request", max(t["imports_s"] for t in self.import_timings),
                 sum(t["idle_s"] > IDLE_BEFORE_BUILD_S for t in self.import_timings), self.procs_n)
        self.last_timings: dict[str, float] = {}
        self.last_load_counts: dict[str, int] = {"tensors": 0, "bytes": 0}
        self.last_prefix_cache: dict[str, int] = {"prompt_tokens": 0, "cached_tokens": 0}

    # ------------------------------------------------------------------ plumbing
    def _dead(self, i: int) -> RuntimeError:
        proc = self._procs[i]
        proc.join(timeout=5)
        hint = ""
        if proc.exitcode == -9:  # SIGKILL: what the kernel's OOM killer sends
            hint = (" (killed by SIGKILL: often the kernel's out-of-memory killer; a smaller "
                    "rollout.vllm.kv_cache_memory_gb or gpu_memory_utilization may help)")
        return RuntimeError(f"vLLM engine process {i} (pid {proc.pid}) died (exit code "
                            f"{proc.exitcode}){hint}; the rollout engine cannot continue")

    def _send(self, i: int, msg: tuple) -> None:
        try:
            self._conns[i].send(msg)
        except (BrokenPipeError, ConnectionResetError):
            raise self._dead(i) from None

    def _recv(self, i: int):
        conn, proc = self._conns[i], self._procs[i]
        while not conn.poll(1.0):
            if not proc.is_alive() and not conn.poll(0):
                raise self._dead(i)
        try:
            return conn.recv()
        except (EOFError, ConnectionResetError):
            raise self._dead(i) from None

    def _collect(self, which: Iterable[int] | None = None) -> list[tuple[Any, dict]]:
        """Every engine's reply (all are read even after an error, to stay in step); raises the
        first error as its own type with the engine's traceback."""
        replies: list[tuple[Any, dict]] = []
        error: Exception | None = None
        for i in (range(len(self._conns)) if which is None else which):
            msg = self._recv(i)
            if msg[0] == "ok":
                replies.append((msg[1], msg[2] if len(msg) > 2 else {}))
            elif error is None:
                _, name, text, tb = msg
                error = _ERRORS.get(name, RuntimeError)(
                    f"{text} (in vLLM engine process {i}; its traceback:\n{tb})")
        if error is not None:
            raise error
        return replies

    def _all(self, *msg) -> list[tuple[Any, dict]]:
        for i in range(len(self._conns)):
            self._send(i, msg)
        replies = self._collect()
        self.last_timings = _slowest(t for _, t in replies)
        return replies

    def weight_samples(self, index: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``engines.base.WeightReadback`` over every engine process: per name, the values of
        the first engine whose values differ from engine 0's (else engine 0's), so one stale
        engine is enough to fail the check. Keeps ``last_timings`` (the load's)."""
        timings = self.last_timings
        replies = [r for r, _ in self._all("samples", dict(index))]
        self.last_timings = timings
        out: dict[str, Tensor] = {}
        for name, first in replies[0].items():
            others = [r[name] for r in replies[1:] if name in r]
            out[name] = next((v for v in others if not torch.equal(v, first)), first)
        return out

    # ------------------------------------------------------------------ RolloutEngine
    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingConfig,
                 generator: torch.Generator | None = None,
                 images: Mapping[str, Tensor] | None = None) -> RolloutBatch:
        """Sample one response per prompt row, the rows split between the engines.

        Args/Returns/Raises: as ``VLLMRolloutEngine.generate``. With a ``generator``, one seed per
        engine slice is drawn from it: the same generator state, inputs and ``procs`` give the same
        samples (a different ``procs`` splits differently, hence other samples). ``images``: each
        engine gets its rows' slice of them.
        """
        self.cfg.check_sampling(params)
        t0 = time.perf_counter()
        rows = _prompt_rows(prompt_ids, prompt_mask)
        vis = None if images is None else {k: v.cpu() for k, v in images.items()}
        ranges = split_groups(rows, params.temperature == 0, self.procs_n, vis)
        seeds: list[int | None] = [None] * len(ranges)
        if generator is not None:
            seeds = torch.randint(0, 2**62, (len(ranges),), generator=generator).tolist()
        ids, mask = prompt_ids.cpu(), prompt_mask.cpu()
        for i, ((a, b), seed) in enumerate(zip(ranges, seeds)):
            part = None if vis is None else {k: v[a:b].clone() for k, v in vis.items()}
            self._send(i, ("generate", ids[a:b].clone(), mask[a:b].clone(), params, seed, part))
        replies = self._collect(range(len(ranges)))
        parts = [r for r, _ in replies]
        R = max(p[0].shape[1] for p in parts)
        pad = lambda t, v: torch.nn.functional.pad(t, (0, R - t.shape[1]), value=v)  # noqa: E731
        dev = prompt_ids.device
        out = RolloutBatch(
            response_ids=torch.cat([pad(p[0], self.pad_token_id) for p in parts]).to(dev),
            response_mask=torch.cat([pad(p[1], False) for p in parts]).to(dev),
            rollout_logprobs=torch.cat([pad(p[2], 0.0) for p in parts]).to(dev),
            truncated=torch.cat([p[3] for p in parts]).to(dev))
        self.last_timings = {**_slowest(t for _, t in replies),
                             "generate_s": time.perf_counter() - t0}
        self.last_prefix_cache = {k: sum(p[4][k] for p in parts)
                                  for k in ("prompt_tokens", "cached_tokens")}
        return out

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load a full set of HF-named weights into every engine; their prefix caches are reset.

        The tensors travel in buckets of ~64 MiB, each copied into one flat buffer
        (:func:`pack_bucket`) that crosses as one handle (CUDA IPC on GPU, pickled on CPU):
        torch's IPC costs per tensor (an event, a reference counter, a mapping in each engine),
        and a model has hundreds. The caller's own tensors are never shared.

        On CUDA the flat buffers are kept from one load to the next (:class:`StagingBuffers`):
        each is exported to the engines once, and later loads refill it in place. A fresh buffer
        per load leaked one copy of the weights per load in this process (+0.75 GiB per step at
        the 0.5B shape on the H100, 2026-12-06; ``benchmarks/results/weight_sync_h200.md``): torch
        keeps an exported block until the engines' reference counts drop, and they never did.
        The cost is one standing copy of the weights (bf16: 2 bytes per parameter) here.

        Raises:
            KeyError: a name the exported model does not have (the engines then hold an incomplete
                load and refuse to generate until a complete one, as in-process).
            ValueError: the set was incomplete (raised by the engines).
        """
        t0 = time.perf_counter()
        for i in range(len(self._conns)):
            self._send(i, ("load",))
        self._staging.begin()  # it holds the flat buffers sent, from one load to the next
        bucket: list[tuple[str, Tensor]] = []
        size, bad = 0, None
        counts = {"tensors": 0, "bytes": 0}
        try:
            for name, t in named_tensors:
                if name not in self.weight_names:
                    bad = KeyError(f"load_weights: the rollout model has no tensor named {name!r}")
                    break
                t = t.detach()  # copied into the bucket's flat buffer by _send_bucket
                bucket.append((name, t))
                n = t.numel() * t.element_size()
                size += n
                counts["tensors"] += 1
                counts["bytes"] += n
                if size >= _BUCKET_BYTES:
                    self._send_bucket(bucket)
                    bucket, size = [], 0
            if bucket:
                self._send_bucket(bucket)
        finally:
            for i in range(len(self._conns)):
                self._send(i, ("end",))
        try:
            replies = self._collect()
        except (ValueError, KeyError):
            if bad is None:
                raise
            replies = []  # the engines' "incomplete load" follows from the bad name: report that
        finally:
            t_ipc = time.perf_counter()
            if any(flat.is_cuda for flat in self._staging.flats):
                # torch keeps every CUDA block it exported over IPC in a "limbo" until it sees the
                # consumers' reference counts drop to 0, and only looks when asked: a buffer
                # replaced at its position (another weight set) goes once the engines drop it
                torch.cuda.ipc_collect()
            ipc_s = time.perf_counter() - t_ipc
        if bad is not None:
            raise bad
        # per key the slowest engine (its vLLM reload: engine_load_weights_s), the parent's IPC
        # release, and the whole call's wall time
        engine_t = _slowest(t for _, t in replies)
        self.last_timings = {**{f"engine_{k}": v for k, v in engine_t.items()},
                             "ipc_collect_s": ipc_s, "load_weights_s": time.perf_counter() - t0}
        self.last_load_counts = counts

    def _send_bucket(self, bucket: list[tuple[str, Tensor]]) -> None:
        index, flat, metas, fresh = self._staging.pack(bucket)
        payload: Any = flat
        if flat.is_cuda:
            # the copies into the buffer are done before an engine reads it (a refilled buffer
            # carries no new IPC event for the engine to wait on)
            torch.cuda.current_stream(flat.device).synchronize()
            payload = _CudaHandle.of(flat) if fresh else None
        for i in range(len(self._conns)):
            self._send(i, ("bucket", index, payload, metas))

    def sleep(self, level: int | None = None) -> None:
        """Every engine sleeps (``VLLMRolloutEngine.sleep``: level 1, 2, or None = cfg)."""
        self._all("sleep", level)

    def wake(self) -> None:
        """Every engine wakes (``VLLMRolloutEngine.wake``)."""
        self._all("wake")

    def offload(self, keep_weights: bool = False) -> None:
        """The colocated swap point: :meth:`sleep` at ``rollout.vllm.sleep_level`` (the engines
        hold their own weights, so ``keep_weights`` changes nothing)."""
        self.sleep()

    def onload(self) -> None:
        """Inverse of :meth:`offload`: :meth:`wake`."""
        self.wake()

    def close(self) -> None:
        """Stop the engine processes and delete a temporary export directory (once)."""
        self._finalizer()


_ALIGN = 64  # bytes: every tensor of a flat bucket starts at a multiple (any dtype's alignment)
BucketMeta = tuple[str, torch.dtype, tuple[int, ...], int]  # name, dtype, shape, byte offset


def pack_bucket(bucket: list[tuple[str, Tensor]], into: Optional[Tensor] = None
                ) -> tuple[Tensor, list[BucketMeta]]:
    """Copy ``bucket``'s tensors into one flat uint8 buffer on their device.

    Args:
        bucket: ``(name, tensor)`` pairs, one device, any dtypes, shapes (0-d included) and
            strides.
        into: a buffer to fill instead of a new one, used when it has exactly the bucket's size
            and device (else a new buffer is made).

    Returns:
        ``(flat, metas)``: ``flat`` a (total bytes,) uint8 tensor on the bucket's device; per
        tensor ``(name, dtype, shape, offset)``, offsets multiples of 64 bytes.
        :func:`unpack_bucket` gives the tensors back, exactly, as views of ``flat``.

    Raises:
        ValueError: tensors on more than one device.
    """
    devices = {t.device for _, t in bucket}
    if len(devices) > 1:
        raise ValueError(f"pack_bucket: one device per bucket, got {sorted(map(str, devices))}")
    metas: list[BucketMeta] = []
    total = 0
    for name, t in bucket:
        metas.append((name, t.dtype, tuple(t.shape), total))
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    device = torch.device(next(iter(devices))) if devices else torch.device("cpu")
    fits = into is not None and into.numel() == total and into.device == device
    flat = into if into is not None and fits else torch.empty(total, dtype=torch.uint8, device=device)
    for (_, t), (_, dtype, shape, off) in zip(bucket, metas):
        _view(flat, dtype, shape, off).copy_(t)
    return flat, metas


class StagingBuffers:
    """The flat buffers of a weight load, kept by bucket position from one load to the next.

    A load packs its buckets in order (:meth:`begin`, then :meth:`pack` per bucket). The same
    model sends the same buckets every time, so each position's buffer is refilled in place and
    crosses to the engines only once (the engines keep it mapped). A bucket of another size or
    device (another weight set: LoRA adapters instead of the full set) gets a new buffer at its
    position, and the old one is dropped.
    """

    def __init__(self) -> None:
        self.flats: list[Tensor] = []
        self._next = 0

    def begin(self) -> None:
        """A new load starts: the next bucket is position 0."""
        self._next = 0

    def pack(self, bucket: list[tuple[str, Tensor]]) -> tuple[int, Tensor, list[BucketMeta], bool]:
        """The next bucket packed (:func:`pack_bucket`) into its position's buffer: (position,
        buffer, metas, fresh); ``fresh``: a new buffer (the engines have not seen it)."""
        index, self._next = self._next, self._next + 1
        old = self.flats[index] if index < len(self.flats) else None
        flat, metas = pack_bucket(bucket, into=old)
        if old is None:
            self.flats.append(flat)
        else:
            self.flats[index] = flat
        return index, flat, metas, flat is not old


def unpack_bucket(flat: Tensor, metas: list[BucketMeta]) -> Iterator[tuple[str, Tensor]]:
    """The tensors :func:`pack_bucket` packed, in order: views of ``flat`` (no copy)."""
    for name, dtype, shape, off in metas:
        yield name, _view(flat, dtype, shape, off)


def _view(flat: Tensor, dtype: torch.dtype, shape: tuple[int, ...], off: int) -> Tensor:
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return flat[off:off + nbytes].view(dtype).view(shape)


class _CudaHandle:
    """A CUDA tensor's IPC handle, re-addressed to device 0.

    torch rebuilds a shared CUDA tensor on the producer's device *ordinal*; an engine process sees
    only the parent's device, as its ``cuda:0`` (``_child_env``), so a parent on ``cuda:1`` would
    produce "invalid device ordinal". The handle, event and reference counter are torch's own
    (``torch.multiprocessing.reductions.reduce_tensor``); only the ordinal changes.
    """

    def __init__(self, rebuild, args: tuple) -> None:
        self.rebuild, self.args = rebuild, args

    @classmethod
    def of(cls, t: Tensor) -> "_CudaHandle":
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(t)
        args = list(args)
        args[6] = 0  # rebuild_cuda_tensor(..., dtype, storage_device, storage_handle, ...)
        return cls(rebuild, tuple(args))

    def tensor(self) -> Tensor:
        return self.rebuild(*self.args)


@dataclasses.dataclass
class _Spawned:
    """An engine process and the parent's end of its pipe; ``env`` as :func:`_child_env` gave it."""

    conn: Any
    proc: Any
    env: dict[str, str]


# an engine process that waited longer than this for its build request had finished its imports
# before the request came (the pipe's own latency is far below it)
IDLE_BEFORE_BUILD_S = 0.05
# engine processes `flowrl train` started ahead (start_ahead), waiting for their build request
_AHEAD: list[_Spawned] = []


def _spawn(env: dict[str, str]) -> _Spawned:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, name="flowrl-vllm", args=(child, env))
    proc.start()
    child.close()
    return _Spawned(parent, proc, env)


def start_ahead(n: int, device: torch.device) -> int:
    """Have ``n`` engine processes for ``device`` started now, before the model is loaded: each
    imports torch, vLLM and flowrl's engine (~20 s side by side on the H200, 2026-12-03's
    console: ``starting 4`` to vLLM's first line) while the parent checks the machine and loads
    the model; :class:`VLLMProcessEngine` then takes them (:func:`_take`). Processes nobody takes
    are stopped by :func:`discard_ahead` (the engines' build, a refused run, or exit). A second
    call for the same device only tops up to ``n`` (``flowrl train`` asks before the machine
    check and again inside the job). Returns how many were started."""
    env = _child_env(device)
    waiting = sum(s.env == env and s.proc.is_alive() for s in _AHEAD)
    todo = max(n - waiting, 0)
    if todo and not _AHEAD:
        atexit.register(discard_ahead)  # idle ones wait on their pipe: never left behind
    _AHEAD.extend(_spawn(env) for _ in range(todo))
    return todo


# seconds an unused engine process started ahead gets to read "close" before it is terminated:
# one still importing vLLM (~6 s) would otherwise hold a refused run's exit until its imports end
DISCARD_GRACE_S = 1.0


def discard_ahead() -> None:
    """Stop every engine process started ahead that no engine took: asked to close, then
    terminated after :data:`DISCARD_GRACE_S` (it holds no engine, no device memory yet)."""
    if _AHEAD:
        _shutdown([s.conn for s in _AHEAD], [s.proc for s in _AHEAD], None,
                  grace_s=DISCARD_GRACE_S)
        _AHEAD.clear()


def _take(n: int, env: dict[str, str]) -> tuple[list[_Spawned], int]:
    """``n`` engine processes for ``env``: those started ahead for it (alive), then new ones;
    returns them and how many were started ahead."""
    mine = [s for s in _AHEAD if s.env == env and s.proc.is_alive()][:n]
    for s in mine:
        _AHEAD.remove(s)
    return mine + [_spawn(env) for _ in range(n - len(mine))], len(mine)


def _shutdown(conns: list, procs: list, tmp_dir: str | None, grace_s: float = 60.0) -> None:
    """Ask each process to close, wait up to ``grace_s`` in all for them, then terminate the rest."""
    for c in conns:
        try:
            c.send(("close",))
        except (BrokenPipeError, OSError):
            pass
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(end - time.monotonic(), 0.0))
        if p.is_alive():
            p.terminate()
            p.join(timeout=10)
    if tmp_dir is not None:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _slowest(timings: Iterable[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in timings:
        for k, v in (t or {}).items():
            out[k] = max(out.get(k, 0.0), v)
    return out
