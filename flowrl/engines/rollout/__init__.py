"""Rollout engines behind one seam (``flowrl.engines.base.RolloutEngine``), chosen by name.

``rollout.backend`` selects a builder in :data:`ROLLOUT_BACKENDS`: ``hf`` (transformers
``generate``, the embedded default) or ``vllm`` (vLLM is imported only when that engine is built):
in the rank's own process (``engines/rollout/vllm.py``) or in child processes with a torch world of
their own (``engines/rollout/vllm_proc.py``: ``rollout.vllm.engine_procs >= 1``, and always on a
partitioned rollout pool, whose ranks must not let vLLM build process groups over the job's world).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from flowrl.engines.rollout.vllm_config import RolloutJob

log = logging.getLogger("flowrl")

if TYPE_CHECKING:  # ROLLOUT_BACKENDS is read by the run config, before torch loads
    from torch import nn


def _build_hf(rollout_cfg, model: nn.Module, tokenizer, *, shared: bool, own_process: bool,
              job: RolloutJob | None = None, image_processor: Any = None, lora: Any = None):
    # transformers generate makes no process groups: own_process does not apply; the batch's
    # pixel_values go to the module as they are (no image processor); a LoRA policy's syncs
    # are merged tensors (`lora` does not apply)
    from flowrl.engines.rollout.hf import HFRolloutEngine

    cfg = rollout_cfg.hf
    if job is not None:  # the job-sized default (compile), printed with its reason
        on_cuda = next(model.parameters()).device.type == "cuda"
        cfg, why = cfg.sized_for(job, on_cuda)
        for line in why:
            log.info("  resolved %s", line)
    return HFRolloutEngine(model, tokenizer, cfg, shared=shared)


def _build_vllm(rollout_cfg, model: nn.Module, tokenizer, *, shared: bool, own_process: bool,
                job: RolloutJob | None = None, image_processor: Any = None, lora: Any = None):
    # vLLM always holds its own copy of the weights (``shared`` does not apply): the plan's weight
    # syncs feed it through load_weights.
    from flowrl.engines.rollout.vllm import kv_shape, weights_and_device_memory

    cfg = rollout_cfg.vllm
    if job is None:
        procs = cfg.engine_procs_for(*weights_and_device_memory(model), own_process=own_process)
    else:  # the job-sized defaults, each printed with its reason
        # an image prompt's length is its processor's (not data.max_prompt_tokens): no KV sizing
        kv = None if image_processor is not None else kv_shape(model, cfg)
        procs, cfg, why = cfg.sized_for(job, *weights_and_device_memory(model),
                                        own_process=own_process, kv=kv)
        for line in why:
            log.info("  resolved %s", line)
    if procs >= 1:
        from flowrl.engines.rollout.vllm_proc import VLLMProcessEngine

        return VLLMProcessEngine(model, tokenizer, cfg, procs=procs, image_processor=image_processor,
                                 lora=lora)
    from flowrl.engines.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(model, tokenizer, cfg, image_processor=image_processor, lora=lora)


ROLLOUT_BACKENDS: dict[str, Callable[..., Any]] = {"hf": _build_hf, "vllm": _build_vllm}


def build_rollout_engine(rollout_cfg, model: nn.Module, tokenizer, *, shared: bool = False,
                         own_process: bool = False, job: RolloutJob | None = None,
                         image_processor: Any = None, lora: Any = None):
    """Build the rollout engine ``rollout_cfg.backend`` names.

    Args:
        rollout_cfg: ``flowrl.config.RolloutConfig`` (backend, sampling, hf, vllm sections).
        model: the policy's HF causal LM with its initial weights.
        tokenizer: the policy's tokenizer.
        shared: ``model`` is the actor train engine's own module (HF engine: zero-copy sync).
        own_process: the engine must not join this process's torch world (a partitioned rollout
            pool): ``vllm`` runs in at least one child process
            (``VLLMRolloutConfig.engine_procs_for``); ``hf`` ignores it.
        job: the run's rollout demand on this rank; ``vllm`` sizes its ``None`` settings to it
            (``VLLMRolloutConfig.sized_for``: engine processes, eager or CUDA graphs and their
            sizes, a fixed KV cache for side-by-side start), ``hf`` its ``compile``
            (``HFRolloutConfig.sized_for``). None = the rules without it.
        image_processor: a vision-language policy's image processor (``vllm`` exports it with
            the model and hands the prompts' images to vLLM); None for a text model.
        lora: a LoRA policy's ``LoraAdapterSpec`` (``flowrl.models.lora.adapter_spec``; ``model``
            is the base model): ``vllm`` serves it by ``rollout.vllm.lora_sync``; ``hf`` ignores it.

    Raises:
        ValueError: unknown backend; ``vllm`` with a vision-language model and no
            ``image_processor``. ImportError: ``vllm`` requested but not installed.
    """
    try:
        build = ROLLOUT_BACKENDS[rollout_cfg.backend]
    except KeyError:
        raise ValueError(f"rollout.backend must be one of {sorted(ROLLOUT_BACKENDS)}, "
                         f"got {rollout_cfg.backend!r}") from None
    return build(rollout_cfg, model, tokenizer, shared=shared, own_process=own_process, job=job,
                 image_processor=image_processor, lora=lora)
