import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the dequantized-GGUF cache (model.gguf_cache) of a test session: never the user's ~/.cache, and
# shared by the session's tests (and their subprocesses) so SmolLM2 is dequantized once
if "FLOWRL_CACHE" not in os.environ:
    import tempfile

    os.environ["FLOWRL_CACHE"] = tempfile.mkdtemp(prefix="flowrl-test-cache-")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
