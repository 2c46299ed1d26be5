"""Before a device run script (arith_learning_run.sh, distill_run.sh) starts anything: are the
modules it needs importable and, unless it is a CPU dry run, is the SmolLM2 GGUF joined?

    NEED="vllm hydra omegaconf gguf" DRY="" python3 scripts/device/check_ready.py || exit 3

Exits non-zero with one line naming what is missing; warns when matplotlib (the report's PNG) is.
"""
import importlib.util
import os
import sys

need = os.environ.get("NEED", "").split()
dry = bool(os.environ.get("DRY"))
missing = [m for m in need if importlib.util.find_spec(m) is None]
if importlib.util.find_spec("matplotlib") is None:
    print("warning: no matplotlib: the report will have no PNG", flush=True)
ok = True
if not dry:
    from flowrl.models.loading import SMOLLM2_GGUF, smollm2_dir

    try:
        ok = (smollm2_dir() / SMOLLM2_GGUF).is_file()
    except FileNotFoundError:
        ok = False
if missing or not ok:
    sys.exit(f"not ready: missing {missing or '-'}; SmolLM2 GGUF found: {ok}")
print("ready:", " ".join(need), "" if dry else "and the SmolLM2 GGUF", flush=True)
