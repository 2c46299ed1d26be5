"""Datasets (bundled GSM8K, your own files), prompt rendering/collation, and the stateful prompt
sampler."""
from flowrl.data.arith import ArithConfig, load_arith
from flowrl.data.files import DataError
from flowrl.data.gsm8k import SPLITS, load_gsm8k, parse_ground_truth
from flowrl.data.prompts import (
                                 DATASETS,
                                 DEFAULT_INSTRUCTION,
                                 DataConfig,
                                 PromptBatch,
                                 PromptSource,
                                 build_messages,
                                 collate_prompts,
                                 load_records,
                                 record_messages,
                                 render_prompts,
)
from flowrl.data.sampler import PromptSampler

__all__ = ["ArithConfig", "DATASETS", "DEFAULT_INSTRUCTION", "DataConfig", "DataError", "PromptBatch",
           "PromptSampler", "PromptSource", "SPLITS", "build_messages", "collate_prompts",
           "load_arith", "load_gsm8k", "load_records", "parse_ground_truth", "record_messages", "render_prompts"]
