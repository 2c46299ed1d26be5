"""``flowrl train`` / ``python -m flowrl.train``: Hydra entry point of one training run.

Order matters for "bad input loses nothing": the config is validated and the graph compiled
(both can fail with a message naming the field or stage) before any model is loaded.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from flowrl.compiler.plan import ExecutionPlan, compile_plan
from flowrl.config import REPO_ROOT, TrainConfig, register_configs, to_train_config
from flowrl.graph.graph import Graph
from flowrl.machine import Resolved, keep_resident, machine_problems, resolve_machine_defaults
from flowrl.runtime.checkpoint import CheckpointManager
from flowrl.runtime.executor import Executor
from flowrl.runtime.metrics import MetricsLogger

log = logging.getLogger("flowrl")


class ConfigError(ValueError):
    """The run was rejected before any model loaded (bad config, graph or file); nothing ran."""


def prepare(raw: DictConfig | dict) -> tuple[TrainConfig, ExecutionPlan]:
    """Validate the config, resolve its ``auto`` settings for this machine and compile the graph;
    loads no model. :func:`prepare_run` also returns what was resolved.

    Raises:
        ConfigError: with a message naming the field or stage (wraps ValueError / GraphError /
            FileNotFoundError of the checks).
    """
    cfg, plan, _ = prepare_run(raw)
    return cfg, plan


def prepare_run(raw: DictConfig | dict) -> tuple[TrainConfig, ExecutionPlan, list[Resolved]]:
    """:func:`prepare`, plus the ``auto`` settings resolved from the machine, with their reasons
    (``flowrl/machine.py``; printed by ``flowrl plan`` and at the start of a run)."""
    try:
        return _prepare(raw)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e


def _prepare(raw: DictConfig | dict) -> tuple[TrainConfig, ExecutionPlan, list[Resolved]]:
    raw = raw if isinstance(raw, DictConfig) else OmegaConf.create(raw)
    cfg = to_train_config(raw)
    resolved = resolve_machine_defaults(cfg)
    plan = compile_plan(Graph.load(cfg.graph.resolve()), OmegaConf.to_container(raw, resolve=True),
                        placement=cfg.placement.mode)
    _check_estimators(plan, cfg)
    if "reward_model" in plan.roles and cfg.reward.model.model is None:
        raise ValueError("the graph has a reward_model stage: set reward.model.model "
                         "(a local sequence-classification checkpoint, or tiny for tests)")
    from flowrl.ops.token_rewards import check_kl_in_reward

    check_kl_in_reward(plan, cfg.algorithm)
    from flowrl.ops.multi_turn import check_multi_turn

    check_multi_turn(plan, cfg)  # a multi-turn stage's tools go into every prompt (data.tools)
    from flowrl.models.lora import check_lora

    check_lora(cfg, set(plan.roles))  # model.lora: module names from a meta-device model
    if cfg.model.lora is not None and "ref" in plan.roles:
        plan.served_by["ref"] = "the actor engine with its LoRA adapters disabled (no weight copy)"
    prepare_placement(cfg, plan, world_size(cfg))  # an impossible placement fails here
    from flowrl.runtime.preflight import check_run_inputs

    check_run_inputs(cfg, plan)  # a bad model folder, data file, column or row: one line
    return cfg, plan, resolved


def world_size(cfg: TrainConfig) -> int:
    """Ranks of the job: ``WORLD_SIZE`` under torchrun, else launcher.nproc × launcher.nnodes."""
    import os

    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return cfg.launcher.nproc * cfg.launcher.nnodes


def role_parallelism(cfg: TrainConfig) -> dict[str, int]:
    """role → tensor-parallel size of its engine: the rollout backend's ``tensor_parallel_size``
    (``rollout.<backend>.tensor_parallel_size``; 1 when the backend has none)."""
    backend_cfg = getattr(cfg.rollout, cfg.rollout.backend, None)
    return {"rollout": int(getattr(backend_cfg, "tensor_parallel_size", 1) or 1)}


def prepare_placement(cfg: TrainConfig, plan: ExecutionPlan, world_size: int):
    """The PlacementPlan of ``placement.mode`` on ``world_size`` ranks; loads no model
    (``auto``: the cost model reads model sizes from configs/GGUF metadata and picks one).

    Raises:
        PlacementError (a ValueError): an impossible placement, naming the ``placement.*`` field.
    """
    from flowrl.compiler.placement import place

    if cfg.placement.mode == "auto":
        from flowrl.compiler.cost import StageCosts, choose_placement

        costs = StageCosts.from_config(plan, cfg, world_size, parallelism=role_parallelism(cfg))
        placement = choose_placement(plan, cfg, world_size, costs, role_parallelism(cfg))
    else:
        placement = place(plan, cfg.placement, world_size, role_parallelism(cfg))
    if placement.mode == "partitioned":  # k >= 1 needs the trainer's old logprobs
        from flowrl.runtime.partitioned_train import check_staleness

        check_staleness(placement, cfg)
    return placement


def _check_estimators(plan: ExecutionPlan, cfg: TrainConfig) -> None:
    """Group-baseline estimators with n = 1 would train on all-zero advantages (case C01)."""
    try:
        from flowrl.algorithms.advantages import validate_estimator
    except ImportError:
        return
    for c in plan.stages:
        if c.stage.op.startswith("advantage."):
            try:
                validate_estimator(c.stage.op.split(".", 1)[1], cfg.algorithm.n)
            except ValueError as e:
                raise ValueError(f"stage '{c.stage.name}': {e}") from e


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.trainer.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is available")
    return torch.device(cfg.trainer.device)


def build_engines(cfg: TrainConfig, plan: ExecutionPlan, tokenizer,
                  world_size: int | None = None, group: Any = None) -> dict[str, Any]:
    """Load the model once and build the engine of every role the plan uses (a partitioned
    pool's plan: only that pool's roles; ``world_size`` = the pool's ranks, ``group`` = the pool's
    process group: FSDP engines shard over it and run their collectives on it, never the world).

    The model is loaded straight onto the run's device (no host copy on a GPU run). The rollout
    engine is built last: an HF engine with its own copy casts ``model`` to its dtype (bf16 on
    CUDA), and every other role must copy the initial weights before that."""
    from flowrl.engines.rollout import build_rollout_engine
    from flowrl.engines.rollout.hf import HFRolloutEngine
    from flowrl.engines.train.local import LocalTrainEngine
    from flowrl.models.loading import load_model, load_tokenizer

    device = _device(cfg)
    model = load_model(cfg.model, device)
    # a partitioned rollout pool trains nothing: no FSDP, no world collectives
    fsdp = bool({"actor", "critic"} & set(plan.roles)) and _use_fsdp(cfg, world_size)
    kw: dict[str, Any] = {}
    if fsdp:
        from flowrl.engines.train.fsdp import broadcast_module, fsdp_variant, pool_mesh

        broadcast_module(model, group=group)  # one random init for every rank of the pool
        LocalTrainEngine = fsdp_variant(LocalTrainEngine)  # noqa: N806 (the class used below)
        if group is not None:
            kw["mesh"] = pool_mesh(group, device)
    engines: dict[str, Any] = {}
    later = {"rollout", "critic", "genrm"} & set(plan.roles)
    lora = cfg.model.lora
    # a LoRA actor's module shares only with an HF rollout engine on one process; vLLM and an
    # FSDP run's HF engine start from a plain copy of the base weights
    shared = not fsdp and "actor" in plan.roles and (lora is None or cfg.rollout.backend == "hf")
    # before any update (and before the rollout engine casts `model`): the frozen copies;
    # LoRA: the reference is the actor with its adapters disabled (flowrl/models/lora.py)
    ref_copy = copy.deepcopy(model) if "ref" in plan.roles and lora is None else None
    # FSDP shards the actor's own copy; `model` stays whole as the rollout engine's module and
    # gets the gathered weights at every sync. One process: rollout shares the module (no copy).
    # A partitioned train pool with no later reader of `model` shards it in place (no copy).
    if "actor" in plan.roles:
        actor_model = copy.deepcopy(model) if later and (fsdp or not shared) else model
        if lora is None:
            engines["actor"] = LocalTrainEngine(actor_model, cfg.trainer.engine, trainable=True, **kw)
        else:
            from flowrl.models.lora import AdapterDisabledReference, build_lora_actor

            sync = "shared" if shared else "full" if cfg.rollout.backend == "vllm" else "changed"
            engines["actor"] = build_lora_actor(LocalTrainEngine, actor_model, lora,
                                                cfg.trainer.engine, sync=sync, **kw)
            if "ref" in plan.roles:
                engines["ref"] = AdapterDisabledReference(engines["actor"])
    if ref_copy is not None:
        engines["ref"] = LocalTrainEngine(ref_copy, cfg.trainer.engine, trainable=False, **kw)
    if "reward_model" in plan.roles:  # classifier RM, frozen
        from flowrl.engines.reward_model import RewardModelEngine, load_reward_model

        rm = load_reward_model(cfg.reward.model.model).to(device)
        engines["reward_model"] = RewardModelEngine(rm, pad_token_id=tokenizer.pad_token_id,
                                                    batch_size=cfg.reward.model.batch_size)
    if "genrm" in plan.roles:  # generative judge: its own model copy, never updated
        judge_cfg = cfg.reward.genrm.model or cfg.model
        judge = copy.deepcopy(model) if judge_cfg == cfg.model else load_model(judge_cfg, device)
        engines["genrm"] = HFRolloutEngine(judge, load_tokenizer(judge_cfg), cfg.reward.genrm.hf)
    if "critic" in plan.roles:  # PPO: value head on the actor's (initial) base weights
        from flowrl.engines.train.value import ValueTrainEngine, value_model_from_causal_lm

        if fsdp:
            ValueTrainEngine = fsdp_variant(ValueTrainEngine)  # noqa: N806
        critic_cfg = cfg.trainer.engine if cfg.trainer.critic_lr is None else \
            dataclasses.replace(cfg.trainer.engine, lr=cfg.trainer.critic_lr)
        engines["critic"] = ValueTrainEngine(value_model_from_causal_lm(model), critic_cfg, **kw)
    if "rollout" in plan.roles:  # partitioned rollout pool: its own copy, no actor
        # a pool's rank (group set) must keep vLLM off the job's torch world: child processes
        engines["rollout"] = build_rollout_engine(cfg.rollout, model, tokenizer, shared=shared,
                                                  own_process=group is not None)
    return engines


def resolve_offload(cfg: TrainConfig, engines: dict[str, Any]) -> tuple[bool, str]:
    """``trainer.offload`` → (move idle models to host memory at the swap points?, why).

    ``auto`` keeps everything resident when it fits (:func:`flowrl.machine.keep_resident`): the
    training state counts 16 bytes per trainable parameter (fp32 weight, gradient, two AdamW
    moments) and 4 per frozen one; the rollout engine its share of the device (vLLM's
    ``gpu_memory_utilization``, an HF copy its weights)."""
    mode = cfg.trainer.offload
    if mode != "auto":
        return mode == "always", f"trainer.offload={mode}"
    device = _device(cfg)
    if device.type != "cuda":
        return False, "CPU run: nothing to free"
    from flowrl.models.lora import AdapterDisabledReference

    state = 0
    for role in ("actor", "critic", "ref"):
        if role in engines and not isinstance(engines[role], AdapterDisabledReference):
            # frozen tensors (a reference, a LoRA actor's base) hold no grads or AdamW moments
            state += sum(p.numel() * (16 if p.requires_grad and role != "ref" else 4)
                         for p in engines[role].model.parameters())
    rollout = 0
    if "rollout" in engines:
        total = torch.cuda.get_device_properties(device).total_memory
        rollout = (int(cfg.rollout.vllm.gpu_memory_utilization * total)
                   if cfg.rollout.backend == "vllm" else
                   sum(p.numel() * p.element_size() for p in engines["rollout"].model.parameters()))
    keep = keep_resident(state, rollout, device)
    return not keep, (f"auto: training state {state / 2**30:.1f} GiB + rollout "
                      f"{rollout / 2**30:.1f} GiB {'fit' if keep else 'do not fit'} in 80% of the device")


def _use_fsdp(cfg: TrainConfig, world: int | None = None) -> bool:
    """FSDP2 engines when asked (``trainer.engine.strategy=fsdp``) or when running on > 1 rank.

    Raises:
        ValueError: ``strategy=local`` under a world size > 1 (ranks would train separate models).
    """
    from flowrl.runtime.distributed import dist_info

    world, strategy = world or dist_info().world_size, cfg.trainer.engine.strategy
    if world > 1 and strategy == "local":
        raise ValueError(f"trainer.engine.strategy=local cannot run on {world} ranks; use auto or fsdp")
    # on CUDA the machine defaults already turned auto into fsdp (flowrl/machine.py)
    return strategy == "fsdp" or (strategy == "auto" and world > 1)


def _train_state(engines: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds as tensors: trainable engines (actor, critic) and the torch RNG."""
    state = {r: engines[r].state_dict() for r in ("actor", "critic") if r in engines}
    state["rng"] = {"torch": torch.get_rng_state()}
    return state


def train(raw: DictConfig | dict) -> dict[str, Any]:
    """Run a whole training job; returns the summary also written to ``summary.json``.

    Raises:
        ConfigError: rejected before any model loaded. RunDirError: the run directory holds a
            previous run (``trainer.resume`` / ``trainer.overwrite``) or another run.
    """
    from flowrl.runtime import distributed as fdist

    cfg, plan, resolved = prepare_run(raw)
    problems = machine_problems(cfg)
    if problems:  # what this machine cannot run: refused before anything loads
        raise ConfigError(problems[0])
    dinfo = fdist.init_distributed(cfg.trainer.device, timeout_s=cfg.launcher.collective_timeout_s)
    if dinfo.world_size == 1 and cfg.trainer.engine.strategy == "fsdp" and \
            {"actor", "critic"} & set(plan.roles):
        dinfo = fdist.init_single_process(cfg.trainer.device)  # FSDP2 needs a (1-rank) group
    rank0 = dinfo.rank == 0
    if rank0:
        for r in resolved:  # the machine's defaults, before anything loads
            log.info("resolved %s", r)
    # ranks' Hydra run dirs can differ by a timestamp second: all use rank 0's (DCP needs one dir)
    out_dir = Path(fdist.broadcast_object(cfg.trainer.output_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    from flowrl.runtime import rundir

    lock = rundir.claim_run_dir(out_dir, cfg.trainer, rank0=rank0)  # one run per directory
    try:
        return _train_in(out_dir, raw, cfg, plan, resolved, dinfo)
    finally:
        lock.release()


def _train_in(out_dir: Path, raw, cfg: TrainConfig, plan: ExecutionPlan, resolved: list[Resolved],
              dinfo) -> dict[str, Any]:
    """:func:`train`'s run in ``out_dir``, which it holds (``runtime/rundir.py``)."""
    from flowrl.data import PromptSource
    from flowrl.models.loading import load_tokenizer
    from flowrl.ops import token_rewards as token_rewards_op
    from flowrl.runtime import distributed as fdist
    from flowrl.runtime.evaluate import eval_line, eval_scorer, evaluate_greedy
    from flowrl.runtime.rundir import finished_run_summary

    rank0 = dinfo.rank == 0
    # a tampered or corrupt checkpoint is refused (ConfigError) before anything reads it further
    ckpts = CheckpointManager(out_dir / "checkpoints", keep_last=cfg.trainer.keep_last)
    resume_from = start_checkpoints(ckpts, cfg.trainer.resume)  # before anything writes here
    if cfg.trainer.resume:  # a finished run: say so once, load nothing
        done = finished_run_summary(out_dir, cfg.trainer.total_steps)
        if done is not None:
            if rank0:
                print(f"run already complete at step {done[0]} (trainer.total_steps="
                      f"{cfg.trainer.total_steps}); raise trainer.total_steps to train further",
                      flush=True)
            return done[1]
    if cfg.placement.mode == "auto" and dinfo.world_size > 1:
        try:  # an impossible auto config is still rejected before any model loads
            prepare_placement(cfg, plan, dinfo.world_size)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        from flowrl.runtime.auto import train_auto  # profile colocated, choose, continue

        return train_auto(raw, cfg, plan, dinfo, out_dir, run=train)
    if cfg.placement.mode != "colocated":
        try:  # rejected before any model loads (ConfigError: main prints one line)
            placement = prepare_placement(cfg, plan, dinfo.world_size)
            if placement.mode == "partitioned":
                from flowrl.runtime.partitioned import check_partitioned

                check_partitioned(placement)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if placement.mode == "partitioned":  # each rank runs its pool's half of the plan
            from flowrl.runtime.partitioned_train import train_partitioned

            if rank0:
                (out_dir / "plan.txt").write_text(plan.format_text() + "\n")
            return train_partitioned(cfg, plan, placement, dinfo, out_dir)
    torch.manual_seed(cfg.trainer.seed)
    if rank0:
        (out_dir / "plan.txt").write_text(plan.format_text() + "\n")

    tokenizer = load_tokenizer(cfg.model)
    prompts = PromptSource(cfg.data, tokenizer, rank=dinfo.rank, world_size=dinfo.world_size)
    t0 = time.perf_counter()
    engines = build_engines(cfg, plan, tokenizer)
    load_s = time.perf_counter() - t0
    log.info("engines built in %.1f s; host peak RSS so far %.2f GiB", load_s, _peak_rss_gib())
    resources = {"tokenizer": tokenizer, "prompts": prompts, "algorithm": cfg.algorithm,
                 "sampling": cfg.rollout.sampling, "trainer": cfg.trainer}
    if "genrm" in plan.roles:
        resources["genrm_tokenizer"] = load_tokenizer(cfg.reward.genrm.model or cfg.model)
    if any(c.stage.op == token_rewards_op.OP_NAME for c in plan.stages):
        # in-reward KL coefficient β: adaptive controllers change it, so it is checkpointed
        resources[token_rewards_op.RESOURCE] = token_rewards_op.make_kl_controller(cfg.algorithm)
    kl_ctrl = resources.get(token_rewards_op.RESOURCE)
    # rank 0 keeps the run seed (world size 1 unchanged); other ranks sample their own streams
    swap, why_swap = resolve_offload(cfg, engines)
    executor = Executor(plan, engines, resources, seed=cfg.trainer.seed + 1_000_003 * dinfo.rank,
                        dist=dinfo, swap=swap)
    actor = engines["actor"]

    start = 1
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    if cfg.trainer.resume:
        latest = resume_from
        if latest is not None:
            tensors = _train_state(engines)
            meta = ckpts.load(latest, tensors)
            actor.load_state_dict(tensors["actor"])
            if "critic" in engines:
                engines["critic"].load_state_dict(tensors["critic"])
            if kl_ctrl is not None and "kl_controller" in meta:
                token_rewards_op.load_controller_state(kl_ctrl, meta["kl_controller"])
            torch.set_rng_state(tensors["rng"]["torch"])
            prompts.load_state_dict(_rescale_prompt_state(meta["prompts"], dinfo.world_size))
            engines["rollout"].load_weights(actor.named_weights())
            start = int(meta["step"]) + 1
            history = meta.get("history", [])
            if (out_dir / "summary.json").is_file():  # keep the record of the earlier part
                summary = json.loads((out_dir / "summary.json").read_text())
            log.info("resumed from %s: continuing at step %d of %d", latest, start,
                     cfg.trainer.total_steps)
        else:
            log.info("trainer.resume=true but no checkpoint in %s: starting fresh", ckpts.root)

    scorer = eval_scorer(plan)  # the graph's own verifier (prepare checked there is one)
    from flowrl.ops.multi_turn import eval_engine

    eval_rollout = eval_engine(plan, engines["rollout"], tokenizer)  # multi-turn: with its tools
    ev = cfg.trainer.eval
    eval_kw = dict(split=ev.split, limit=ev.limit, batch_size=ev.batch_size,
                   max_new_tokens=ev.max_new_tokens, stop_token_ids=cfg.rollout.sampling.stop_token_ids)
    summary.update({"model_load_s": load_s, "plan_order": plan.order})
    finished = start > cfg.trainer.total_steps  # resumed a run that had already completed
    logger = MetricsLogger(out_dir, cfg.logger, cfg.trainer.total_steps, enabled=rank0,
                           run_config=OmegaConf.to_container(OmegaConf.structured(cfg)),
                           first_step=start)
    with logger:
        logger.print(f"[bold]flowrl[/bold] graph={plan.graph.name} steps={cfg.trainer.total_steps} "
                     f"batch={cfg.trainer.prompts_per_step}x{cfg.algorithm.n} out={out_dir}")
        logger.print(f"machine: device={cfg.trainer.device} rollout={cfg.rollout.backend} "
                     f"dtype={cfg.model.dtype} strategy={cfg.trainer.engine.strategy} "
                     f"offload={'on' if swap else 'off'} ({why_swap})")
        if ev.before and start == 1 and rank0:  # rank 0's rollout engine holds full weights
            before = evaluate_greedy(eval_rollout, prompts, tokenizer, scorer, **eval_kw,
                                     samples_path=out_dir / "eval_before.jsonl",
                                     on_progress=logger.eval_progress("eval before"))
            summary["eval_before"] = before
            if before:
                logger.log(0, before)
                logger.print(f"eval before: {eval_line(before)}")
        logger.set_progress(start - 1)
        for step in range(start, cfg.trainer.total_steps + 1):
            fdist.mark_step(step)  # the peer monitor names a rank that stops making progress
            m = fdist.reduce_metrics(executor.run_step(step))  # sum/mean/max across ranks
            gen_tokens = (m.get("response/length_mean", 0.0) * cfg.trainer.prompts_per_step
                          * cfg.algorithm.n * dinfo.world_size)
            m["perf/tokens_per_s"] = gen_tokens / max(m["perf/step_s"], 1e-9)
            logger.log(step, m)
            history.append({"step": step, **{k: m[k] for k in ("reward/mean", "reward/accuracy",
                                                                "perf/step_s") if k in m}})
            last = step == cfg.trainer.total_steps
            if last or (cfg.trainer.save_every and step % cfg.trainer.save_every == 0):
                t_s = time.perf_counter()
                extra = {} if kl_ctrl is None else {
                    "kl_controller": token_rewards_op.controller_state(kl_ctrl)}
                ckpts.save(step, _train_state(engines),
                           {"prompts": prompts.state_dict(), "history": history,
                            "world_size": dinfo.world_size, "model": dataclasses.asdict(cfg.model),
                            **extra}, async_save=cfg.trainer.async_save and not last)
                # async: only the copy to host memory blocked the step
                logger.log(step, {"perf/checkpoint_s": time.perf_counter() - t_s,
                                  "perf/host_peak_rss_gib_after_checkpoint": _peak_rss_gib()})
            ckpts.poll()
        ckpts.wait()
        if finished:
            logger.print(f"run already complete at step {start - 1} (trainer.total_steps="
                         f"{cfg.trainer.total_steps}); raise trainer.total_steps to train further")
        if ev.after and rank0 and not finished:
            after = evaluate_greedy(eval_rollout, prompts, tokenizer, scorer, **eval_kw,
                                    samples_path=out_dir / "eval_after.jsonl",
                                    on_progress=logger.eval_progress("eval after"))
            summary["eval_after"] = after
            if after:
                logger.log(cfg.trainer.total_steps, after)
                logger.print(f"eval after: {eval_line(after)}")
    summary["history"] = history
    summary["checkpoint"] = str(ckpts.latest())
    if rank0:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    close_engines(engines)  # vLLM's shutdown destroys process groups: before our teardown
    return summary


def start_checkpoints(ckpts: CheckpointManager, resume: bool):
    """Start-up of the run's checkpoint folder: stale ``.tmp`` saves removed; with ``resume``,
    the checkpoint to continue from (a corrupt newest one falls back to the previous).

    Raises:
        ConfigError: a tampered or unloadable checkpoint; nothing was loaded or written.
    """
    from flowrl.runtime.checkpoint import CorruptCheckpointError, UnsafeCheckpointError

    try:
        ckpts.remove_stale()
        return ckpts.resume_point() if resume else None
    except (UnsafeCheckpointError, CorruptCheckpointError) as e:
        raise ConfigError(f"trainer.resume: {e}") from e


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def close_engines(engines: dict[str, Any]) -> None:
    """Close every engine that has a ``close`` (vLLM: in-process engine shutdown, or the engine
    processes stopped and joined); the dict is emptied so a second call does nothing."""
    for eng in list(engines.values()):
        if hasattr(eng, "close"):
            eng.close()
    engines.clear()


def _rescale_prompt_state(state: dict[str, Any], world_size: int) -> dict[str, Any]:
    """A prompt-source state saved at another world size: the shards differ, so the sampler
    restarts at the next epoch (every prompt seen again, in a new order); step and group-id
    offset carry over, so group ids stay unique. Same world size: returned unchanged."""
    saved = state["sampler"].get("world_size", world_size)
    if saved == world_size:
        return state
    log.warning("resuming a world-size-%d run on %d ranks: the prompt sampler restarts at epoch %d",
                saved, world_size, state["sampler"]["epoch"] + 1)
    sampler = {**state["sampler"], "world_size": world_size,
               "epoch": state["sampler"]["epoch"] + 1, "position": 0}
    return {**state, "sampler": sampler}


register_configs()


# absolute: Hydra resolves a relative path against the package when this module is imported
@hydra.main(version_base="1.3", config_path=str(REPO_ROOT / "conf"), config_name="train")
def main(cfg: DictConfig) -> None:
    import sys

    from hydra.core.hydra_config import HydraConfig

    from flowrl.runtime import rundir
    from flowrl.runtime.distributed import teardown
    from flowrl.runtime.recovery import report_crash, stop_on_sigterm

    hydra_dir = HydraConfig.get().runtime.output_dir
    stop_on_sigterm()  # torchrun stops the survivors of a dead rank with SIGTERM
    try:
        train(cfg)
    except (ConfigError, rundir.RunDirError) as e:  # rejected before any model loaded: one line
        print(f"flowrl train: error: {e}", file=sys.stderr)
        if isinstance(e, ConfigError):  # a multirun job's directory: Hydra's files only
            rundir.remove_hydra_leftovers(Path(hydra_dir))
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"\nflowrl train: interrupted; {rundir.resume_hint(cfg.trainer.output_dir, hydra_dir)}",
              file=sys.stderr)
        sys.exit(130)
    except BaseException as e:  # SIGTERM, a dead peer, a full disk, a diverged step...
        if isinstance(e, SystemExit):
            raise
        sys.exit(report_crash(e, cfg.trainer.output_dir))
    finally:
        teardown()


if __name__ == "__main__":
    main()
