"""A user module of ``benchmarks/faults.py`` that breaks the LoRA merge, as a plugin that
replaces it would: importing it (the run's in-process reward function,
``_fault_lora_merge:length_reward``) makes ``models.lora.merged_weights`` send every adapted
layer's base weight, the adapters not merged. The readback check passes (the engine holds what
was sent); ``rollout.verify_sync``'s effective-weight check must stop the run at the first sync."""
from __future__ import annotations

from _fault_rewards import length_reward  # noqa: F401 (the reward the graph names)

from flowrl.models import lora


def _base_weights(model, adapter="default", full=False):
    from peft.tuners.lora import LoraLayer
    from torch.distributed.tensor import DTensor

    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            w = m.get_base_layer().weight.detach()
            yield f"{name}.weight", w.full_tensor() if isinstance(w, DTensor) else w


lora.merged_weights = _base_weights
