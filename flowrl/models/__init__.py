"""Model and tokenizer loading (SmolLM2 GGUF, local HF dirs, tiny random test models)."""
from flowrl.models.bundled import bundled_tokenizer_dir, smollm2_dir
from flowrl.models.loading import ModelConfig, load_model, load_tokenizer, tiny_model_config

__all__ = ["ModelConfig", "bundled_tokenizer_dir", "load_model", "load_tokenizer", "smollm2_dir",
           "tiny_model_config"]
