"""``flowrl train placement=partitioned launcher.nproc=2``: the training job of a partitioned
placement (``flowrl.train.train`` hands over here once the placement is known).

Each rank builds only its pool's engines: the rollout pool a rollout engine on its own model copy
(weights arrive by broadcast, version ``start - 1`` first), the train pool the actor (+ ref,
critic) and no rollout engine; a train pool of several ranks shards them with FSDP2 over the
pool's own process group (``build_engines(group=)``), so the rollout ranks never join a training
collective. Seeds and prompt shards follow the *pool* data-parallel rank, so
pool rank 0 draws what rank 0 of a colocated run draws: with ``staleness=0`` a partitioned run
trains the same weights as a colocated one on the same seeds.

Checkpoints: every rank takes part in each save (DCP is collective over the job); the rollout
pool contributes no tensors, the prompt sampler's state travels with each batch to the train pool,
which writes it into the metadata. A rollout rank joins the save of step ``s`` right after it
received weight version ``s`` (or after its last step when no later rollout needs that version),
which is where the train pool waits for it, so saving never deadlocks the queue.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from flowrl.compiler.placement import PlacementError, PlacementPlan
from flowrl.runtime.partitioned import RolloutPool, TrainPool, check_partitioned, pool_context

log = logging.getLogger("flowrl")
# seconds a pool waits for the other before raising PoolPeerError (a dead peer is reported at
# once; this bounds a silent one). Covers the other pool's model load and first generation.
POOL_TIMEOUT_S = float(os.environ.get("FLOWRL_POOL_TIMEOUT_S", 1800))


def check_staleness(placement: PlacementPlan, cfg) -> None:
    """k >= 1 trains on batches from older weights: the trainer must recompute old logprobs.

    Raises:
        PlacementError: ``placement.staleness >= 1`` with ``algorithm.recompute_old_logprobs=false``.
    """
    if placement.staleness >= 1 and not cfg.algorithm.recompute_old_logprobs:
        raise PlacementError(
            f"placement.staleness={placement.staleness} trains on batches up to "
            f"{placement.staleness} weight versions old: the trainer must recompute old logprobs "
            "(set algorithm.recompute_old_logprobs=true, or placement.staleness=0)")


def train_partitioned(cfg, plan, placement: PlacementPlan, dinfo, out_dir: Path) -> dict[str, Any]:
    """Run the job on this rank's pool; returns the summary (written by train-pool rank 0).

    The rank's engines are closed on the way out, error or not: a rollout pool's vLLM engine
    processes must not outlive the run (torchrun would wait for them)."""
    from flowrl.train import close_engines

    engines: dict[str, Any] = {}
    try:
        return _train_partitioned(cfg, plan, placement, dinfo, out_dir, engines)
    finally:
        close_engines(engines)


def _train_partitioned(cfg, plan, placement: PlacementPlan, dinfo, out_dir: Path,
                       engines: dict[str, Any]) -> dict[str, Any]:
    from flowrl.data import PromptSource
    from flowrl.models.loading import load_tokenizer
    from flowrl.ops import token_rewards as token_rewards_op
    from flowrl.runtime.checkpoint import CheckpointManager
    from flowrl.runtime.executor import Executor
    from flowrl.runtime.metrics import MetricsLogger
    from flowrl.train import _device, _rescale_prompt_state, _train_state, build_engines

    check_partitioned(placement)  # flowrl.train checked both already; direct callers get them too
    check_staleness(placement, cfg)
    device = _device(cfg)
    ctx = pool_context(placement, dinfo.rank, bucket_mb=cfg.placement.bucket_mb, device=device,
                       timeout_s=POOL_TIMEOUT_S)
    k, T = placement.staleness, cfg.trainer.total_steps
    logs = dinfo.rank == placement.pools["train"].ranks[0]
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = load_tokenizer(cfg.model)
    prompts = PromptSource(cfg.data, tokenizer, rank=ctx.dist.rank, world_size=ctx.dist.world_size)
    t0 = time.perf_counter()
    engines.update(build_engines(cfg, ctx.pool.plan, tokenizer, world_size=ctx.dist.world_size,
                                 group=ctx.dist.group))  # the caller closes them
    load_s = time.perf_counter() - t0
    resources = {"tokenizer": tokenizer, "prompts": prompts, "algorithm": cfg.algorithm,
                 "sampling": cfg.rollout.sampling, "trainer": cfg.trainer}
    if "genrm" in ctx.pool.roles:
        resources["genrm_tokenizer"] = load_tokenizer(cfg.reward.genrm.model or cfg.model)
    if any(c.stage.op == token_rewards_op.OP_NAME for c in ctx.pool.plan.stages):
        resources[token_rewards_op.RESOURCE] = token_rewards_op.make_kl_controller(cfg.algorithm)
    # the pool rank, not the global rank, offsets the seed: pool rank 0 = colocated rank 0
    executor = Executor(ctx.pool.plan, engines, resources, dist=ctx.dist, sends=ctx.pool.sends,
                        seed=cfg.trainer.seed + 1_000_003 * ctx.dist.rank)
    ckpts = CheckpointManager(out_dir / "checkpoints", keep_last=cfg.trainer.keep_last)
    start, history, summary = 1, [], {"model_load_s": load_s, "plan_order": placement.full.order,
                                      "placement": "partitioned", "staleness": k}
    if cfg.trainer.resume and ckpts.latest() is not None:
        latest = ckpts.latest()
        tensors = _train_state(engines) if ctx.is_train else {}
        meta = ckpts.load(latest, tensors)  # collective: the rollout pool loads nothing
        if ctx.is_train:
            engines["actor"].load_state_dict(tensors["actor"])
            if "critic" in engines:
                engines["critic"].load_state_dict(tensors["critic"])
            torch.set_rng_state(tensors["rng"]["torch"])
        else:  # a checkpoint of another sampler layout (e.g. placement=auto's colocated
            # profile on every rank) restarts the sampler's epoch; see _rescale_prompt_state
            prompts.load_state_dict(_rescale_prompt_state(meta["prompts"], ctx.dist.world_size))
        start, history = int(meta["step"]) + 1, meta.get("history", [])
        log.info("resumed from %s: continuing at step %d", latest, start)
        if (out_dir / "summary.json").is_file():  # keep the record of the earlier part
            earlier = json.loads((out_dir / "summary.json").read_text())
            summary = {**earlier, **summary,
                       "version_lags": earlier.get("version_lags", [])[:start - 1]}
        if start > T:  # a finished run: say so, change nothing (as the colocated path does)
            if logs:
                print(f"run already complete at step {start - 1} (trainer.total_steps={T}); "
                      "raise trainer.total_steps to train further", flush=True)
            return summary
    save_steps = [s for s in range(start, T + 1)
                  if s == T or (cfg.trainer.save_every and s % cfg.trainer.save_every == 0)]

    def save(step: int, state: dict, prompt_state: Any) -> None:
        ckpts.save(step, state, {"prompts": prompt_state, "history": history,
                                 "world_size": dinfo.world_size, "placement": "partitioned",
                                 "model": dataclasses.asdict(cfg.model)})

    if not ctx.is_train:
        pool = RolloutPool(executor, ctx, staleness=k, timeout_s=POOL_TIMEOUT_S, device=device)
        pool.receive_weights()  # version start - 1
        for step in range(start, T + 1):
            while pool.version < step - 1 - k:
                pool.receive_weights()
                if pool.version in save_steps:
                    save(pool.version, {}, None)
            pool.step(step)
        for s in save_steps:  # versions no rollout needed: the train pool saves them in order
            if s > pool.version:
                save(s, {}, None)
        pool.finish()
        return summary

    pool = TrainPool(executor, ctx, staleness=k, timeout_s=POOL_TIMEOUT_S, device=device,
                     total_steps=T)
    pool.send_weights(start - 1)
    n_roll = len(placement.pools["rollout"].ranks)
    logger = MetricsLogger(out_dir, cfg.logger, T, enabled=logs,
                           run_config=OmegaConf.to_container(OmegaConf.structured(cfg)),
                           first_step=start)
    evaluate = _evaluator(cfg, plan, engines, prompts, tokenizer, rank0=logs)
    with logger:
        logger.print(f"[bold]flowrl[/bold] graph={plan.graph.name} placement=partitioned "
                     f"train={placement.pools['train'].ranks} rollout={placement.pools['rollout'].ranks}"
                     f" staleness={k} steps={T} out={out_dir}")
        if evaluate and cfg.trainer.eval.before and start == 1:
            summary["eval_before"] = evaluate(logger.eval_progress("eval before"))  # None: rank > 0
            if logs:
                logger.log(0, summary["eval_before"])
        logger.set_progress(start - 1)
        for step in range(start, T + 1):
            m = pool.step(step)
            gen_tokens = (m.get("response/length_mean", 0.0) * cfg.trainer.prompts_per_step
                          * cfg.algorithm.n * n_roll)
            m["perf/tokens_per_s"] = gen_tokens / max(m["perf/step_s"], 1e-9)
            logger.log(step, m)
            history.append({"step": step, **{k_: m[k_] for k_ in (
                "reward/mean", "reward/accuracy", "perf/step_s", "placement/version_lag") if k_ in m}})
            if step in save_steps:
                save(step, _train_state(engines), pool.rollout_state)
        if evaluate and cfg.trainer.eval.after and start <= T:
            summary["eval_after"] = evaluate(logger.eval_progress("eval after"))
            if logs:
                logger.log(T, summary["eval_after"])
    summary.update(history=history, version_lags=summary.get("version_lags", []) + pool.lags,
                   checkpoint=str(ckpts.latest()))
    if logs:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _evaluator(cfg, plan, engines, prompts, tokenizer, *, rank0: bool):
    """Greedy eval on train-pool rank 0 (the trainer holds the newest weights; the rollout pool
    keeps generating meanwhile). One train rank: an HF engine over the actor's own module (shared,
    no copy). Several (FSDP): the module is sharded, so every train rank joins the gather of the
    actor's weights and rank 0 evaluates a full model copy it loads for the eval and then drops.
    Returns a callable ``evaluate(on_progress)`` for every train rank (it returns None on ranks
    > 0), or None. Answers are scored by the graph's verifier (``evaluate.eval_scorer``)."""
    from flowrl.engines.rollout.hf import HFRolloutEngine
    from flowrl.runtime.evaluate import eval_scorer, evaluate_greedy

    ev = cfg.trainer.eval
    if not (ev.before or ev.after) or ev.limit == 0:
        return None
    actor = engines["actor"]
    if prompts.world_size > 1:  # the train pool's shard of the eval slice: rank 0 evaluates it all
        from flowrl.data import PromptSource

        prompts = PromptSource(cfg.data, tokenizer)
    scorer = eval_scorer(plan)
    run = lambda engine, on_progress: evaluate_greedy(  # noqa: E731
        engine, prompts, tokenizer, scorer, split=ev.split, limit=ev.limit,
        batch_size=ev.batch_size, max_new_tokens=ev.max_new_tokens,
        stop_token_ids=cfg.rollout.sampling.stop_token_ids, on_progress=on_progress)
    if not getattr(actor, "_lockstep", False):
        if not rank0:
            return None
        shared = HFRolloutEngine(actor.model, tokenizer, cfg.rollout.hf, shared=True)
        return lambda on_progress=None: run(shared, on_progress)

    def gathered(on_progress=None):
        from flowrl.models.loading import load_model

        named = actor.named_weights()  # collective over the train pool: iterate to the end
        if not rank0:
            for _ in named:
                pass
            return None
        with torch.random.fork_rng(devices=[]):  # a random init must not move rank 0's RNG
            model = load_model(cfg.model)
        engine = HFRolloutEngine(model.to(actor.device), tokenizer, cfg.rollout.hf)
        engine.load_weights(named)
        return run(engine, on_progress)

    return gathered


__all__ = ["POOL_TIMEOUT_S", "check_staleness", "train_partitioned"]
