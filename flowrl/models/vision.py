"""Vision-language policies (Qwen2-VL / Qwen2.5-VL): which model configs are VLMs, their
tokenizer and image processor, the tiny random one for tests (``model=tiny_vl``) and the frozen
vision tower (``model.freeze_vision``).

A local directory (``model.path``) brings its own tokenizer, chat template and image processor
(``preprocessor_config.json``). The tiny model has none on disk, so they are built here: the
bundled SmolLM2 tokenizer plus the four Qwen2-VL vision tokens and a Qwen2-VL-style ChatML
template (``assets/vl_chat_template.jinja``), and a ``Qwen2VLImageProcessorPil`` (no torchvision
needed) sized so a 56x56 image is a 4x4 patch grid (4 image tokens after the 2x2 merge).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from flowrl.models.loading import ModelConfig

# the Qwen2-VL family's vision tokens (flowrl.data.images names the image one: the two layers
# import nothing of each other)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
CHAT_TEMPLATE = Path(__file__).parent / "assets" / "vl_chat_template.jinja"
# the tiny model's image processor: 14-pixel patches, 2x2 merge, images resized into
# [min, max] pixels (56x56 = 16 patches = 4 image tokens)
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 56 * 56, 112 * 112


def tiny_vl_config() -> dict[str, Any]:
    """``model.tiny`` of ``model=tiny_vl``: a 2-layer Qwen2-VL text model (hidden 64, 4 heads,
    2 KV heads, M-RoPE sections 2/3/3 of head dim 16) and a 1-block vision tower (width 32)."""
    return {"model_type": "qwen2_vl",
            "text_config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "intermediate_size": 128,
                            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
            "vision_config": {"depth": 1, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2,
                              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                              "in_channels": 3}}


def is_vision_config(cfg: "ModelConfig") -> bool:
    """True when ``cfg`` describes a vision-language model: a tiny config or a ``model.path``
    whose ``config.json`` has a :data:`VL_MODEL_TYPES` type (read without loading anything)."""
    if cfg.tiny is not None:
        return cfg.tiny.get("model_type") in VL_MODEL_TYPES
    conf = Path(cfg.path) / "config.json"
    if not conf.is_file():
        return False
    try:
        return json.loads(conf.read_text()).get("model_type") in VL_MODEL_TYPES
    except (OSError, ValueError):
        return False


def add_vision_tokens(tok: "PreTrainedTokenizerBase") -> "PreTrainedTokenizerBase":
    """The tiny VLM's tokenizer: ``tok`` plus the Qwen2-VL vision tokens and the VL template."""
    missing = [t for t in VISION_TOKENS if t not in tok.get_vocab()]
    if missing:
        tok.add_special_tokens({"additional_special_tokens": missing},
                               replace_extra_special_tokens=False)
    tok.chat_template = CHAT_TEMPLATE.read_text()
    return tok


def image_processor(cfg: "ModelConfig") -> Any:
    """The model's image processor: a directory's own (``AutoImageProcessor``, the PIL backend
    when torchvision is missing), the tiny model's ``Qwen2VLImageProcessorPil``."""
    if cfg.tiny is not None:
        try:  # transformers >= 5.2x: the PIL backend, no torchvision needed
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
                Qwen2VLImageProcessorPil as Processor,
            )
        except ImportError:  # older: the one class (torchvision where the lead's GPU image has it)
            from transformers import Qwen2VLImageProcessor as Processor  # type: ignore[assignment]
        return Processor(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS,
                         patch_size=14, merge_size=2, temporal_patch_size=2)
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(cfg.path)


def vision_token_ids(model: Any) -> list[int]:
    """Ids of the vision special tokens of a VLM's config (image, video, vision start/end): a
    response must never carry one (the trainer's forward would read it as an image slot)."""
    c = getattr(model, "config", None)
    ids = [getattr(c, k, None) for k in ("image_token_id", "video_token_id",
                                         "vision_start_token_id", "vision_end_token_id")]
    return [int(i) for i in ids if i is not None]


def build_tiny_vl(cfg: "ModelConfig", tok: "PreTrainedTokenizerBase", dtype: "torch.dtype",
                  device: "torch.device") -> "PreTrainedModel":
    """Random-init Qwen2-VL / Qwen2.5-VL from ``cfg.tiny`` (its text and vision sections), with
    the tokenizer's vocabulary and vision token ids, seeded by ``cfg.seed`` without touching the
    global RNG. The vision tower's output width is the text hidden size."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    tiny = json.loads(json.dumps(cfg.tiny))  # a deep, plain copy
    model_type = tiny.pop("model_type")
    text = dict(tiny.pop("text_config", {}))
    vision = dict(tiny.pop("vision_config", {}))
    text.setdefault("vocab_size", len(tok))
    vision.setdefault("hidden_size" if model_type == "qwen2_vl" else "out_hidden_size",
                      text.get("hidden_size", 64))
    ids = {k: int(cast(int, tok.convert_tokens_to_ids(t))) for k, t in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
        VISION_TOKENS)}
    special = {k: getattr(tok, k) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
    text.update({k: v for k, v in special.items() if k not in text})
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision,
                                  vocab_size=text["vocab_size"], **ids, **special, **tiny)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(cfg.seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype,
                                                        attn_implementation=cfg.attn)
    return model


def freeze_vision_tower(model: Any) -> int:
    """``requires_grad`` off for the vision tower (``model.model.visual``), so the optimizer
    trains the language model and the merger's projection is frozen with it. Returns the number
    of frozen parameters (0 when the model has no vision tower)."""
    visual = getattr(getattr(model, "model", None), "visual", None)
    if visual is None:
        return 0
    visual.requires_grad_(False)
    return sum(p.numel() for p in visual.parameters())
