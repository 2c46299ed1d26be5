"""Rollout engines behind one seam (``flowrl.engines.base.RolloutEngine``), chosen by name.

``rollout.backend`` selects a builder in :data:`ROLLOUT_BACKENDS`: ``hf`` (transformers
``generate``, the embedded default) or ``vllm`` (``engines/rollout/vllm.py``; vLLM is imported
only when that engine is built).
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn


def _build_hf(rollout_cfg, model: nn.Module, tokenizer, *, shared: bool):
    from flowrl.engines.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(model, tokenizer, rollout_cfg.hf, shared=shared)


def _build_vllm(rollout_cfg, model: nn.Module, tokenizer, *, shared: bool):
    # vLLM always holds its own copy of the weights (``shared`` does not apply): the plan's weight
    # syncs feed it through load_weights.
    from flowrl.engines.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(model, tokenizer, rollout_cfg.vllm)


ROLLOUT_BACKENDS: dict[str, Callable[..., Any]] = {"hf": _build_hf, "vllm": _build_vllm}


def build_rollout_engine(rollout_cfg, model: nn.Module, tokenizer, *, shared: bool = False):
    """Build the rollout engine ``rollout_cfg.backend`` names.

    Args:
        rollout_cfg: ``flowrl.config.RolloutConfig`` (backend, sampling, hf, vllm sections).
        model: the policy's HF causal LM with its initial weights.
        tokenizer: the policy's tokenizer.
        shared: ``model`` is the actor train engine's own module (HF engine: zero-copy sync).

    Raises:
        ValueError: unknown backend. ImportError: ``vllm`` requested but not installed.
    """
    try:
        build = ROLLOUT_BACKENDS[rollout_cfg.backend]
    except KeyError:
        raise ValueError(f"rollout.backend must be one of {sorted(ROLLOUT_BACKENDS)}, "
                         f"got {rollout_cfg.backend!r}") from None
    return build(rollout_cfg, model, tokenizer, shared=shared)
