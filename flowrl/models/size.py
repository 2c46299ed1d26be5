"""A model's size without loading any weights: parameter count and attention shape, for the
compiler's cost model (``ModelConfig.size()``; the compiler imports no model code).

* A tiny or local HF model is instantiated on torch's ``meta`` device (shapes only, no memory).
* The SmolLM2 GGUF's header is read by ``models/gguf_header.py`` (metadata and tensor shapes,
  memory-mapped, no tensor data, no array unpacked: milliseconds where ``gguf.GGUFReader`` took
  6.5 s to parse the tokenizer it carries).
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, cast

from flowrl.models.bundled import SMOLLM2, bundled_tokenizer_dir, smollm2_dir
from flowrl.models.gguf_header import GGUFArray, GGUFHeader, read_gguf_header

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelSize:
    """What the cost model knows about one model.

    Attributes:
        n_params: parameter count (tied embeddings counted once).
        n_layers, n_kv_heads, head_dim: attention shape, for the KV cache.
        dtype_bytes: bytes per parameter in the training dtype (``model.dtype``).
        hidden_size, n_heads, vocab_size, intermediate_size, tied_embeddings: the rest of the
            shape, for the cluster planner's FLOP and activation counts (0 / False where the
            source does not say).
        max_positions: the longest sequence the model takes (``max_position_embeddings``, a
            GGUF's ``context_length``): vLLM's ``max_model_len`` when none is set; 0 = unknown.
        trainable_params: the parameters an update trains when that is not all of them: a
            ``model.lora`` model's adapters and ``modules_to_save``
            (:func:`adapter_params`); 0 = every parameter.
    """

    n_params: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype_bytes: int = 4
    hidden_size: int = 0
    n_heads: int = 0
    vocab_size: int = 0
    intermediate_size: int = 0
    tied_embeddings: bool = False
    max_positions: int = 0
    trainable_params: int = 0

    @property
    def weight_bytes(self) -> int:
        return self.n_params * self.dtype_bytes

    def kv_bytes(self, tokens: int) -> int:
        """KV cache of ``tokens`` cached positions: 2 (K and V) × layers × kv_heads × head_dim ×
        tokens × dtype bytes."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * tokens * self.dtype_bytes


def gguf_missing(gguf_file: str, folder: "str | Path") -> str:
    """The message for a ``model.gguf_file`` that is not there: an absolute path is looked up as
    given (``folder / gguf_file`` is that path), a bare name in ``model.path``'s ``folder``."""
    if Path(gguf_file).is_absolute():
        return f"model.gguf_file {gguf_file!r} not found"
    return f"model.gguf_file {gguf_file!r} not found in {folder}"


def meta_model(config: Any) -> Any:
    """The model of an HF ``config`` on the ``meta`` device (shapes only: no allocation, no
    init cost): ``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for a
    vision-language config (one with a ``vision_config``: Qwen2-VL / Qwen2.5-VL, which no
    causal-LM class takes)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None \
        else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def text_config(config: Any) -> Any:
    """The language model's config: ``config.text_config`` of a vision-language config, else
    ``config`` itself (layers, heads and the KV cache are the language model's)."""
    return getattr(config, "text_config", None) or config


def attention_shape(config: Any) -> tuple[int, int, int]:
    """``(layers, KV heads, head dim)`` of an HF config's language model (what one token of the KV
    cache holds: 2 × layers × KV heads × head dim elements). ``num_key_value_heads`` absent = MHA
    (the query heads); ``head_dim`` absent = hidden size / heads.

    Raises:
        AttributeError / TypeError: a config without ``num_hidden_layers``,
            ``num_attention_heads`` or ``hidden_size``.
    """
    text = text_config(config)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    return int(text.num_hidden_layers), kv, head_dim


def _size_from_hf_config(config: Any, dtype_bytes: int) -> ModelSize:
    model = meta_model(config)
    n = sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once
    text = text_config(config)
    heads = text.num_attention_heads
    _, kv, head_dim = attention_shape(config)
    inter = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(text, "tie_word_embeddings", False)
    return ModelSize(int(n), text.num_hidden_layers, kv, head_dim, dtype_bytes,
                     hidden_size=text.hidden_size, n_heads=heads,
                     vocab_size=int(getattr(text, "vocab_size", 0) or 0),
                     intermediate_size=int(inter), tied_embeddings=bool(tied),
                     max_positions=int(getattr(text, "max_position_embeddings", 0) or 0))


def gguf_vocab_size(header: GGUFHeader, path: str) -> int:
    """Vocabulary size (rows of the token embedding = width of the logits) of the GGUF file
    ``path`` whose header is ``header`` (:func:`~flowrl.models.gguf_header.read_gguf_header`):
    ``<arch>.vocab_size`` when the file has it, else the length of its ``tokenizer.ggml.tokens``
    list (llama.cpp's own rule: neither key is required), else the ``token_embd.weight`` tensor's
    vocabulary dimension.

    Raises:
        ValueError: a file with none of the three.
    """
    fields = header.fields
    arch = fields["general.architecture"]
    if f"{arch}.vocab_size" in fields:
        return int(cast(int, fields[f"{arch}.vocab_size"]))
    tokens = fields.get("tokenizer.ggml.tokens")
    if isinstance(tokens, GGUFArray):
        return tokens.count
    # gguf lists a tensor's dims fastest first: token_embd.weight is [hidden, vocab]
    emb = header.tensors.get("token_embd.weight")
    if emb is None:
        raise ValueError(f"{path}: no {arch}.vocab_size, tokenizer.ggml.tokens or "
                         "token_embd.weight: cannot tell the vocabulary size")
    return int(emb[-1])


@lru_cache(maxsize=16)
def _gguf_size(path: str, dtype_bytes: int) -> ModelSize:
    header = read_gguf_header(path)
    arch = header.fields["general.architecture"]

    def meta(key: str) -> int:
        try:
            return int(cast(int, header.fields[f"{arch}.{key}"]))
        except KeyError:
            raise ValueError(f"{path}: GGUF metadata has no {arch}.{key}") from None

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    return ModelSize(header.n_elements(), meta("block_count"), meta("attention.head_count_kv"),
                     hidden // heads, dtype_bytes, hidden_size=hidden, n_heads=heads,
                     vocab_size=gguf_vocab_size(header, path),
                     intermediate_size=meta("feed_forward_length"),
                     tied_embeddings="output.weight" not in header.tensors,
                     max_positions=meta("context_length") if f"{arch}.context_length"
                     in header.fields else 0)


def model_size(cfg: Any) -> ModelSize:
    """ModelSize of a ``ModelConfig`` (its ``path``, ``gguf_file``, ``tiny``, ``dtype``) without
    loading weights (see the module docstring); once per model and process (a tiny or HF
    model's count builds it on the meta device: 1.8 s on the 2-core CPU, asked by the checks,
    the machine defaults and the run's plan in turn); an HF folder's ``config.json`` edited
    since is read again.

    Raises:
        FileNotFoundError: the SmolLM2 package or GGUF file is missing.
        ValueError: a GGUF file that does not tell its vocabulary size (:func:`gguf_vocab_size`).
    """
    tiny = None if cfg.tiny is None else json.dumps(cfg.tiny, sort_keys=True, default=str)
    stamp = None
    if cfg.tiny is None and cfg.gguf_file is None and cfg.path != SMOLLM2:
        try:
            stamp = (Path(cfg.path) / "config.json").stat().st_mtime_ns
        except OSError:
            stamp = None  # AutoConfig says what is missing
    lora = getattr(cfg, "lora", None)
    key = (str(cfg.path), cfg.gguf_file, tiny, cfg.dtype, stamp,
           None if lora is None else json.dumps(dataclasses.asdict(lora), sort_keys=True))
    if key not in _SIZES:
        if len(_SIZES) >= 16:  # a sweep over many models: the oldest goes
            _SIZES.pop(next(iter(_SIZES)))
        size = _read_model_size(cfg)
        if lora is not None:  # an update trains the adapters alone (their grads and moments)
            shape = {"vocab_size": size.vocab_size} if size.vocab_size else {}
            if cfg.gguf_file is not None:  # its architecture's defaults are another model's
                shape.update(hidden_size=size.hidden_size, num_attention_heads=size.n_heads,
                             num_key_value_heads=size.n_kv_heads,
                             intermediate_size=size.intermediate_size)
            size = dataclasses.replace(size, trainable_params=adapter_params(
                cfg, lora, size.n_layers, shape))
        _SIZES[key] = size
    return _SIZES[key]


_SIZES: dict[tuple, ModelSize] = {}  # model_size's, by (path, gguf_file, tiny, dtype, stamp, lora)


def max_positions(cfg: Any) -> int:
    """The longest sequence a ``ModelConfig``'s model takes (``max_position_embeddings``, of the
    language model's config for a VLM; a GGUF's ``context_length``), 0 when it does not say;
    read from the config alone (no meta model: :func:`model_size` counts parameters too).

    Raises:
        FileNotFoundError: the SmolLM2 package or GGUF file is missing.
    """
    if cfg.tiny is not None:
        tiny = dict(cfg.tiny)
        text = tiny.get("text_config")
        got = (text if isinstance(text, dict) else tiny).get("max_position_embeddings")
        if got is None:  # the model type's default
            from transformers import AutoConfig

            return int(getattr(text_config(AutoConfig.for_model(tiny["model_type"])),
                               "max_position_embeddings", 0) or 0)
        return int(got)
    folder = smollm2_dir() if cfg.path == SMOLLM2 else cfg.path
    if cfg.gguf_file is not None:
        f = Path(folder) / cfg.gguf_file
        if not f.is_file():
            raise FileNotFoundError(gguf_missing(cfg.gguf_file, folder))
        return _gguf_size(str(f), 4).max_positions
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return 0  # the model folder's own check says what is wrong with it
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return int(text.get("max_position_embeddings") or 0)


def _read_model_size(cfg: Any) -> ModelSize:
    nbytes = DTYPE_BYTES.get(cfg.dtype, 4)  # "auto" = fp32 master weights
    if cfg.tiny is not None:
        from transformers import AutoConfig

        tiny = copy.deepcopy(dict(cfg.tiny))  # transformers fills nested sections in place
        text = tiny.get("text_config")  # a vision-language tiny model (tiny_vl)
        if "vocab_size" not in (text if isinstance(text, dict) else tiny):
            # load_model takes it from the bundled tokenizer (a VLM's with its vision tokens
            # added, models/vision.build_tiny_vl): Qwen2-VL's own 152,064 made the plan's
            # tiny_vl about 3x the model the run builds (fresh-user report)
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(bundled_tokenizer_dir() / "tokenizer.json"))
            vocab = tok.get_vocab_size(with_added_tokens=True)
            if isinstance(text, dict):
                from flowrl.models.vision import VISION_TOKENS

                text = tiny["text_config"] = dict(text)
                text["vocab_size"] = vocab + sum(tok.token_to_id(t) is None for t in VISION_TOKENS)
                for name in ("bos_token_id", "eos_token_id"):  # Qwen2-VL's own ids lie past it
                    text.setdefault(name, None)
                vision = tiny["vision_config"] = dict(tiny.get("vision_config") or {})
                vision.setdefault("hidden_size" if tiny["model_type"] == "qwen2_vl"
                                  else "out_hidden_size", text.get("hidden_size", 64))
                tiny["vocab_size"] = text["vocab_size"]
            else:
                tiny["vocab_size"] = vocab
        for name in ("bos_token_id", "eos_token_id"):  # special ids do not change the size
            tiny.setdefault(name, None)
        return _size_from_hf_config(AutoConfig.for_model(tiny.pop("model_type"), **tiny), nbytes)
    folder = smollm2_dir() if cfg.path == SMOLLM2 else cfg.path
    if cfg.gguf_file is not None:
        f = Path(folder) / cfg.gguf_file
        if not f.is_file():
            raise FileNotFoundError(gguf_missing(cfg.gguf_file, folder))
        return _gguf_size(str(f), nbytes)
    from transformers import AutoConfig

    return _size_from_hf_config(AutoConfig.from_pretrained(str(folder)), nbytes)


# ------------------------------------------------------------------ LoRA shapes (no weights)
ALL_LINEAR = "all-linear"  # peft's name: every linear layer except the LM head


def _gguf_architecture(path: str) -> str:
    """``general.architecture`` from a GGUF header (``models/gguf_header.py``: no tensor read).

    Raises:
        ValueError: not a GGUF file, or one without the key."""
    arch = read_gguf_header(path).fields.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")
    return arch


def hf_config(model_cfg: Any):
    """The transformers config of ``model_cfg`` (tiny dict, HF dir, or a GGUF's architecture with
    default sizes: module *names* do not depend on sizes), without loading weights."""
    from transformers import AutoConfig

    if model_cfg.tiny is not None:
        tiny = copy.deepcopy(dict(model_cfg.tiny))  # transformers fills nested sections in place
        return AutoConfig.for_model(tiny.pop("model_type"), **tiny)
    folder = smollm2_dir() if model_cfg.path == SMOLLM2 else Path(model_cfg.path)
    if model_cfg.gguf_file is not None:
        arch = _gguf_architecture(str(folder / model_cfg.gguf_file))
        return AutoConfig.for_model(arch, num_hidden_layers=1)
    return AutoConfig.from_pretrained(str(folder))


def adapter_params(model_cfg: Any, lora: Any, n_layers: int,
                   shape: Optional[dict[str, int]] = None) -> int:
    """Parameters ``lora`` trains on ``model_cfg``'s model: ``rank · (in + out)`` per targeted
    linear module (every linear layer but the LM head for ``all-linear``, peft's rule) and every
    parameter of ``modules_to_save``, counted on a one-layer ``meta`` instance (no weights read)
    and multiplied by ``n_layers`` for a module inside the decoder layers. ``shape``: config sizes
    to build it with (a GGUF's, whose architecture's defaults are another model's).
    Hu et al. 2021 (LoRA), section 4."""
    import torch
    from torch import nn

    config = hf_config(model_cfg)
    for k, v in (shape or {}).items():
        setattr(text_config(config), k, v)
    text_config(config).num_hidden_layers = 1
    model = meta_model(config)
    out_layer = model.get_output_embeddings()
    total = 0
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        per_layer = ".layers.0." in f".{name}." or ".h.0." in f".{name}."
        times = n_layers if per_layer else 1
        if leaf in lora.modules_to_save or name in lora.modules_to_save:
            total += times * sum(p.numel() for p in module.parameters())
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or \
                isinstance(module, nn.Embedding) or module is out_layer:
            continue  # not a linear layer (peft's all-linear leaves the LM head out too)
        if lora.target_modules == [ALL_LINEAR] or leaf in lora.target_modules or \
                name in lora.target_modules:
            total += times * lora.rank * (weight.shape[0] + weight.shape[1])
    return total
