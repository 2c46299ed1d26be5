"""Sizes the cost model needs, computed without loading any weights: bytes of each intermediate
tensor and memory per role, from each role's :class:`ModelSize` (parameter count and attention
shape, which the run's model configs report: ``ModelConfig.size()`` in ``flowrl/models/size.py``).

* Tensor bytes use the shapes and dtypes the ops document (``B`` rows, ``P`` prompt tokens, ``R``
  response tokens): see :data:`OUTPUT_LAYOUT`.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

from flowrl.graph.roles import ROLES

# output name -> (dims, bytes per element). dims: "B" = (B,), "BP" = (B, P), "BR" = (B, R).
# ground_truth is a list of short strings (GSM8K answers): counted as 16 bytes a row.
OUTPUT_LAYOUT: dict[str, tuple[str, int]] = {
    "prompt_ids": ("BP", 8), "prompt_mask": ("BP", 1), "group_id": ("B", 8),
    "ground_truth": ("B", 16), "response_ids": ("BR", 8), "response_mask": ("BR", 1),
    "rollout_logprobs": ("BR", 4), "truncated": ("B", 1), "rewards": ("B", 4),
    "token_rewards": ("BR", 4), "logprobs": ("BR", 4), "values": ("BR", 4),
    "advantages": ("BR", 4), "returns": ("BR", 4),
}
UNKNOWN_LAYOUT = ("BR", 4)  # an output not in the table: assume a float32 per response token


class ModelSize(Protocol):
    """What the cost model reads of one model. ``flowrl.models.size.ModelSize`` is one; a run's
    ``ModelConfig.size()`` makes it (the compiler imports no model code: DESIGN.md "Layers")."""

    n_params: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype_bytes: int
    trainable_params: int  # 0: every parameter trains; else a LoRA model's adapters

    @property
    def weight_bytes(self) -> int: ...

    def kv_bytes(self, tokens: int) -> int: ...


def role_model_configs(cfg: Any) -> dict[str, Any]:
    """role → ModelConfig of a TrainConfig: the actor's model serves actor, rollout, ref and
    critic (value head on the same backbone; its one-output head is ignored); ``reward.model``
    the reward model; ``reward.genrm.model`` (or the actor's) the judge; ``teacher`` the teacher
    and its sampler ``teacher_rollout`` (unset — only ``flowrl plan`` gets that far — it is
    sized as the policy)."""
    out = {r: cfg.model for r in ("actor", "rollout", "ref", "critic")}
    out["teacher"] = out["teacher_rollout"] = cfg.teacher if cfg.teacher.is_set else cfg.model
    if cfg.reward.model.model is not None:
        out["reward_model"] = cfg.reward.model.model
    out["genrm"] = cfg.reward.genrm.model or cfg.model
    return out


def tensor_bytes(key: str, batch: int, prompt_tokens: int, response_tokens: int) -> int:
    """Bytes of intermediate ``key = "stage.output"`` for ``batch`` rows (layout from
    :data:`OUTPUT_LAYOUT`; padded shapes, so P and R are the padded lengths)."""
    dims, nbytes = OUTPUT_LAYOUT.get(key.rsplit(".", 1)[-1], UNKNOWN_LAYOUT)
    per_row = {"B": 1, "BP": prompt_tokens, "BR": response_tokens}[dims]
    return batch * per_row * nbytes


def role_memory(role: str, size: ModelSize, pool_size: int, kv_tokens: int = 0) -> int:
    """Predicted peak bytes per device of ``role`` alone on a pool of ``pool_size`` devices.

    * train roles (actor, critic): weights + grads + 2 AdamW moments in the training dtype (4 ×
      params × bytes), FSDP-sharded over the pool, plus one gathered copy of the weights while a
      layer group computes when the pool has more than one device (upper bound: the whole model).
      A LoRA model (``size.trainable_params`` set): the frozen weights + the adapters with their
      grads and 2 moments (params + 4 × adapters, × bytes).
    * frozen roles (ref, teacher, reward_model): the weights, unsharded; a LoRA model's ref: 0
      (the actor's weights with the adapters off serve it: no copy).
    * generate roles (rollout, genrm, teacher_rollout): the weights + the KV cache of ``kv_tokens`` positions held by
      one device (rows per device × (P + R)).
    Activations and logits are not counted (micro-batching bounds them; see trainer.engine).
    """
    kind = ROLES[role].kind
    lora = size.trainable_params
    if kind == "train":
        gathered = size.weight_bytes if pool_size > 1 else 0
        state = (size.n_params + 4 * lora) * size.dtype_bytes if lora else 4 * size.weight_bytes
        return state // pool_size + gathered
    if role == "ref" and lora:
        return 0
    if kind == "generate":
        return size.weight_bytes + size.kv_bytes(kv_tokens)
    return size.weight_bytes


def fmt_bytes(n: float) -> str:
    """1536 → '1.5 KiB' (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def pool_peak_memory(roles: list[str], sizes: dict[str, ModelSize], pool_size: int,
                     kv_tokens: int) -> tuple[int, Optional[str]]:
    """(peak bytes per device, the role that sets it): roles of one pool take turns (swap points),
    so the peak is the max over roles. (The rollout role serves the actor's weights in place: its
    phase holds those weights + its KV cache, the actor's grads and moments being offloaded.)"""
    best, who = 0, None
    for r in roles:
        m = role_memory(r, sizes[r], pool_size, kv_tokens)
        if m > best:
            best, who = m, r
    return best, who


__all__ = ["ModelSize", "OUTPUT_LAYOUT", "fmt_bytes",
           "pool_peak_memory", "role_memory", "role_model_configs", "tensor_bytes"]
