"""The run configuration: one typed dataclass per Hydra group, composed into ``TrainConfig``.

Defaults live in these dataclasses (and the ones they import) once; ``conf/**.yaml`` only
overrides. Validation runs in each ``__post_init__`` when the composed config is turned into
objects (``to_train_config``), before any model loads, and errors name the field.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from flowrl.algorithms.config import AlgorithmConfig
from flowrl.compiler.cluster import ClusterConfig
from flowrl.compiler.placement import PlacementConfig
from flowrl.data import DataConfig
from flowrl.engines.base import SamplingConfig
from flowrl.engines.config import HFRolloutConfig, RewardModelConfig, TrainEngineConfig
from flowrl.engines.rollout import ROLLOUT_BACKENDS
from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
from flowrl.models.loading import ModelConfig
from flowrl.models.teacher import TeacherConfig
from flowrl.runtime.io.profiling import ProfileConfig

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class LauncherConfig:
    """How ``flowrl train`` starts its processes (all but the two timeouts are ignored once
    running under torchrun) and how long its ranks wait for each other.

    Attributes:
        nproc: processes (GPUs) per node; > 1 (or nnodes > 1) re-executes under torchrun.
        nnodes: nodes taking part (torchrun ``--nnodes``; ``"MIN:MAX"`` elastic ranges are not used).
        rdzv_endpoint: ``host:port`` of the c10d rendezvous (multi-node; any node's address).
        rdzv_id: job id shared by all nodes of one run.
        rdzv_backend: torchrun rendezvous backend (``c10d``).
        max_restarts: torchrun worker-group restarts on failure (resume picks up the newest
            complete checkpoint when ``trainer.resume=true``).
        node_rank: fixed node rank (static rendezvous); None = assigned by the rendezvous.
        collective_timeout_s: seconds a rank waits in a collective (the process group's
            timeout) before the job fails with an error. 600 (10 minutes): ranks legitimately
            wait for the slowest rank's generation and reward calls, rank 0's eval and
            checkpoint writes, which take minutes at most; a rank hung inside a collective then
            stops the job within 10 minutes instead of torch's default 30. Raise it for a long
            rank-0-only phase, e.g. an eval of the whole test split on the HF backend
            (``trainer.eval.limit=null``).
        heartbeat_timeout_s: seconds a rank's heartbeat may stay silent before the job stops,
            naming it (``runtime/io/distributed.PeerMonitor``: a thread of every rank beats every
            few seconds whatever the rank does, so only a frozen (SIGSTOP), dead or
            GIL-holding stuck process goes silent); the launcher kills that rank and prints the
            resume command (``runtime/control/supervise.py``). 60: well above any pause of a live
            process's threads, well below the collective timeout. Capped at half of
            ``collective_timeout_s``.
        mps: ``auto`` | ``true`` | ``false``: a CUDA MPS daemon of the job's own, so that vLLM's
            engine processes and the trainer share the GPU's SMs at once instead of in time
            slices (``runtime/control/mps.py``; one H100, 4 engine processes: generate 1.42 s ->
            1.10 s per step, benchmarks/results/e2e_vs_trl_h100.md). ``auto``: on for a
            one-process CUDA job whose vLLM engine runs in 2+ processes (1+ with
            ``placement.staleness >= 1``), when ``nvidia-cuda-mps-control`` is on PATH and the
            GPU is in Default compute mode; off otherwise, the reason on the console. ``true``:
            refused (one line) where it cannot be had. A daemon of your own
            (``CUDA_MPS_PIPE_DIRECTORY`` set) is joined as it is.
    """

    nproc: int = 1
    nnodes: int = 1
    rdzv_endpoint: str = "localhost:29500"
    rdzv_id: str = "flowrl"
    rdzv_backend: str = "c10d"
    max_restarts: int = 0
    node_rank: Optional[int] = None
    collective_timeout_s: float = 600.0
    heartbeat_timeout_s: float = 60.0
    mps: str = "auto"  # "auto" | "true" | "false" (OmegaConf has no Literal)

    def __post_init__(self) -> None:
        self.mps = str(self.mps).lower()
        if self.mps not in ("auto", "true", "false"):
            raise ValueError(f"launcher.mps must be one of ('auto', 'true', 'false'), got {self.mps!r}")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"launcher.collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"launcher.heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")
        if self.nproc < 1:
            raise ValueError(f"launcher.nproc must be >= 1, got {self.nproc}")
        if self.nnodes < 1:
            raise ValueError(f"launcher.nnodes must be >= 1, got {self.nnodes}")
        if self.max_restarts < 0:
            raise ValueError(f"launcher.max_restarts must be >= 0, got {self.max_restarts}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"launcher.node_rank must be in [0, {self.nnodes}), got {self.node_rank}")

    @property
    def distributed(self) -> bool:
        return self.nproc > 1 or self.nnodes > 1


# graph files of the working directory already said to shadow a built-in one
_SHADOW_SAID: set[str] = set()


@dataclass
class GraphConfig:
    """path: graph YAML; relative paths are looked up in the CWD, then in the flowrl checkout."""

    path: str = "graphs/grpo.yaml"

    def resolve(self) -> Path:
        p = Path(self.path).expanduser()
        for cand in (p, REPO_ROOT / p):
            if cand.is_file():
                found = cand.resolve()
                builtin = (REPO_ROOT / p).resolve()
                if cand is p and not p.is_absolute() and builtin.is_file() and found != builtin \
                        and str(found) not in _SHADOW_SAID:
                    # a working directory's graphs/<name>.yaml replaces flowrl's own: said once,
                    # since a copy keeping the built-in's name changed the run unseen
                    _SHADOW_SAID.add(str(found))
                    logging.getLogger("flowrl").warning(
                        "graph.path=%s: using %s from the working directory, not flowrl's own "
                        "%s", self.path, found, builtin)
                return found
        if p.is_absolute():
            raise FileNotFoundError(f"graph.path: no graph file at {self.path!r}")
        where = dict.fromkeys(str(d) for d in (Path.cwd(), REPO_ROOT))  # once each, in order
        raise FileNotFoundError(f"graph.path: no graph file at {self.path!r} "
                                f"(looked in {' and '.join(where)})")


@dataclass
class RolloutConfig:
    """backend: rollout engine, ``hf`` (transformers generate), ``vllm`` (its section ``vllm``;
    needs the vllm package) or ``auto`` (default: vLLM on CUDA when it is installed, else hf;
    ``flowrl/machine.py``). ``sampling`` is shared by both. ``verify_sync``: after each weight
    sync, read sampled values of every synced tensor back from the engine and stop the run,
    naming the engine and the tensors, when they are not the trainer's, and check that what was
    sent for each LoRA-adapted layer is the weight the trainer computes with (an unmerged
    adapter) (``runtime/step/weight_check.py``; 64 values per tensor, one small forward per
    adapted layer). ``verify_sync_every``: which syncs are checked: the first of the process
    (start or resume), then every n-th (1 = every sync). A check costs a readback round trip per
    engine: 0.46 s per sync for the Qwen2.5-0.5B shape over 4 vLLM engine processes on the H200
    (benchmarks/results/e2e_vs_trl_h200.md), more than the load itself; a sync path that works
    once keeps working, so 100 keeps the cost under 1 %."""

    backend: str = "auto"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    hf: HFRolloutConfig = field(default_factory=HFRolloutConfig)
    vllm: VLLMRolloutConfig = field(default_factory=VLLMRolloutConfig)
    verify_sync: bool = True
    verify_sync_every: int = 100

    def __post_init__(self) -> None:
        if self.verify_sync_every < 1:
            raise ValueError(f"rollout.verify_sync_every must be >= 1, got {self.verify_sync_every}")
        if self.backend not in ROLLOUT_BACKENDS and self.backend != "auto":
            raise ValueError(f"rollout.backend must be auto or one of {sorted(ROLLOUT_BACKENDS)}, "
                             f"got {self.backend!r}")
        if self.backend == "vllm":
            self.vllm.check_sampling(self.sampling)


@dataclass
class EvalConfig:
    """Greedy accuracy on a fixed slice (the first ``limit`` items) of ``split``, scored strict
    (``#### n``) and with math-verify (``flowrl.runtime.step.evaluate.evaluate_greedy``).

    Attributes:
        split: dataset split to evaluate (``test``: GSM8K's 1,319 questions).
        limit: questions evaluated, the first ``limit`` of ``split``; ``null`` (None) = the whole
            split (``trainer.eval.limit=null`` on the command line); 0 = no evaluation.
        batch_size: prompts per ``generate`` call of the rollout engine (vLLM schedules a whole
            call at once: on a GPU one call for the whole split is fastest).
        max_new_tokens: greedy decoding budget per answer.
        before / after: evaluate before the first step / after the last one.
        every: also evaluate after every ``every``-th step (0 = never): ``eval/*`` in that
            step's ``metrics.jsonl`` line, a held-out accuracy curve (the last step's is
            ``after``'s).
    """

    split: str = "test"
    limit: Optional[int] = 32
    batch_size: int = 32
    max_new_tokens: int = 256  # = SamplingConfig.max_new_tokens: one answer budget for both
    before: bool = True
    after: bool = True
    every: int = 0

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"trainer.eval.limit must be >= 0 or null (the whole split), got "
                             f"{self.limit}")
        for name in ("batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.eval.{name} must be >= 1, got {getattr(self, name)}")
        if self.every < 0:
            raise ValueError(f"trainer.eval.every must be >= 0 (0 = only before/after), got {self.every}")


@dataclass
class TrainerConfig:
    """Attributes:
        total_steps: RL iterations (one rollout batch each).
        prompts_per_step: prompts sampled per step; the batch holds prompts × algorithm.n samples.
        seed: run seed (model init for tiny models, sampling, shuffling).
        device: ``auto`` (cuda when visible, else cpu; ``flowrl/machine.py``) | cpu | cuda.
        output_dir: run directory (metrics, TensorBoard, checkpoints); Hydra's run dir by default.
        save_every: checkpoint every k steps (0 = only at the end).
        keep_last: checkpoints kept on disk.
        resume: continue from the newest complete checkpoint in ``output_dir`` (fresh start if none).
            Without it a run refuses a directory that holds a previous run
            (``runtime/io/rundir.py``).
        overwrite: start fresh in a directory that holds a previous run, deleting that run's
            outputs (checkpoints, metrics, TensorBoard, summary, plan) first.
        async_save: periodic checkpoints with ``dcp.async_save``: the step waits only for the copy
            to host memory; the write finishes in the background (the final one is synchronous).
        engine: optimizer / micro-batching of the training engine (actor; the critic too).
        critic_lr: the critic's learning rate (PPO); None = ``engine.lr``. Every other critic
            optimizer setting is ``engine``'s: one set of defaults, one knob PPO recipes change.
        offload: move idle models off the device at the plan's swap points (train state while the
            rollout engine generates, the rollout copy while training): ``auto`` (only when the
            models would not fit side by side: ``machine.keep_resident``), ``always``, ``never``,
            or ``rollout``: only the generation engines release the device (vLLM sleeps at
            ``rollout.vllm.sleep_level`` during the update: its KV cache, and at level 2 its
            weights, which the next sync refills) while the training state stays resident.
        max_skipped_steps: optimizer steps a run may skip (non-finite loss or grad norm) before
            it stops with exit status 1 (``runtime/control/health.py``; counted in
            ``train/skipped_steps``).
        max_skipped_frac: largest fraction of skipped optimizer steps (judged from the 4th step
            and at the last one): a run that trains on almost no step stops instead of exiting 0.
        constant_reward_steps: steps in a row whose rewards are all equal before a warning
            (``reward/constant_steps``); 0 = no warning.
        max_unscorable_steps: steps in a row on which no sample could be scored (the reward
            function or verifier raised or timed out on all of them: ``train/unscorable_frac``
            = 1) before the run stops with exit status 1; 0 = never stop.
        profile: torch.profiler over chosen steps (``trainer.profile.steps=[2,3]``): per step
            and rank a text summary (each stage's seconds, the top operators) and a Chrome trace
            under ``<run dir>/profile`` (``flowrl/runtime/io/profiling.py``).
    """

    total_steps: int = 10
    prompts_per_step: int = 4
    seed: int = 0
    device: str = "auto"
    output_dir: str = "outputs/run"
    save_every: int = 0
    keep_last: int = 2
    resume: bool = False
    overwrite: bool = False
    async_save: bool = False
    engine: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    critic_lr: Optional[float] = None
    offload: str = "auto"
    eval: EvalConfig = field(default_factory=EvalConfig)
    max_skipped_steps: int = 10
    max_skipped_frac: float = 0.5
    constant_reward_steps: int = 5
    max_unscorable_steps: int = 3
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def __post_init__(self) -> None:
        if self.max_skipped_steps < 0 or not 0.0 <= self.max_skipped_frac <= 1.0:
            raise ValueError(f"trainer.max_skipped_steps must be >= 0 and trainer.max_skipped_frac "
                             f"in [0, 1], got {self.max_skipped_steps}, {self.max_skipped_frac}")
        if self.constant_reward_steps < 0:
            raise ValueError(f"trainer.constant_reward_steps must be >= 0, got {self.constant_reward_steps}")
        if self.max_unscorable_steps < 0:
            raise ValueError(f"trainer.max_unscorable_steps must be >= 0, got {self.max_unscorable_steps}")
        if self.total_steps < 1:
            raise ValueError(f"trainer.total_steps must be >= 1, got {self.total_steps}")
        if self.prompts_per_step < 1:
            raise ValueError(f"trainer.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"trainer.device must be cpu, cuda or auto, got {self.device!r}")
        if self.critic_lr is not None and self.critic_lr < 0:
            raise ValueError(f"trainer.critic_lr must be >= 0 or null, got {self.critic_lr}")
        if self.offload not in ("auto", "always", "never", "rollout"):
            raise ValueError(f"trainer.offload must be auto, always, never or rollout, got {self.offload!r}")
        if self.save_every < 0:
            raise ValueError(f"trainer.save_every must be >= 0 (0: only the last step), got "
                             f"{self.save_every}")
        if self.keep_last < 1:
            raise ValueError(f"trainer.keep_last must be >= 1, got {self.keep_last}")
        late = sorted(s for s in self.profile.steps if s > self.total_steps)
        if late:
            raise ValueError(f"trainer.profile.steps {late} come after the last step "
                             f"(trainer.total_steps={self.total_steps}): they would never run")


def as_model_config(value: Any, name: str) -> Optional[ModelConfig]:
    """None, a ModelConfig or a mapping of its fields (``reward.genrm.model={path: smollm2}``).

    Raises:
        ValueError: anything else, or an unknown field, naming ``name``.
    """
    if value is None or isinstance(value, ModelConfig):
        return value
    if isinstance(value, (dict, DictConfig)):
        try:
            fields = OmegaConf.to_container(OmegaConf.create(dict(value)))
            if not isinstance(fields, dict):  # to_container of a DictConfig is a dict
                raise TypeError(f"expected a mapping, got {type(fields).__name__}")
            return ModelConfig(**{str(k): v for k, v in fields.items()})
        except TypeError as e:
            raise ValueError(f"{name}: {e}") from e
    raise ValueError(f"{name} must be null or a model section (path, tiny, dtype, ...), got {value!r}")


@dataclass
class GenRMRoleConfig:
    """``reward.genrm``: the judge model of the ``genrm`` role (its stage params, e.g. ``k`` and
    the template, are in the graph).

    Attributes:
        model: the judge; None = the run's ``model`` section (the default SmolLM2), loaded as its
            own copy (a deep copy of the initial policy when the sections are equal).
        hf: generation engine settings of the judge.
    """

    model: Any = None  # Optional[ModelConfig]; Any so a CLI/YAML dict can fill a None section
    hf: HFRolloutConfig = field(default_factory=HFRolloutConfig)

    def __post_init__(self) -> None:
        self.model = as_model_config(self.model, "reward.genrm.model")


@dataclass
class RewardConfig:
    """Reward models of the run: ``model`` for the ``reward_model`` role (classifier RM),
    ``genrm`` for the ``genrm`` role (generative judge). Unused unless a graph stage has the role."""

    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    genrm: GenRMRoleConfig = field(default_factory=GenRMRoleConfig)


@dataclass
class LoggerConfig:
    """Where per-step metrics go. Console and progress bar print on rank 0 only."""

    console: bool = True
    progress: bool = True
    jsonl: bool = True
    tensorboard: bool = True
    wandb: bool = False
    mlflow: bool = False
    project: str = "flowrl"


@dataclass
class TrainConfig:
    graph: GraphConfig = field(default_factory=GraphConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    # the teacher role's model (on-policy distillation); unset = none (flowrl/models/teacher.py)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    # cluster=<name> (conf/cluster/): the hardware `flowrl plan` predicts for; None = this machine
    cluster: Optional[ClusterConfig] = None


def schema() -> DictConfig:
    """The structured ``TrainConfig`` the composition starts from, with ``data.instruction``
    left null: building the schema runs ``DataConfig.__post_init__``, which would fill in the
    default dataset's instruction, and ``data=arith`` or ``data.path`` would then inherit
    GSM8K's; null lets the final ``DataConfig`` pick its own dataset's (or none for a file)."""
    node = OmegaConf.structured(TrainConfig)
    node.data.instruction = None
    return node


def graph_options() -> dict[str, dict[str, Any]]:
    """``graph=<name>`` options: one per ``graphs/<name>.yaml`` (the working directory's first,
    then flowrl's: the order :meth:`GraphConfig.resolve` finds files in), each setting
    ``graph.path`` and the file's ``algorithm`` and ``data`` blocks (the recipe's settings that
    differ from ``AlgorithmConfig``'s / ``DataConfig``'s defaults). A graph has this one source: no ``conf/graph/<name>.yaml``.
    A file that is not a YAML mapping gets its path only (using it reports the problem)."""
    import yaml

    out: dict[str, dict[str, Any]] = {}
    for folder in (Path.cwd() / "graphs", REPO_ROOT / "graphs"):
        for f in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
            if f.stem in out:
                continue
            try:
                doc = yaml.safe_load(f.read_text()) or {}
                blocks = {k: doc.get(k) or {} for k in ("algorithm", "data")}
            except (yaml.YAMLError, AttributeError, OSError):
                blocks = {}
            node: dict[str, Any] = {"graph": {"path": f"graphs/{f.name}"}}
            for key, block in blocks.items():
                if isinstance(block, dict) and block:
                    node[key] = block
            out[f.stem] = node
    return out


def register_configs() -> None:
    """Register the schema (``conf/train.yaml`` lists it first), the ``graph`` options
    (:func:`graph_options`) and the ``data`` options (one per bundled dataset, ``data=arith``,
    ``data=gsm8k``) with Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=schema())
    for name, node in graph_options().items():
        cs.store(group="graph", name=name, node=node, package="_global_")
    from flowrl.data import DATASETS

    for name in DATASETS:  # data=<name>: a bundled dataset (its settings: data.<name>.*)
        cs.store(group="data", name=name, node={"name": name}, package="data")


def to_train_config(cfg: DictConfig | dict[str, Any]) -> TrainConfig:
    """Composed (Dict)Config → validated TrainConfig objects.

    Raises:
        ValueError: a field a ``__post_init__`` rejects, or a type mismatch; the message names it.
    """
    base = schema()
    unknown = unknown_keys(base, cfg)
    if unknown:  # Hydra's `+key=value` adds a key the schema does not have; it would be ignored
        key, hint = unknown[0]
        raise ValueError(f"invalid config: unknown key {key}{hint}: nothing reads it (a `+key=` "
                         "override adds a key without checking the name)"
                         + (f"; also unknown: {', '.join(k for k, _ in unknown[1:])}"
                            if len(unknown) > 1 else ""))
    from omegaconf.errors import OmegaConfBaseException

    merged: Any = None  # the merged DictConfig once OmegaConf.merge has run
    try:
        merged = OmegaConf.merge(base, cfg)
        out = OmegaConf.to_object(merged)
    except Exception as e:  # omegaconf wraps __post_init__ errors; surface one clear line
        msg = str(e).split("\n")[0]
        if merged is not None and isinstance(e, ValueError) and \
                not isinstance(e, OmegaConfBaseException):  # a section's __post_init__
            msg = _with_section(merged, msg)
        raise ValueError(f"invalid config: {msg}") from e
    if not isinstance(out, TrainConfig):  # to_object of a structured TrainConfig node builds one
        raise TypeError(f"expected a TrainConfig, got {type(out).__name__}")
    # the sections' `x >= 0` checks let nan through (lr=nan failed in AdamW after the model
    # load, lr=inf after the first step; fresh-user report): no setting takes a non-finite number
    if (bad := _nonfinite(out)) is not None:
        raise ValueError(f"invalid config: {bad[0]}={bad[1]}: a setting must be a finite number")
    return out


def _nonfinite(node: Any, path: str = "") -> Optional[tuple[str, float]]:
    """(dotted key, value) of the first nan or ±inf float in a config tree (dataclasses, dicts,
    lists), or None."""
    import dataclasses
    import math

    if isinstance(node, float):
        return None if math.isfinite(node) else (path, node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        items: Any = ((f.name, getattr(node, f.name)) for f in dataclasses.fields(node))
    elif isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        return None
    for k, v in items:
        if (bad := _nonfinite(v, f"{path}.{k}" if path else str(k))) is not None:
            return bad
    return None


def _with_section(merged: DictConfig, msg: str) -> str:
    """``msg`` (a ``__post_init__``'s ValueError) with the dotted path of the section that raised
    it: ``trainer.engine.max_tokens_per_micro_batch must be >= 1 ...`` for a message that opens
    with one of its field names, ``<section>: msg`` otherwise; ``msg`` unchanged when it already
    names the section or no single section raises it alone (the deepest one that does wins)."""
    import dataclasses

    def failing(node: Any, path: str) -> Optional[tuple[str, Any]]:
        if not isinstance(node, DictConfig):
            return None
        for key in node.keys():
            name = str(key)
            try:
                child = node._get_node(name)
            except Exception:  # an interpolation or a missing value: not this search's concern
                continue
            found = failing(child, f"{path}.{name}" if path else name)
            if found:
                return found
        cls = OmegaConf.get_type(node)
        if path and cls is not None and dataclasses.is_dataclass(cls):
            try:
                OmegaConf.to_object(node)
            except ValueError as e:
                if str(e).split("\n")[0] == msg:
                    return path, cls
            except Exception:
                return None
        return None

    found = failing(merged, "")
    if found is None:
        return msg
    path, cls = found
    if msg.startswith(path):
        return msg
    first = re.match(r"\w+", msg)
    if first and first.group(0) in {f.name for f in dataclasses.fields(cls)}:
        return f"{path}.{msg}"
    return f"{path}: {msg}"


def unknown_keys(base: DictConfig, cfg: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Keys of ``cfg`` that the structured ``base`` has no field for (dataclass sections only;
    free-form ``dict`` / ``Any`` fields take any key), as ``(dotted key, " (did you mean …?)")``."""
    import dataclasses
    import difflib

    if not isinstance(cfg, (dict, DictConfig)) or not isinstance(base, DictConfig):
        return []
    typed = dataclasses.is_dataclass(OmegaConf.get_type(base))
    out: list[tuple[str, str]] = []
    for key in cfg.keys():
        key = str(key)
        if key == "hydra":
            continue
        if key not in base:
            if typed:
                close = difflib.get_close_matches(key, [str(k) for k in base.keys()], n=1)
                out.append((prefix + key, f" (did you mean {prefix}{close[0]}?)" if close else ""))
            continue
        if OmegaConf.is_missing(base, key) or (isinstance(cfg, DictConfig) and
                                               OmegaConf.is_missing(cfg, key)):
            continue
        node = base[key]  # a section (None when unset: nothing to check) or a value
        if isinstance(node, DictConfig):
            out += unknown_keys(node, cfg[key], f"{prefix}{key}.")
    return out


def compose(overrides: list[str], *, with_hydra: bool = False):
    """The run config Hydra would build for ``flowrl train <overrides>``, without running it;
    ``with_hydra``: with Hydra's own ``hydra`` section (run dir, logging, the overrides), what
    a Hydra job of it needs (``flowrl.train``'s entry runs one).

    ``trainer.output_dir`` still points at Hydra's run dir unless overridden: set it before use,
    or take :func:`task_section`.

    Raises:
        HydraException / OmegaConfBaseException: an override that does not compose
            (``flowrl.config_errors.explain`` says it in one line).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    # job_name: the log file's name (train.log), as the `python -m flowrl.train` app has it
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3",
                               job_name="train"):
        try:
            return hydra_compose(config_name="train", overrides=overrides,
                                 return_hydra_config=with_hydra)
        except AssertionError as e:  # Hydra's bare assert on a key under a null group
            from hydra.errors import ConfigCompositionException

            # config_errors.explain turns it into one line (config_errors.null_group_override)
            raise ConfigCompositionException(f"override failed: {e}") from e
        except AttributeError as e:  # OmegaConf: a whole dict set on a null Dict field
            from hydra.errors import ConfigCompositionException

            # ("model.tiny={model_type:llama}": 'NoneType' object has no attribute 'get');
            # config_errors.null_dict_override turns it into one line
            raise ConfigCompositionException(f"override failed: {e}") from e


def output_dir_is_hydras(cfg: Any) -> bool:
    """``trainer.output_dir`` of a composed config is still ``${hydra:...}`` (Hydra's run dir,
    which resolves only inside a running Hydra job)."""
    trainer = cfg.get("trainer") if isinstance(cfg, DictConfig) else None
    if not isinstance(trainer, DictConfig) or not OmegaConf.is_interpolation(trainer, "output_dir"):
        return False
    fields = OmegaConf.to_container(trainer, resolve=False)
    return isinstance(fields, dict) and "${hydra:" in str(fields.get("output_dir"))


def task_section(cfg: Any, output_dir: Optional[str] = None) -> DictConfig:
    """The run config of a composed config ``cfg`` (a DictConfig or a mapping): a copy without
    Hydra's ``hydra`` section, and with a ``trainer.output_dir`` that is Hydra's run dir pinned to
    ``output_dir`` (default: the directory ``hydra.run.dir`` names, when ``cfg`` has it), so it
    resolves before Hydra's job starts (nothing else resolved: ``${...}`` stay interpolations).
    """
    import os

    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    fields = OmegaConf.to_container(node, resolve=False)
    if not isinstance(fields, dict):  # a run config is a mapping at the top
        raise TypeError(f"the run config must be a mapping, got {type(fields).__name__}")
    has_hydra = fields.pop("hydra", None) is not None
    task = OmegaConf.create(fields)
    if output_dir is None and has_hydra:
        run_dir = str(OmegaConf.select(node, "hydra.run.dir"))
        # an empty one stays empty (abspath would make it the working directory): refused later
        output_dir = os.path.abspath(run_dir) if run_dir.strip() else ""
    if output_dir is not None and output_dir_is_hydras(task):
        task.trainer.output_dir = output_dir
    return task


def one_line(e: BaseException) -> str:
    """A Hydra/OmegaConf error as one line: its message lines and its cause's, without the
    indented ``full_key/object_type`` detail."""
    parts: list[str] = []
    cur: Optional[BaseException] = e
    while cur is not None and len(parts) < 8:
        parts += [ln.strip() for ln in str(cur).splitlines() if ln.strip() and not ln.strip()
                  .startswith(("full_key:", "object_type=", "reference_type=", "msg:"))]
        if any(p.startswith("Config search path") for p in parts):
            parts = parts[:next(i for i, p in enumerate(parts) if p.startswith("Config search path"))]
        cur = cur.__cause__
    seen: list[str] = []
    for p in parts:
        if p not in seen:
            seen.append(p)
    return "; ".join(seen[:6]).replace(":; ", ": ")
