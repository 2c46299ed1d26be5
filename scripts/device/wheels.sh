#!/usr/bin/env bash
# Wheels the lent GPU machine lacks for flowrl + benchmarks/e2e_vs_trl.py + TRL 1.16 (Python 3.12,
# x86_64; that machine has no package registry). Run here, from the repo root, once:
#     bash scripts/device/wheels.sh            # -> .whl/ (git-ignored), ~2.5 MB, 10 wheels
# Then name ".whl" in the device call's carry and start its command with
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site:$PYTHONPATH
# (flowrl itself runs from the source tree: $PWD on PYTHONPATH, no install.) vLLM comes separately
# (../shared/tools/vllm-on-device.sh); SmolLM2's GGUF too (scripts/device/smollm2_pieces.sh).
#
# The GPU image already holds torch 2.11, transformers 5.17, accelerate, peft, pyarrow, pandas,
# numpy, rich, tensorboard, networkx, safetensors, pyyaml, psutil, tqdm, xxhash, fsspec,
# huggingface-hub, jinja2, packaging, requests, httpx, filelock, sympy, mpmath, nvidia-ml-py
# (.library/device/KINDS.md). The versions below are the ones the CPU venv tests run with;
# the script checks every wheel's Requires-Dist (no extras) against that image list + these wheels.
set -eu
PY=${PYTHON:-python3}
WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 trl==1.16.0 datasets==5.2.0
        dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0
        liger-kernel==0.8.5)
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file: ask git where it is
mkdir -p "$(dirname "$exclude")" && { grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"; }
rm -rf .whl && mkdir .whl
for spec in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d .whl "$spec" 2>/dev/null \
  || "$PY" -m pip wheel -q --no-deps -w .whl "$spec"  # sdist only (antlr4 4.9.3): a pure-Python wheel
done
"$PY" - <<'EOF'
import email, re, sys, zipfile
from pathlib import Path

IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer click cloudpickle cmake colorama contourpy coverage cycler
cython einops filelock fonttools frozenlist fsspec h11 h5py hf-xet httpcore httpx huggingface-hub
idna iniconfig jinja2 joblib kiwisolver lxml markdown markdown-it-py markupsafe matplotlib mdurl
mpmath msgpack multidict networkx ninja numpy nvidia-ml-py packaging pandas pathspec peft pillow pip
pluggy propcache protobuf psutil pyarrow pygments pyparsing pytest pytest-xdist python-dateutil
pyyaml regex requests rich safetensors scipy sentencepiece setuptools six sympy tabulate tensorboard
tiktoken tokenizers torch tqdm transformers triton typing-extensions urllib3 wheel xxhash yarl
zipp""".split())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wheels = sorted(Path(".whl").glob("*.whl"))
have = {norm(w.name.split("-")[0]) for w in wheels} | IMAGE
env = {"python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux",
       "implementation_name": "cpython", "platform_machine": "x86_64", "os_name": "posix"}
missing = {}
for w in wheels:
    meta = next(n for n in zipfile.ZipFile(w).namelist() if n.endswith(".dist-info/METADATA"))
    for req in email.message_from_bytes(zipfile.ZipFile(w).read(meta)).get_all("Requires-Dist") or []:
        name, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        try:  # packaging is in both images; markers like python_version < "3.9" drop out here
            from packaging.markers import Marker
            if marker.strip() and not Marker(marker).evaluate(env):
                continue
        except ImportError:
            pass
        dep = norm(re.split(r"[\s<>=!~(\[]", name.strip(), maxsplit=1)[0])
        if dep not in have:
            missing.setdefault(dep, []).append(w.name)
total = sum(w.stat().st_size for w in wheels)
print(f"{len(wheels)} wheels, {total / 2**20:.2f} MiB in .whl/")
for dep, by in sorted(missing.items()):
    print(f"MISSING on the GPU image: {dep} (required by {', '.join(by)})")
sys.exit(1 if missing else 0)
EOF
ls -la .whl
