"""``launcher.mps``: a CUDA MPS daemon of the job's own, so that vLLM's engine processes and the
trainer share one GPU's SMs at once instead of taking the GPU in turns.

Why: separate processes are separate CUDA contexts, and without MPS a GPU runs one context at a
time in time slices. A colocated job with ``N >= 2`` vLLM engine processes per GPU
(``VLLMRolloutConfig.engine_procs_for``) decodes each engine's small batch in its own slice; under
MPS the engines' kernels run side by side. Measured on one H100 (e2e_vs_trl, Qwen2.5-0.5B shape,
256 sequences x 256 tokens per step, 4 engine processes): generate 1.42 s without MPS, 1.10 s
with it (benchmarks/results/e2e_vs_trl_h100.md). With one engine in the trainer's process there
is nothing to share: in the same run TRL's single in-process engine generated *slower* under MPS
(3.51 against 2.87 s), so ``auto`` starts MPS only for engine processes.

How (NVIDIA's MPS documentation, ``nvidia-cuda-mps-control(1)``): the CUDA driver of a process
connects to the control daemon whose pipe directory ``CUDA_MPS_PIPE_DIRECTORY`` names when CUDA
is first initialised in it (``cuInit``); without a daemon there it runs as it normally would.
flowrl starts ``nvidia-cuda-mps-control -d`` with a fresh private pipe directory before anything
of the job initialises CUDA, and sets that directory in its environment: the trainer and every
process it starts (vLLM's engine processes) become clients of it, and no other process of the
machine does. A watcher process quits the daemon and removes the directory once the job's
process has exited (normally, with an error, or killed).

Scope: one process per node (``launcher.nproc == 1``, one node); ``true`` is refused elsewhere
(multi-rank jobs with MPS are untested). A daemon of the user's own (``CUDA_MPS_PIPE_DIRECTORY``
already set) is joined, never started or stopped. Hydra multirun jobs (``flowrl train -m``)
start none.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    from flowrl.config import TrainConfig
    from flowrl.runtime.control.spec import Resolved

MPS_MODES = ("auto", "true", "false")
CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
# engine processes per GPU from which auto starts the daemon: with one (or an in-process engine)
# nothing else shares the GPU during a generate
MIN_ENGINE_PROCS = 2


class MPSError(ValueError):
    """``launcher.mps=true`` that this machine or run cannot honour (one line, naming the field)."""


@dataclass(frozen=True)
class MPSFacts:
    """What the decision reads of the machine and the process (each a fact the caller gathered).

    Attributes:
        control: path of ``nvidia-cuda-mps-control``, or None when not on PATH.
        compute_mode: the first visible GPU's compute mode as ``nvidia-smi`` prints it
            (``Default``, ``Exclusive_Process``, ``Prohibited``), or None when unknown / no GPU.
        device_memory: that GPU's memory in bytes, or None.
        cuda_initialized: torch already initialised CUDA in this process (its context, made
            before any daemon, can never join one).
        own_daemon: ``CUDA_MPS_PIPE_DIRECTORY`` is already set (a daemon of the user's own).
        vllm_installed: vLLM is found (``rollout.backend=auto`` resolves to it on a GPU).
    """

    control: Optional[str]
    compute_mode: Optional[str]
    device_memory: Optional[int]
    cuda_initialized: bool
    own_daemon: bool
    vllm_installed: bool


@dataclass(frozen=True)
class MPSDecision:
    """``start``: flowrl starts a daemon for this job; ``value``: what ``launcher.mps`` became
    (``true``, ``false``, or ``yours``: a daemon of the user's own is joined); ``why``: the
    reason, for the console."""

    start: bool
    value: str
    why: str


def engine_procs_expected(cfg: "TrainConfig", device_memory: Optional[int]) -> Optional[int]:
    """vLLM engine processes per GPU this one-rank run will start (the rule the engine build
    applies, ``VLLMRolloutConfig.engine_procs_for``, with the weights' bytes read from the model's
    config, not loaded): 0 when its graph has no rollout role; None when the graph or the model's
    size cannot be read (the run's checks then say why).

    The runtime's count uses the loaded model's bytes; both count parameters × ``model.dtype``'s
    bytes (``auto`` = fp32), so they agree. An overlapped run (``placement.staleness >= 1``) has
    its engine in a process of its own at least."""
    from flowrl.graph.validate import load_graph
    from flowrl.models.size import model_size
    from flowrl.runtime.step.resources import rollout_job

    try:
        graph = load_graph(cfg.graph.resolve())
        if not any(s.role in ("rollout", "teacher_rollout") for s in graph.stages):
            return 0
        size = model_size(cfg.model)
    except (OSError, ValueError, KeyError):
        return None
    weight_bytes = size.n_params * size.dtype_bytes
    return cfg.rollout.vllm.engine_procs_for(weight_bytes, device_memory,
                                             own_process=overlapped(cfg, graph),
                                             job=rollout_job(cfg, world_size=1))


def overlapped_run(cfg: "TrainConfig") -> bool:
    """:func:`overlapped` of the run's graph file (False where the file does not load: the run's
    own checks then say why)."""
    from flowrl.graph.validate import load_graph

    if (cfg.placement.staleness or 0) >= 1:
        return True
    try:
        return overlapped(cfg, load_graph(cfg.graph.resolve()))
    except (OSError, ValueError):
        return False


def overlapped(cfg: "TrainConfig", graph) -> bool:
    """The run trains one step behind its rollout (``placement.staleness``, or the graph's
    ``weight_sync.staleness`` when null, >= 1)."""
    k = cfg.placement.staleness
    if k is None:
        k = max([w.staleness for w in graph.weight_sync], default=0)
    return k >= 1


def decide(cfg: "TrainConfig", facts: MPSFacts,
           engine_procs: Callable[[], Optional[int]]) -> MPSDecision:
    """Start a daemon for this job or not (``launcher.mps``, see the module docstring).

    ``engine_procs``: the run's engine processes per GPU (:func:`engine_procs_expected`), asked
    only when ``auto`` gets that far (it reads the model's config).

    Raises:
        MPSError: ``launcher.mps=true`` on a run or machine that cannot have it: several
            processes or nodes, no ``nvidia-cuda-mps-control``, a GPU not in Default compute
            mode, CUDA already initialised in this process.
    """
    mode = cfg.launcher.mps
    lc = cfg.launcher
    if mode == "false":
        return MPSDecision(False, "false", "asked for")
    if facts.own_daemon:
        return MPSDecision(False, "yours", f"{PIPE_ENV} is set: the job joins that MPS daemon; "
                                           "flowrl neither starts nor stops it")
    # the reasons a daemon cannot be had, in the order a user would fix them
    blocker = None
    if lc.nproc > 1 or lc.nnodes > 1 or "LOCAL_RANK" in os.environ:
        blocker = (f"the job runs {lc.nproc} process(es) on {lc.nnodes} node(s): flowrl starts "
                   "MPS for one-process jobs only (multi-rank jobs under MPS are untested)")
    elif cfg.trainer.device == "cpu":
        blocker = "trainer.device=cpu"
    elif facts.compute_mode is None:
        blocker = "no NVIDIA GPU visible (nvidia-smi reports none)"
    elif facts.control is None:
        blocker = f"no {CONTROL} on PATH (NVIDIA's driver utilities)"
    elif facts.compute_mode != "Default":
        blocker = (f"the GPU's compute mode is {facts.compute_mode}; a job's own daemon needs "
                   "Default (nvidia-smi -c DEFAULT)")
    elif facts.cuda_initialized:
        blocker = ("CUDA was initialised in this process before the job started (a context made "
                   "before the daemon never joins it): call flowrl.train.train before any CUDA call")
    if mode == "true":
        if blocker:
            raise MPSError(f"launcher.mps=true: {blocker}")
        return MPSDecision(True, "true", "asked for")
    if blocker:
        return MPSDecision(False, "false", blocker)
    return _by_engine_count(cfg, facts.vllm_installed, engine_procs)


def _by_engine_count(cfg: "TrainConfig", vllm_installed: bool,
                     engine_procs: Callable[[], Optional[int]]) -> MPSDecision:
    """``auto``'s rule once nothing blocks a daemon: one when 2+ vLLM engine processes (1+ for an
    overlapped run) share the GPU with the trainer."""
    backend = cfg.rollout.backend
    if backend == "auto":  # machine.resolve_machine_defaults' rule, before it runs
        backend = "vllm" if vllm_installed and not cfg.data.has_images else "hf"
    if backend != "vllm" or cfg.rollout.vllm.engine_procs == 0:
        return MPSDecision(False, "false", "no vLLM engine processes beside the trainer")
    procs = engine_procs()
    if procs is None:
        return MPSDecision(False, "false", "the graph or the model's size could not be read to "
                                           "count the engine processes")
    # an overlapped run's update runs beside its one engine process: that pair shares the GPU too
    least = 1 if overlapped_run(cfg) else MIN_ENGINE_PROCS
    if procs < least:
        where = ("no engine process: the vLLM engine runs in the trainer's process, or the "
                 "graph has no rollout" if procs == 0 else "one vLLM engine process")
        return MPSDecision(False, "false", f"{where}: nothing shares the GPU during a generate")
    return MPSDecision(True, "true", f"{procs} vLLM engine process(es) share the GPU with the "
                                     "trainer: under MPS their kernels run at once instead of in "
                                     "time slices")


# device memory that passes any memory rule of the engine count: the count's upper bound
_ANY_MEMORY = 1 << 60


def without_asking_the_gpu(cfg: "TrainConfig") -> Optional[MPSDecision]:
    """``auto``'s "no daemon" where the job's engine count settles it whatever the GPU: no vLLM,
    an in-process engine, or fewer engine processes than the rule asks even with unlimited device
    memory (:func:`engine_procs_expected`'s upper bound). None when the GPU's facts are needed.

    Why: the facts come from ``nvidia-smi`` (2.6-4.5 s of the default job's start on an H100,
    ``benchmarks/results/first_step_h100.md``), and the default job (one in-process engine) never
    starts a daemon."""
    d = _by_engine_count(cfg, importlib.util.find_spec("vllm") is not None,
                         lambda: engine_procs_expected(cfg, _ANY_MEMORY))
    return d if not d.start else None


def gpu_nodes() -> bool:
    """An NVIDIA device node exists (``/dev/nvidiactl``; no ``nvidia-smi``, no torch)."""
    return os.path.exists("/dev/nvidiactl")


def machine_facts() -> MPSFacts:
    """The facts of this machine and process (``nvidia-smi`` for the compute mode and memory: it
    initialises no CUDA in this process)."""
    control = shutil.which(CONTROL)
    mode = memory = None
    smi = shutil.which("nvidia-smi")
    # the job's GPU: the first of CUDA_VISIBLE_DEVICES (an index or a UUID, both of which
    # nvidia-smi -i takes; it ignores the variable itself), else GPU 0; "" hides every GPU
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = None if visible is None else visible.split(",")[0].strip()
    if smi is not None and first != "":
        try:
            out = subprocess.run([smi, f"--id={first or 0}", "--query-gpu=compute_mode,memory.total",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.strip().splitlines()
            row = [f.strip() for f in out[0].split(",")] if out else []
            if len(row) == 2:
                mode, memory = row[0], int(float(row[1])) << 20  # MiB
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    torch = sys.modules.get("torch")
    initialized = bool(torch is not None and torch.cuda.is_initialized())
    return MPSFacts(control, mode, memory, initialized, bool(os.environ.get(PIPE_ENV)),
                    importlib.util.find_spec("vllm") is not None)


# a CUDA context under the daemon, made by a throw-away process through the driver API (no torch:
# a second); if the daemon's server cannot serve (another user's server holds the GPU, a driver
# without MPS), this fails here, not in the trainer's first CUDA call
PROBE = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
def ok(rc, what):
    if rc != 0:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(rc, ctypes.byref(name))
        sys.exit(f"{what}: {name.value.decode() if name.value else rc}")
ok(cuda.cuInit(0), "cuInit")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
ok(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ok(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ok(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
ok(cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20), "cuMemAlloc")
cuda.cuMemFree_v2(ptr)
cuda.cuDevicePrimaryCtxRelease_v2(dev)
"""


def start_daemon(control: str, probe: Optional[Sequence[str]] = None) -> str:
    """Start ``control -d`` with a fresh private pipe directory, check that a CUDA context can be
    made under it (``probe``: a command run with the daemon's environment; default a driver-API
    context and a 1 MiB allocation, :data:`PROBE`), then set ``CUDA_MPS_PIPE_DIRECTORY`` and
    ``CUDA_MPS_LOG_DIRECTORY`` in this process's environment (inherited by every process it
    starts) and start a watcher that quits the daemon and removes the directory once this process
    has exited. Returns the pipe directory.

    Raises:
        MPSError: the daemon did not start, or the probe failed under it (exit status and the
            last line of its output in the message); the daemon is quit and nothing is left.
    """
    root = tempfile.mkdtemp(prefix="flowrl-mps-")
    pipe, logs = os.path.join(root, "pipe"), os.path.join(root, "log")
    os.makedirs(pipe)
    os.makedirs(logs)
    client_env = {**os.environ, PIPE_ENV: pipe, LOG_ENV: logs}
    # the daemon sees every GPU: one started under CUDA_VISIBLE_DEVICES renumbers the devices for
    # its clients, and a client keeping the same CUDA_VISIBLE_DEVICES then fails (NVIDIA's MPS
    # docs); its clients (the probe, the job) apply their own CUDA_VISIBLE_DEVICES as usual
    daemon_env = {k: v for k, v in client_env.items() if k != "CUDA_VISIBLE_DEVICES"}

    def run(cmd: Sequence[str], stdin: Optional[str] = None,
            env: dict[str, str] = daemon_env) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=env, input=stdin, capture_output=True, text=True,
                              timeout=60)

    def last_line(r: subprocess.CompletedProcess) -> str:
        lines = (r.stderr or r.stdout).strip().splitlines()
        return lines[-1][:200] if lines else "no output"

    try:
        r = run([control, "-d"])
    except (OSError, subprocess.SubprocessError) as e:
        shutil.rmtree(root, ignore_errors=True)
        raise MPSError(f"launcher.mps: {control} -d failed: {e}") from e
    if r.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise MPSError(f"launcher.mps: {control} -d exited {r.returncode}: {last_line(r)}")
    try:
        p = run(probe if probe is not None else [sys.executable, "-c", PROBE], env=client_env)
        failed = None if p.returncode == 0 else f"exited {p.returncode}: {last_line(p)}"
    except (OSError, subprocess.SubprocessError) as e:
        failed = str(e)
    if failed is not None:
        try:
            run([control], stdin="quit\n")
        except (OSError, subprocess.SubprocessError):
            pass
        shutil.rmtree(root, ignore_errors=True)
        raise MPSError(f"launcher.mps: a CUDA context under the job's MPS daemon failed ({failed})")
    # the watcher outlives a killed job: it polls this pid, then quits the daemon (which ends its
    # servers) and removes the directory; its own session, so a Ctrl-C of the job leaves it be
    watch = (f'while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; '
             f'echo quit | "{control}" >/dev/null 2>&1; rm -rf "{root}"')
    subprocess.Popen(["sh", "-c", watch], env=daemon_env, start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ[PIPE_ENV], os.environ[LOG_ENV] = pipe, logs
    return pipe


def engage(cfg: "TrainConfig", facts: Optional[MPSFacts] = None,
           probe: Optional[Sequence[str]] = None) -> Optional["Resolved"]:
    """Apply ``launcher.mps`` for this job before anything initialises CUDA (``train.prepare``
    calls it between the config and the machine defaults). Returns the console's ``resolved``
    line, or None for ``launcher.mps=false`` and for ``auto`` on a machine without an NVIDIA GPU
    (nothing to say). ``facts`` / ``probe``: stand-ins for tests (:func:`machine_facts`,
    :func:`start_daemon`'s probe).

    Raises:
        MPSError: ``launcher.mps=true`` only (see :func:`decide` and :func:`start_daemon`); under
            ``auto`` a daemon that cannot serve leaves the run without MPS, the reason in the line.
    """
    from flowrl.runtime.control.spec import Resolved

    auto = cfg.launcher.mps == "auto"
    if cfg.launcher.mps == "false" or (auto and cfg.trainer.device == "cpu"):
        return None
    if auto and facts is None and not os.environ.get(PIPE_ENV):
        quick = without_asking_the_gpu(cfg)
        if quick is not None:  # said on a GPU machine only (nothing to say on every CPU run)
            return Resolved("launcher.mps", quick.value, quick.why) if gpu_nodes() else None
    facts = machine_facts() if facts is None else facts
    d = decide(cfg, facts, lambda: engine_procs_expected(cfg, facts.device_memory))
    if not d.start:
        # auto on a machine without an NVIDIA GPU: nothing to say on every CPU run
        return None if auto and facts.compute_mode is None else Resolved("launcher.mps", d.value, d.why)
    assert facts.control is not None  # decide starts none without it
    try:
        pipe = start_daemon(facts.control, probe)
    except MPSError as e:
        if not auto:
            raise
        # auto never stops a run: without MPS it runs as it would have (the engines in turns)
        return Resolved("launcher.mps", "false", str(e).removeprefix("launcher.mps: "))
    return Resolved("launcher.mps", d.value, f"{d.why}; this job's daemon: {PIPE_ENV}={pipe}")


def serving_line() -> Optional[str]:
    """One console line naming the MPS server(s) of this process's daemon and their client
    processes (``get_server_list`` / ``get_client_list``), the proof that the job's CUDA contexts
    joined it; None outside MPS (no ``CUDA_MPS_PIPE_DIRECTORY``) or when the daemon cannot be
    asked."""
    control = shutil.which(CONTROL)
    if not os.environ.get(PIPE_ENV) or control is None:
        return None

    def ask(cmd: str) -> list[str]:
        r = subprocess.run([control], input=cmd + "\n", capture_output=True, text=True, timeout=10)
        return r.stdout.split() if r.returncode == 0 else []

    try:
        servers = ask("get_server_list")
        clients = {s: ask(f"get_client_list {s}") for s in servers}
    except (OSError, subprocess.SubprocessError):
        return None
    if not servers:
        return (f"CUDA MPS: the daemon at {os.environ[PIPE_ENV]} runs no server: no CUDA context "
                "of this job joined it")
    return "CUDA MPS: " + "; ".join(f"server {s} serves {len(c)} process(es) of this job (pids "
                                    f"{', '.join(c)})" for s, c in clients.items())


def preview(cfg: "TrainConfig") -> Optional["Resolved"]:
    """What ``flowrl train`` would make of ``launcher.mps`` on this machine, starting nothing
    (``flowrl plan``); None where ``engage`` would say nothing."""
    import dataclasses

    from flowrl.runtime.control.spec import Resolved

    auto = cfg.launcher.mps == "auto"
    if cfg.launcher.mps == "false" or (auto and cfg.trainer.device == "cpu"):
        return None
    # the plan's own CUDA use (machine defaults) is not the job's: a job starts in a fresh process
    facts = dataclasses.replace(machine_facts(), cuda_initialized=False)
    try:
        d = decide(cfg, facts, lambda: engine_procs_expected(cfg, facts.device_memory))
    except MPSError as e:
        return Resolved("launcher.mps", "refused", str(e).removeprefix("launcher.mps=true: "))
    if not d.start:
        return None if auto and facts.compute_mode is None else Resolved("launcher.mps", d.value, d.why)
    return Resolved("launcher.mps", d.value, f"{d.why}; flowrl train starts the job's daemon")
