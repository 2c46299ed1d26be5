#!/usr/bin/env bash
# The distillation measurement on the lent GPU (issue 28): SmolLM2-135M-Instruct as the student,
# a GRPO-trained SmolLM2 checkpoint as the teacher, both from the same start.
#   (b) RL from the start = the teacher's own run: trainer=gsm8k_gpu (GRPO, 60 steps x 64 x 8),
#       exported with `flowrl export` as the teacher (an HF directory);
#   (a) on-policy distillation from the same start: graph=distill teacher.path=<that export>,
#       the same trainer recipe and steps;
#   (c) SFT on teacher samples: not measured (flowrl has no SFT graph).
# benchmarks/distill_report.py then writes $OUT/distill.md (+ .png, kept metrics): per-step
# accuracy / reward on each step's training prompts, the steps and wall time each run needs to
# reach 90% of the teacher's level, and the greedy eval of the whole test split before/after.
#
# Two device calls while the machine stays warm (runs and the export wait in /tmp), ~9 min each
# (start-up ~2 min with 4 vLLM engines, 60 steps x ~4.5 s, two full-split evals ~5 s each):
#   STAGE=teacher FLOWRL_COMMIT=<sha> bash scripts/device/distill_run.sh   # (b) + export
#   STAGE=distill FLOWRL_COMMIT=<sha> bash scripts/device/distill_run.sh   # (a) + the report
# An existing teacher export instead of (b): TEACHER=/path/to/hf STAGE=distill ... (the report
# then needs RL=<its RL run dir> for the teacher's curve). Extra arguments: flowrl train overrides
# for both runs (e.g. trainer.total_steps=40). TRAIN_TIMEOUT_S (default 520) cuts a run so that
# the call returns within 600 s; a cut run still has the checkpoint of trainer.save_every=10.
#
# Needs on the device what scripts/device/gsm8k_learning_run.sh needs (vLLM, hydra-core,
# omegaconf, gguf, math-verify on PYTHONPATH; the SmolLM2 GGUF joined by
# scripts/device/smollm2_pieces.sh into /tmp/smollm2_site). Checked before anything runs.
# Back here: cp -r <files_at>/distill* benchmarks/results/
set -uo pipefail
: "${OUT:?OUT must name the folder that comes back}"
STAGE=${STAGE:?STAGE must be teacher or distill}
RL=${RL:-/tmp/distill_rl_run}
DST=${DST:-/tmp/distill_run}
TEACHER=${TEACHER:-/tmp/distill_teacher_hf}
[ -d /tmp/smollm2_site ] && export PYTHONPATH=/tmp/smollm2_site:${PYTHONPATH:-}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false COLUMNS=200
python3 - <<'PY' || exit 3
import importlib.util, sys
missing = [m for m in ("vllm", "hydra", "omegaconf", "gguf", "math_verify")
           if importlib.util.find_spec(m) is None]
from flowrl.models.loading import SMOLLM2_GGUF, smollm2_dir
try:
    ok = (smollm2_dir() / SMOLLM2_GGUF).is_file()
except FileNotFoundError:
    ok = False
if missing or not ok:
    sys.exit(f"not ready: missing {missing or '-'}; SmolLM2 GGUF found: {ok}")
print("ready: vllm, hydra, gguf, math_verify and the SmolLM2 GGUF", flush=True)
PY
COMMON="trainer=gsm8k_gpu rollout=vllm trainer.device=cuda logger.progress=false trainer.save_every=10"

train() {  # train RUN_DIR overrides...: one flowrl train, cut at TRAIN_TIMEOUT_S
  local run=$1; shift
  rm -rf "$run" && mkdir -p "$run"
  local cmd="python3 -m flowrl.train $COMMON hydra.run.dir=$run $*"
  echo "$cmd" | tee "$run/command.txt"
  local t0=$SECONDS
  timeout -s INT -k 30 "${TRAIN_TIMEOUT_S:-520}" $cmd > "$run/console.log" 2>&1
  local rc=$?
  echo "flowrl train exit $rc after $((SECONDS - t0))s"
  grep -E "^(flowrl|eval|step +(0|[0-9]*0) )" "$run/console.log" | tail -n 20
  [ $rc -eq 0 ] || tail -n 40 "$run/console.log"
  return $rc
}

case "$STAGE" in
teacher)
  train "$RL" "$@"
  ckpt=$(ls -d "$RL"/checkpoints/step_* 2>/dev/null | sort | tail -n 1)
  [ -n "$ckpt" ] || { echo "no checkpoint in $RL"; exit 4; }
  rm -rf "$TEACHER"
  python3 -m flowrl.cli export "$ckpt" "$TEACHER" || exit 5
  echo "teacher: $ckpt -> $TEACHER"; ls "$TEACHER"
  ;;
distill)
  [ -f "$TEACHER/config.json" ] || { echo "no teacher export at $TEACHER: run STAGE=teacher first"; exit 4; }
  train "$DST" graph=distill "teacher.path=$TEACHER" "$@"
  rc=$?
  python3 benchmarks/distill_report.py --teacher "$RL" --run "distill=$DST" --run "rl=$RL" \
    --out-stem "$OUT/distill" --command "$(cat "$DST/command.txt") (teacher: $(cat "$RL/command.txt" 2>/dev/null))" \
    --commit "${FLOWRL_COMMIT:-?}"
  exit $rc
  ;;
*) echo "STAGE must be teacher or distill, got $STAGE"; exit 2 ;;
esac
