"""The run's resources: the engine of every role a (pool's) plan uses, built once from the run
config, and what the ops are handed beside them (``RunResources``).

The factory loads the model once, straight onto the run's device, and derives every role's
engine from it: the actor (FSDP2 over the pool's process group when the pool trains on several
ranks, or when asked), the frozen reference, the frozen teacher (distillation: the one role
loaded from a model of its own, ``teacher``, and its sampler ``teacher_rollout``), the critic (value head on the initial weights), a
reward model, a generative judge, and the rollout engine last (an HF engine with its own copy
casts ``model`` to its dtype, so every other role copies the initial weights before that).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, cast

from flowrl.graph.roles import ROLES, TRAINED_ROLES

if TYPE_CHECKING:
    import torch

    from flowrl.compiler.plan import ExecutionPlan
    from flowrl.config import TrainConfig
    from flowrl.engines.base import (
        Engine,
        LogprobEngine,
        RewardScorer,
        RolloutEngine,
        Trainable,
        TrainEngine,
        ValueEngine,
    )
    from flowrl.engines.rollout.vllm_config import RolloutJob
    from flowrl.engines.rollout.vllm_prefetch import ModelInfoPrefetch

# which models the plan's offload/onload actions move (``trainer.offload``, resolved by
# :func:`resolve_offload`; the Executor's ``swap``): every role's, only the generation engines'
# (vLLM sleeps while the training state stays resident), or none (every model stays resident)
Swap = Literal["all", "generate", "none"]
SWAPS: tuple[Swap, ...] = ("all", "generate", "none")
# trainer.offload's explicit values (auto is decided by resolve_offload)
OFFLOAD_SWAP: dict[str, Swap] = {"always": "all", "never": "none", "rollout": "generate"}
# what each Swap does with the plan's offload/onload actions (flowrl plan prints it)
SWAP_MEANS: dict[Swap, str] = {
    "all": "every offload/onload of the timeline runs (idle models move off the device)",
    "none": "the timeline's offload/onload actions are skipped: every model stays resident",
    "generate": "only the generation engines' offload/onload run (vLLM sleeps through the "
                "update, an HF copy moves to host memory); the training state stays resident",
}

log = logging.getLogger("flowrl")

TRAINABLE_ROLES = TRAINED_ROLES  # their state (weights, optimizer, scheduler) is checkpointed


@dataclass
class Engines:
    """role → engine of one rank (only the roles of its pool's plan are set), each typed by its
    role's Protocol (``engines/base.py``).

    Attributes:
        actor: the trained policy (a LoRA actor: adapters over frozen base weights).
        ref: frozen reference (a copy of the initial policy; LoRA: the actor, adapters disabled).
        teacher: frozen teacher of on-policy distillation (its own model, ``teacher``; never synced).
        teacher_rollout: the teacher as a generation engine (SFT on teacher samples: its own
            frozen copy of ``teacher``, ``rollout.backend``'s engine; never synced).
        critic: value model (PPO).
        rollout: generation engine (HF or vLLM); colocated on one process it shares the actor's module.
        reward_model: sequence-classification RM.
        genrm: generative judge (an HF generation engine on its own model copy).
    """

    actor: Optional["TrainEngine"] = None
    ref: Optional["LogprobEngine"] = None
    teacher: Optional["LogprobEngine"] = None
    teacher_rollout: Optional["RolloutEngine"] = None
    critic: Optional["ValueEngine"] = None
    rollout: Optional["RolloutEngine"] = None
    reward_model: Optional["RewardScorer"] = None
    genrm: Optional["RolloutEngine"] = None

    def by_role(self) -> dict[str, "Engine"]:
        """The engines that exist, keyed by role (what the ops' contexts are handed), in the
        role table's order (``flowrl/graph/roles.ROLES``: one field here per role)."""
        return {r: e for r in ROLES if (e := getattr(self, r)) is not None}

    def get(self, role: Optional[str]) -> Optional["Engine"]:
        """The engine of ``role`` (None: no role, or a role this rank does not hold)."""
        return None if role is None else self.by_role().get(role)

    def __contains__(self, role: object) -> bool:
        return role in self.by_role()

    def weight_source(self, role: str) -> "TrainEngine":
        """The engine whose weights a sync reads: a role some role's ``weights_from`` names
        (the actor), whose table Protocol is ``TrainEngine``.

        Raises:
            KeyError: this rank holds no trained engine for ``role``.
        """
        spec = ROLES.get(role)
        eng = getattr(self, role) if spec is not None else None
        if eng is None or spec is None or spec.protocol != "TrainEngine" or \
                not any(s.weights_from == role for s in ROLES.values()):
            raise KeyError(f"no trained engine serves weights as role {role!r} on this rank")
        return cast("TrainEngine", eng)

    def weight_sink(self, role: str) -> "RolloutEngine":
        """The generation engine a sync loads weights into: a role the table syncs
        (``RoleSpec.synced``: ``rollout``, from the actor; the graph validator refuses a sync
        into any other role).

        Raises:
            KeyError: this rank holds no synced generation engine for ``role``.
        """
        spec = ROLES.get(role)
        eng = getattr(self, role) if spec is not None and spec.synced else None
        if eng is None:
            raise KeyError(f"no generation engine takes weights as role {role!r} on this rank")
        return cast("RolloutEngine", eng)

    def train_state(self) -> dict[str, Any]:
        """What a checkpoint holds as tensors: the trainable engines' state and the torch RNG."""
        import torch

        state: dict[str, Any] = {r: e.state_dict() for r, e in self.trainable().items()}
        state["rng"] = {"torch": torch.get_rng_state()}
        return state

    def load_train_state(self, tensors: dict[str, Any]) -> None:
        """Restore what :meth:`train_state` returned (after ``CheckpointManager.load`` filled it)."""
        import torch

        for role, eng in self.trainable().items():
            eng.load_state_dict(tensors[role])
        torch.set_rng_state(tensors["rng"]["torch"])

    def trainable(self) -> dict[str, "Trainable"]:
        """The engines of :data:`TRAINABLE_ROLES` this rank holds (their state is checkpointed)."""
        return {r: cast("Trainable", e) for r in TRAINED_ROLES if (e := getattr(self, r)) is not None}

    def close(self) -> None:
        """Close every engine that holds processes or devices (vLLM: in-process engine shutdown,
        or the engine processes stopped and joined); every role is unset, so a second call does
        nothing. Run on the way out of every job, error or not (torchrun waits for child
        processes an engine left behind)."""
        engines = list(self.by_role().values())
        for role in ROLES:
            setattr(self, role, None)
        for eng in engines:
            eng.close()


@dataclass
class RunResources:
    """What the ops of a rank's plan read besides their engine (``StageContext.resources``).

    Attributes:
        tokenizer: the policy's tokenizer. prompts: the stateful prompt source (this rank's shard).
        algorithm: ``AlgorithmConfig``; sampling: ``SamplingConfig``; trainer: ``TrainerConfig``.
        genrm_tokenizer: the judge's tokenizer when the plan has a ``genrm`` role.
    """

    tokenizer: Any
    prompts: Any
    algorithm: Any
    sampling: Any
    trainer: Any
    genrm_tokenizer: Any = None

    def for_ops(self) -> dict[str, Any]:
        """The name → object mapping behind ``StageContext.resources``; ops read it typed, through
        ``ctx.run`` (``ops/context.RunResources``)."""
        out = {"tokenizer": self.tokenizer, "prompts": self.prompts, "algorithm": self.algorithm,
               "sampling": self.sampling, "trainer": self.trainer}
        if self.genrm_tokenizer is not None:
            out["genrm_tokenizer"] = self.genrm_tokenizer
        return out


def image_encoder(model_cfg: Any, tokenizer: Any) -> Any:
    """The prompts' image encoder of a vision-language model (``flowrl.data.images``), or None
    for a text model (``flowrl.models.vision.is_vision_config``)."""
    from flowrl.models.vision import image_processor, is_vision_config

    if not is_vision_config(model_cfg):
        return None
    from flowrl.data.images import ImageEncoder

    return ImageEncoder.for_model(image_processor(model_cfg), tokenizer)


def run_device(cfg: "TrainConfig") -> "torch.device":
    """``trainer.device`` as a torch device (``auto``: cuda when visible).

    Raises:
        ValueError: ``trainer.device=cuda`` with no CUDA device.
    """
    import torch

    if cfg.trainer.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is available")
    return torch.device(cfg.trainer.device)


def use_fsdp(cfg: "TrainConfig", world: int | None = None) -> bool:
    """FSDP2 engines when asked (``trainer.engine.strategy=fsdp``) or when running on > 1 rank.

    Raises:
        ValueError: ``strategy=local`` under a world size > 1 (ranks would train separate models).
    """
    from flowrl.runtime.io.distributed import dist_info

    world, strategy = world or dist_info().world_size, cfg.trainer.engine.strategy
    if world > 1 and strategy == "local":
        raise ValueError(f"trainer.engine.strategy=local cannot run on {world} ranks; use auto or fsdp")
    # on CUDA the machine defaults already turned auto into fsdp (flowrl/machine.py)
    return strategy == "fsdp" or (strategy == "auto" and world > 1)


@dataclass
class BuildContext:
    """What every role's builder reads (``build_engines`` fills it once per rank).

    Attributes:
        cfg: the run's TrainConfig. model: the policy model, loaded once on ``device`` (the
            builders that read it after the actor: ``EngineBuilder.reads_model``).
        tokenizer: the policy's tokenizer. roles: the roles of this (pool's) plan.
        fsdp: FSDP2 engines (``train_cls`` is the FSDP variant; ``kw`` holds the pool's mesh).
        shared: one process, HF rollout: the rollout engine runs the actor's own module.
        ref_copy: a deep copy of the initial weights for a (non-LoRA) reference, taken before
            any engine is built. world_size / group: the pool's ranks and process group.
        engines: the engines built so far (a builder may read an earlier role's engine).
        vllm_prefetch: vLLM model-info prefetches started before the model loaded
            (``engines/rollout/vllm_prefetch.py``); a vLLM builder waits for them first.
        rollout_apart: the rollout runs while the actor updates (``placement.staleness=1`` on a
            colocated run): it must hold weights of its own (``shared`` is off) and a vLLM
            engine runs in engine processes.
        response_tokens: the widest response region a stage of the plan generates when wider
            than ``max_new_tokens`` (a multi-turn stage's ``max_total_tokens``; 0: none), for
            :func:`rollout_job`.
    """

    cfg: "TrainConfig"
    model: Any
    device: "torch.device"
    tokenizer: Any
    roles: set[str]
    fsdp: bool
    train_cls: Any
    shared: bool
    ref_copy: Any
    world_size: Optional[int]
    group: Any
    engines: Engines
    kw: dict[str, Any] = field(default_factory=dict)
    vllm_prefetch: list["ModelInfoPrefetch"] = field(default_factory=list)
    rollout_apart: bool = False
    response_tokens: int = 0

    def wait_for_vllm_prefetch(self) -> None:
        """Let every prefetch started for this build finish (each is waited for once)."""
        for p in self.vllm_prefetch:
            p.wait()


def start_vllm_prefetch(cfg: "TrainConfig", roles: "set[str] | frozenset[str]"
                        ) -> list["ModelInfoPrefetch"]:
    """vLLM's model-info inspection of the policy (and a teacher that generates) in the
    background, while the machine check and the model load run (``flowrl train`` starts it once
    the run is accepted; the engine build takes the running ones:
    ``engines/rollout/vllm_prefetch.py`` says why). ``roles``: the plan's roles."""
    if cfg.rollout.backend != "vllm" or not roles & {"rollout", "teacher_rollout"}:
        return []
    from flowrl.engines.rollout import vllm_prefetch
    from flowrl.models.bundled import SMOLLM2
    from flowrl.models.kernels import model_type_of

    models = [cfg.model] + ([cfg.teacher] if "teacher_rollout" in roles and cfg.teacher.is_set else [])
    kinds = {model_type_of(m.path, m.tiny, SMOLLM2) for m in models}
    started = [vllm_prefetch.start(k) for k in sorted(k for k in kinds if k)]
    return [p for p in started if p is not None]


def _build_actor(b: BuildContext) -> "TrainEngine":
    # FSDP shards the actor's own copy; `model` stays whole as the rollout engine's module and
    # gets the gathered weights at every sync. One process: rollout shares the module (no copy).
    # A partitioned train pool with no later reader of `model` shards it in place (no copy).
    later = any(ENGINE_BUILDERS[r].reads_model for r in b.roles if r in ENGINE_BUILDERS)
    actor_model = copy.deepcopy(b.model) if later and (b.fsdp or not b.shared) else b.model
    lora = b.cfg.model.lora
    if lora is None:
        return cast("TrainEngine", b.train_cls(actor_model, b.cfg.trainer.engine, trainable=True, **b.kw))
    from flowrl.models.lora import build_lora_actor

    # vLLM: the merged full set, or the adapters alone (rollout.vllm.lora_sync resolved, the same
    # resolution the rollout engine makes)
    sync = "shared" if b.shared else "changed" if b.cfg.rollout.backend != "vllm" else \
        "adapter" if b.cfg.rollout.vllm.lora_sync_for(_lora_spec(b)) == "adapter" else "full"
    return cast("TrainEngine", build_lora_actor(b.train_cls, actor_model, lora, b.cfg.trainer.engine,
                                                sync=sync, **b.kw))


def _lora_spec(b: BuildContext) -> Any:
    """The run's ``LoraAdapterSpec`` (``model.lora`` on this model's config), None without LoRA."""
    if b.cfg.model.lora is None:
        return None
    from flowrl.models.lora import adapter_spec

    return adapter_spec(b.cfg.model.lora, b.model.config)


def _build_ref(b: BuildContext) -> "LogprobEngine":
    if b.cfg.model.lora is not None:  # the actor with its adapters disabled (flowrl/models/lora.py)
        from flowrl.models.lora import AdapterDisabledReference

        if b.engines.actor is None:
            raise ValueError("model.lora: the ref role is the actor's engine; the plan has no actor")
        return AdapterDisabledReference(b.engines.actor)
    return cast("LogprobEngine", b.train_cls(b.ref_copy, b.cfg.trainer.engine, trainable=False, **b.kw))


def _build_teacher(b: BuildContext) -> "LogprobEngine":
    from flowrl.models.loading import load_model

    return cast("LogprobEngine", b.train_cls(load_model(b.cfg.teacher, b.device), b.cfg.trainer.engine,
                                             trainable=False, **b.kw))


def _build_reward_model(b: BuildContext) -> "RewardScorer":
    from flowrl.engines.reward_model import RewardModelEngine, load_reward_model

    rm = load_reward_model(b.cfg.reward.model.model)
    rm.to(b.device)  # type: ignore[arg-type]  # transformers' decorated `to` hides nn.Module's signature
    return RewardModelEngine(rm, pad_token_id=b.tokenizer.pad_token_id,
                             batch_size=b.cfg.reward.model.batch_size)


def _build_genrm(b: BuildContext) -> "RolloutEngine":
    from flowrl.engines.rollout.hf import HFRolloutEngine
    from flowrl.models.loading import load_model, load_tokenizer

    judge_cfg = b.cfg.reward.genrm.model or b.cfg.model
    judge = copy.deepcopy(b.model) if judge_cfg == b.cfg.model else load_model(judge_cfg, b.device)
    return HFRolloutEngine(judge, load_tokenizer(judge_cfg), b.cfg.reward.genrm.hf)


def _build_critic(b: BuildContext) -> "ValueEngine":
    from flowrl.engines.train.value import ValueTrainEngine, value_model_from_causal_lm

    value_cls: Any = ValueTrainEngine
    if b.fsdp:
        from flowrl.engines.train.fsdp import fsdp_variant

        value_cls = fsdp_variant(ValueTrainEngine)
    cfg = b.cfg
    critic_cfg = cfg.trainer.engine if cfg.trainer.critic_lr is None else \
        dataclasses.replace(cfg.trainer.engine, lr=cfg.trainer.critic_lr)
    return cast("ValueEngine", value_cls(value_model_from_causal_lm(b.model), critic_cfg, **b.kw))


def _build_rollout(b: BuildContext) -> "RolloutEngine":
    from flowrl.engines import rollout as rollout_engines

    # a pool's rank (group set) must keep vLLM off the job's torch world: child processes
    log.info("start-up: building the %s rollout engine", b.cfg.rollout.backend)
    b.wait_for_vllm_prefetch()
    from flowrl.models.vision import image_processor, is_vision_config

    return rollout_engines.build_rollout_engine(
        b.cfg.rollout, b.model, b.tokenizer, shared=b.shared,
        own_process=b.group is not None or b.rollout_apart,
        job=rollout_job(b.cfg, b.world_size, b.response_tokens), lora=_lora_spec(b),
        image_processor=image_processor(b.cfg.model) if is_vision_config(b.cfg.model) else None)


def _build_teacher_rollout(b: BuildContext) -> "RolloutEngine":
    # SFT on teacher samples: the teacher generates, frozen, on a model of its own
    from flowrl.engines import rollout as rollout_engines
    from flowrl.models.loading import load_model

    b.wait_for_vllm_prefetch()
    return rollout_engines.build_rollout_engine(
        teacher_rollout_config(b.cfg.rollout), load_model(b.cfg.teacher, b.device), b.tokenizer,
        shared=False, own_process=b.group is not None,
        job=rollout_job(b.cfg, b.world_size, b.response_tokens))


@dataclass(frozen=True)
class EngineBuilder:
    """The runtime half of a role-table entry (``flowrl/graph/roles.ROLES`` holds the rest:
    kind, Protocol, pool, weight source).

    Attributes:
        build: makes the role's engine from the :class:`BuildContext`.
        reads_model: reads the loaded ``model`` after the actor is built (the actor then
            takes a copy of its own when it would change ``model``: FSDP shards, LoRA wraps).
    """

    build: Callable[[BuildContext], Any]
    reads_model: bool = False


# role -> builder, in build order: the actor first (the LoRA reference is the actor's engine),
# the frozen models, the critic (a value head on the initial weights), the rollout engine last
# (an HF engine with its own copy casts `model` to its dtype, so every other role copies the
# initial weights before that)
ENGINE_BUILDERS: dict[str, EngineBuilder] = {
    "actor": EngineBuilder(_build_actor),
    "ref": EngineBuilder(_build_ref),
    "teacher": EngineBuilder(_build_teacher),
    "reward_model": EngineBuilder(_build_reward_model),
    "genrm": EngineBuilder(_build_genrm, reads_model=True),
    "critic": EngineBuilder(_build_critic, reads_model=True),
    "teacher_rollout": EngineBuilder(_build_teacher_rollout),
    "rollout": EngineBuilder(_build_rollout, reads_model=True),
}


def build_engines(cfg: "TrainConfig", plan: "ExecutionPlan", tokenizer,
                  world_size: int | None = None, group: Any = None,
                  rollout_apart: bool = False) -> Engines:
    """Load the model once and build the engine of every role the plan uses (a partitioned
    pool's plan: only that pool's roles; ``world_size`` = the pool's ranks, ``group`` = the pool's
    process group: FSDP engines shard over it and run their collectives on it, never the world),
    each by its :data:`ENGINE_BUILDERS` entry, in that table's order. ``rollout_apart``: the
    rollout runs beside the update (:attr:`BuildContext.rollout_apart`).

    The model is loaded straight onto the run's device (no host copy on a GPU run). The rollout
    engine is built last: an HF engine with its own copy casts ``model`` to its dtype (bf16 on
    CUDA), and every other role must copy the initial weights before that."""
    from flowrl.engines.train.local import LocalTrainEngine
    from flowrl.models.loading import load_model

    device = run_device(cfg)
    t0 = time.perf_counter()
    roles = set(plan.roles)
    prefetch = start_vllm_prefetch(cfg, roles)
    model = load_model(cfg.model, device)
    log.info("start-up: model loaded on %s in %.1f s", device, time.perf_counter() - t0)
    # a partitioned rollout pool trains nothing: no FSDP, no world collectives
    fsdp = bool(set(TRAINED_ROLES) & roles) and use_fsdp(cfg, world_size)
    kw: dict[str, Any] = {}
    train_cls: Any = LocalTrainEngine
    if fsdp:
        from flowrl.engines.train.fsdp import broadcast_module, fsdp_variant, pool_mesh

        broadcast_module(model, group=group)  # one random init for every rank of the pool
        train_cls = fsdp_variant(LocalTrainEngine)
        if group is not None:
            kw["mesh"] = pool_mesh(group, device)
    lora = cfg.model.lora
    # a LoRA actor's module shares only with an HF rollout engine on one process; vLLM and an
    # FSDP run's HF engine start from a plain copy of the base weights
    shared = not fsdp and "actor" in roles and (lora is None or cfg.rollout.backend == "hf") \
        and not rollout_apart
    # before any engine is built (the actor may shard or wrap `model` in place): the frozen
    # reference's copy; LoRA: the reference is the actor with its adapters disabled
    ref_copy = copy.deepcopy(model) if "ref" in roles and lora is None else None
    engines = Engines()
    ctx = BuildContext(cfg, model, device, tokenizer, roles, fsdp, train_cls, shared, ref_copy,
                       world_size, group, engines, kw, prefetch, rollout_apart,
                       response_tokens(plan))
    for role, builder in ENGINE_BUILDERS.items():
        if role in roles:
            t1 = time.perf_counter()
            setattr(engines, role, builder.build(ctx))
            log.info("start-up: %s engine built in %.1f s", role, time.perf_counter() - t1)
    log.info("start-up: engines of %s built in %.1f s", ", ".join(sorted(roles)) or "no roles",
             time.perf_counter() - t0)
    if "flowrl.engines.rollout.vllm_proc" in sys.modules:  # engine processes started ahead and
        from flowrl.engines.rollout.vllm_proc import discard_ahead  # not taken: not needed

        discard_ahead()
    return engines


EVAL_PASSES = 2  # the greedy eval before training and after it


def teacher_rollout_config(rollout_cfg: Any) -> Any:
    """``rollout`` for the teacher's generation engine: the same backend and settings, except
    that a vLLM swap point never drops its weights (``sleep_level`` at most 1: no weight sync
    ever refills them, level 2 relies on the next load), at least one engine process of its
    own (``engine_procs`` 0 would put a second vLLM engine into the process that may already
    hold the student's), and a ``model_dir`` of its own (``<model_dir>_teacher``: the student's
    engine writes its export to ``model_dir``)."""
    v = rollout_cfg.vllm
    fixes: dict[str, Any] = {}
    if v.sleep_level > 1:
        fixes["sleep_level"] = 1
    if rollout_cfg.backend == "vllm" and v.engine_procs == 0:
        fixes["engine_procs"] = 1
    if v.model_dir:
        fixes["model_dir"] = f"{v.model_dir.rstrip('/')}_teacher"
    return dataclasses.replace(rollout_cfg, vllm=dataclasses.replace(v, **fixes)) if fixes else rollout_cfg


def response_tokens(plan: "ExecutionPlan") -> int:
    """The widest response region a stage of ``plan`` generates beyond ``max_new_tokens``: a
    multi-turn stage's ``max_total_tokens`` (policy turns and observations); 0 without one."""
    from flowrl.envs.config import MultiTurnConfig

    return max((c.config.max_total_tokens for c in plan.stages
                if isinstance(c.config, MultiTurnConfig)), default=0)


def rollout_job(cfg: "TrainConfig", world_size: int | None = None,
                response_tokens: int = 0) -> "RolloutJob":
    """What this run asks of one rank's rollout engine (sizes vLLM's job-sized defaults).

    Each rank generates ``prompts_per_step × algorithm.n`` sequences per step and evaluates
    ``min(eval.limit, eval.batch_size)`` prompts per call; the decode steps count every step's
    ``max_new_tokens`` and the evaluations (before, after and every ``eval.every`` steps). A
    sequence is at most ``data.max_prompt_tokens`` (longer prompts are skipped) plus the response
    width: ``max_new_tokens``, or ``response_tokens`` (:func:`response_tokens`) where wider."""
    from flowrl.engines.rollout.vllm_config import RolloutJob
    from flowrl.runtime.io.distributed import dist_info

    t, ev = cfg.trainer, cfg.trainer.eval
    # an eval of the whole split (limit null) counts as large: it favours CUDA graphs
    limit = ev.limit if ev.limit is not None else 1 << 16
    eval_seqs = min(limit, ev.batch_size)
    calls = -(-limit // ev.batch_size)  # generate calls per eval pass
    passes = EVAL_PASSES + (t.total_steps // ev.every if ev.every else 0)  # + periodic evals
    decode = (t.total_steps * cfg.rollout.sampling.max_new_tokens
              + passes * calls * ev.max_new_tokens)
    prompt = cfg.data.max_prompt_tokens
    return RolloutJob(seqs_per_step=t.prompts_per_step * cfg.algorithm.n, eval_seqs=eval_seqs,
                      decode_steps=decode, ranks=world_size or dist_info().world_size,
                      seq_tokens=prompt + max(cfg.rollout.sampling.max_new_tokens, response_tokens),
                      eval_seq_tokens=prompt + ev.max_new_tokens)


def resolve_offload(cfg: "TrainConfig", engines: Engines) -> tuple["Swap", str]:
    """``trainer.offload`` → (which models move at the swap points, why): the Executor's
    ``swap`` (``"all"``, ``"generate"`` or ``"none"``).

    ``always`` → all, ``never`` → none, ``rollout`` → generate (only the generation engines
    release the device). ``auto`` keeps everything resident when it fits (:func:`keep_resident`):
    the training state counts 16 bytes per trainable parameter (fp32 weight, gradient, two AdamW
    moments) and 4 per frozen one; the rollout engine its share of the device (vLLM's
    ``gpu_memory_utilization``, an HF copy its weights)."""
    mode = cfg.trainer.offload
    if mode in OFFLOAD_SWAP:
        return OFFLOAD_SWAP[mode], f"trainer.offload={mode}"
    device = run_device(cfg)
    if device.type != "cuda":
        return "none", "CPU run: nothing to free"
    import torch

    from flowrl.models.lora import AdapterDisabledReference

    state = 0
    # the roles whose engine holds a module in training memory (the role table's Protocols)
    models: list[tuple[str, Optional[LogprobEngine | Trainable]]] = [
        (r, getattr(engines, r)) for r, s in ROLES.items()
        if s.protocol in ("TrainEngine", "ValueEngine", "LogprobEngine")]
    for role, eng in models:
        if eng is not None and not isinstance(eng, AdapterDisabledReference):
            # frozen tensors (a reference, a LoRA actor's base) hold no grads or AdamW moments
            trained = ROLES[role].kind == "train"
            state += sum(p.numel() * (16 if p.requires_grad and trained else 4)
                         for p in eng.model.parameters())
    from flowrl.engines.rollout.hf import HFRolloutEngine

    rollout = 0
    for gen in (engines.rollout, engines.teacher_rollout):  # the student's and the teacher's
        if isinstance(gen, HFRolloutEngine):  # its weights (shared or a copy)
            rollout += sum(p.numel() * p.element_size() for p in gen.model.parameters())
        elif gen is not None:  # vLLM: its share of the device
            total = torch.cuda.get_device_properties(device).total_memory
            rollout += int(cfg.rollout.vllm.gpu_memory_utilization * total)
    keep = keep_resident(state, rollout, device)
    return "none" if keep else "all", (f"auto: training state {state / 2**30:.1f} GiB + rollout "
                      f"{rollout / 2**30:.1f} GiB {'fit' if keep else 'do not fit'} in 80% of the device")


def keep_resident(state_bytes: int, rollout_bytes: int, device: "torch.device",
                  fraction: float = 0.8) -> bool:
    """``trainer.offload=auto``: keep every model on the device (no host offload at the swap
    points) when the training state (parameters, gradients, optimizer moments of trainable roles;
    parameters of frozen ones) plus the rollout engine's budget fit in ``fraction`` of the device's
    memory. Moving the state to host memory and back costs seconds per step (5 s for a 0.5B model,
    ``benchmarks/results/scaling.md``) and host RAM; it is only worth it when memory is short.
    Always False on CPU (nothing to free)."""
    if device.type != "cuda":
        return False
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    return state_bytes + rollout_bytes <= fraction * total


# the epoch second the command started, set by ``flowrl train``'s torchrun supervisor for its
# ranks: their "since the command started" then counts the parent's checks and torchrun's start
COMMAND_START_ENV = "FLOWRL_COMMAND_START"


# seconds from the command's start to this process's current job's start-up (a sweep's later
# jobs run in the same process; 0: the command's first job), set by run_job
_JOB_BEGAN_S = 0.0


def set_job_began(at_s: float) -> None:
    """The current job's start-up began ``at_s`` seconds after the command (``RunSpec.
    startup_began_s``): :func:`since_start` counts from there."""
    global _JOB_BEGAN_S
    _JOB_BEGAN_S = at_s


def since_start() -> tuple[float, str]:
    """(seconds, what from) for the start-up lines: since the command started, or for a sweep's
    later job since that job's start-up began (the earlier jobs' runs are not its start-up)."""
    return since_launch_s() - _JOB_BEGAN_S, "job" if _JOB_BEGAN_S else "command"


def since_launch_s() -> float:
    """Seconds since the command started: since ``$FLOWRL_COMMAND_START`` (a rank of a
    multi-process ``flowrl train``), else since this process started (its creation time, so
    imports count too).

    Linux: the system's uptime (``/proc/uptime``, 10 ms) less the process's start in clock ticks
    since boot (``/proc/self/stat``). psutil's ``create_time`` adds that start to a boot time
    that ``/proc/stat`` keeps in whole seconds, so its age of a process read up to a second
    high (0.75 s on the CI machine). Elsewhere psutil's figure."""
    start = os.environ.get(COMMAND_START_ENV)
    if start:
        try:
            return max(time.time() - float(start), 0.0)
        except ValueError:
            pass  # not a number: this process's own age
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        with open("/proc/self/stat") as f:  # field 22 (starttime): after the ")" of the name
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        import psutil

        return time.time() - psutil.Process().create_time()


def peak_rss_gib() -> float:
    """This process's peak resident host memory since it started (GiB; Linux ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


__all__ = ["BuildContext", "ENGINE_BUILDERS", "EngineBuilder", "Engines", "RunResources", "OFFLOAD_SWAP",
           "SWAPS", "SWAP_MEANS", "Swap",
           "TRAINABLE_ROLES", "build_engines", "keep_resident", "peak_rss_gib",
           "resolve_offload", "rollout_job", "run_device", "since_launch_s", "use_fsdp"]
