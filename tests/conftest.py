import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the dequantized-GGUF cache (model.gguf_cache) of a test session: never the user's ~/.cache, and
# shared by the session's tests (and their subprocesses) so SmolLM2 is dequantized once
# (removed when the session ends: each session's copy is ~0.5 GB, and seven left behind here with
# pytest's kept tmp_paths (pyproject.toml's tmp_path_retention_policy) filled the disk mid-CI)
_SESSION_CACHE: str | None = None
if "FLOWRL_CACHE" not in os.environ:
    import tempfile

    _SESSION_CACHE = os.environ["FLOWRL_CACHE"] = tempfile.mkdtemp(prefix="flowrl-test-cache-")


def pytest_sessionfinish(session, exitstatus):
    if _SESSION_CACHE is not None:
        import shutil

        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
