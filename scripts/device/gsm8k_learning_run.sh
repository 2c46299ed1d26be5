#!/usr/bin/env bash
# The GSM8K learning run on the lent GPU (issue 12): `flowrl train trainer=gsm8k_gpu rollout=vllm`
# (conf/trainer/gsm8k_gpu.yaml), then benchmarks/gsm8k_learning.py writes the report, the PNG and the
# kept run files under $OUT. The checkpoint stays in the device's /tmp (1.6 GB cannot come back).
#
#   FLOWRL_COMMIT=<sha> bash scripts/device/gsm8k_learning_run.sh [extra flowrl train overrides]
#   (TRAIN_TIMEOUT_S=540: the training is cut there; RUN=/tmp/gsm8k_gpu_run: its directory;
#    BASE="trainer=gsm8k_gpu": the job's config options; STEM=gsm8k_smollm2_gpu: the report's name)
#
# Needs on the device: vLLM (../shared/tools/vllm-on-device.sh: PYTHONPATH=/tmp/vsite), the wheels of
# hydra-core, omegaconf, antlr4-python3-runtime, gguf, math-verify, latex2sympy2_extended on
# PYTHONPATH, and the SmolLM2 GGUF joined by scripts/device/smollm2_pieces.sh (/tmp/smollm2_site,
# added to PYTHONPATH here). Everything is checked before the run starts.
# Back here: cp -r <files_at>/gsm8k_smollm2_gpu* benchmarks/results/
set -uo pipefail
: "${OUT:?OUT must name the folder that comes back}"
RUN=${RUN:-/tmp/gsm8k_gpu_run}
[ -d /tmp/smollm2_site ] && export PYTHONPATH=/tmp/smollm2_site:${PYTHONPATH:-}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false COLUMNS=200  # no wrapped step lines
NEED="vllm hydra omegaconf gguf math_verify" DRY=${DRY_CPU:-} python3 scripts/device/check_ready.py || exit 3
rm -rf "$RUN" && mkdir -p "$RUN"
# later overrides win (Hydra): a CPU dry run appends trainer.device=cpu and smaller sizes
CMD="python3 -m flowrl.train ${BASE:-trainer=gsm8k_gpu} rollout=vllm trainer.device=cuda logger.progress=false hydra.run.dir=$RUN $*"
echo "$CMD"
t0=$SECONDS
# cut at TRAIN_TIMEOUT_S (Ctrl-C: engines close) so the report still comes back within one call's
# 600 s; a cut run reports its steps and the eval before, from metrics.jsonl
timeout -s INT -k 30 "${TRAIN_TIMEOUT_S:-540}" $CMD > "$RUN/console.log" 2>&1
rc=$?
wall=$((SECONDS - t0))
echo "flowrl train exit $rc after ${wall}s"
grep -E "^(flowrl|eval|step +(0|[0-9]*0) )" "$RUN/console.log" | tail -n 20
[ $rc -eq 0 ] || tail -n 60 "$RUN/console.log"
python3 benchmarks/gsm8k_learning.py "$RUN" --out-stem "$OUT/${STEM:-gsm8k_smollm2_gpu}" --command "$CMD" \
  --commit "${FLOWRL_COMMIT:-?}" --wall-s "$wall (exit $rc)"
exit $rc
