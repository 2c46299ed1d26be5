"""Sizes the cost model needs, computed without loading any weights: parameter counts and
architecture of each role's model, bytes of each intermediate tensor, and memory per role.

* Parameter counts: a tiny or local HF model is instantiated on torch's ``meta`` device (shapes
  only, no memory); the SmolLM2 GGUF is read with the ``gguf`` library (metadata and tensor
  shapes, memory-mapped, nothing dequantized).
* Tensor bytes use the shapes and dtypes the ops document (``B`` rows, ``P`` prompt tokens, ``R``
  response tokens): see :data:`OUTPUT_LAYOUT`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

from flowrl.graph.roles import ROLES

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
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


@dataclass(frozen=True)
class ModelSize:
    """What the cost model knows about one model.

    Attributes:
        n_params: parameter count (tied embeddings counted once).
        n_layers, n_kv_heads, head_dim: attention shape, for the KV cache.
        dtype_bytes: bytes per parameter in the training dtype (``model.dtype``).
    """

    n_params: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype_bytes: int = 4

    @property
    def weight_bytes(self) -> int:
        return self.n_params * self.dtype_bytes

    def kv_bytes(self, tokens: int) -> int:
        """KV cache of ``tokens`` cached positions: 2 (K and V) × layers × kv_heads × head_dim ×
        tokens × dtype bytes."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * tokens * self.dtype_bytes


def _size_from_hf_config(config: Any, dtype_bytes: int) -> ModelSize:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: no allocation, no init cost
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return ModelSize(int(n), config.num_hidden_layers, kv, head_dim, dtype_bytes)


@lru_cache(maxsize=16)
def _gguf_size(path: str, dtype_bytes: int) -> ModelSize:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def meta(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].contents())

    heads = meta("attention.head_count")
    n = sum(int(t.n_elements) for t in reader.tensors)
    return ModelSize(n, meta("block_count"), meta("attention.head_count_kv"),
                     meta("embedding_length") // heads, dtype_bytes)


def model_size(cfg: Any) -> ModelSize:
    """ModelSize of a ``ModelConfig`` without loading weights (see the module docstring).

    Raises:
        FileNotFoundError: the SmolLM2 package or GGUF file is missing.
    """
    from flowrl.models.loading import SMOLLM2, smollm2_dir

    nbytes = DTYPE_BYTES.get(cfg.dtype, 4)  # "auto" = fp32 master weights
    if cfg.tiny is not None:
        from transformers import AutoConfig

        from flowrl.models.loading import bundled_tokenizer_dir

        tiny = dict(cfg.tiny)
        if "vocab_size" not in tiny:  # load_model takes it from the bundled tokenizer
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(bundled_tokenizer_dir() / "tokenizer.json"))
            tiny["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
        for name in ("bos_token_id", "eos_token_id"):  # special ids do not change the size
            tiny.setdefault(name, None)
        return _size_from_hf_config(AutoConfig.for_model(tiny.pop("model_type"), **tiny), nbytes)
    folder = smollm2_dir() if cfg.path == SMOLLM2 else cfg.path
    if cfg.gguf_file is not None:
        from pathlib import Path

        f = Path(folder) / cfg.gguf_file
        if not f.is_file():
            raise FileNotFoundError(f"model.gguf_file {cfg.gguf_file!r} not found in {folder}")
        return _gguf_size(str(f), nbytes)
    from transformers import AutoConfig

    return _size_from_hf_config(AutoConfig.from_pretrained(str(folder)), nbytes)


def role_model_configs(cfg: Any) -> dict[str, Any]:
    """role → ModelConfig of a TrainConfig: the actor's model serves actor, rollout, ref and
    critic (value head on the same backbone; its one-output head is ignored); ``reward.model``
    the reward model; ``reward.genrm.model`` (or the actor's) the judge."""
    out = {r: cfg.model for r in ("actor", "rollout", "ref", "critic")}
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
    * frozen roles (ref, reward_model): the weights, unsharded.
    * generate roles (rollout, genrm): the weights + the KV cache of ``kv_tokens`` positions held by
      one device (rows per device × (P + R)).
    Activations and logits are not counted (micro-batching bounds them; see trainer.engine).
    """
    kind = ROLES[role].kind
    if kind == "train":
        gathered = size.weight_bytes if pool_size > 1 else 0
        return 4 * size.weight_bytes // pool_size + gathered
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


__all__ = ["DTYPE_BYTES", "ModelSize", "OUTPUT_LAYOUT", "fmt_bytes", "model_size",
           "pool_peak_memory", "role_memory", "role_model_configs", "tensor_bytes"]
