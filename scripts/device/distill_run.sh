#!/usr/bin/env bash
# The distillation measurement on the lent GPU (issue 28), on the learnable task of issue 25
# (data=arith, trainer=arith_gpu: SmolLM2-135M-Instruct, full fine-tuning, held-out greedy eval of
# the 1,000-item test split every 10 steps). Three arms from the same start (the SmolLM2 GGUF):
#   (b) RL from the start: GRPO, trainer=arith_gpu for $STEPS steps; its last checkpoint is
#       exported with `flowrl export` as the teacher (an HF directory);
#   (a) on-policy distillation: graph=distill teacher.path=<that export> (per-token reverse KL);
#   (c) SFT on teacher samples: graph=sft_teacher teacher.path=<that export> (the teacher samples
#       each step's prompts, the student trains on the NLL of its tokens);
# each with the same trainer recipe and steps. benchmarks/distill_report.py then writes
# $OUT/distill.md + distill.png: held-out accuracy per eval step for the three arms, and the steps
# and the training / wall seconds each needs to reach 90% of the teacher's final held-out accuracy.
#
# Two device calls while the machine stays warm (runs and the export wait in /tmp):
#   STAGE=teacher FLOWRL_COMMIT=<sha> bash scripts/device/distill_run.sh  # (b) + export, ~6 min
#   STAGE=distill FLOWRL_COMMIT=<sha> bash scripts/device/distill_run.sh  # (a) + (c) side by side
#       on the one GPU (each rollout.vllm.gpu_memory_utilization=0.25, 2 engine processes per
#       vLLM engine; (c) has two: the student's and the teacher's), then the report, ~8 min
# STEPS (default 60) sets trainer.total_steps of every arm; extra arguments are flowrl train
# overrides for every arm. TRAIN_TIMEOUT_S (default 420; arm (c) starts 20 s after (a)) cuts a run
# so that the call returns within its 8 minutes; a cut run still reports the evals it reached
# (the teacher run checkpoints every 20 steps, so a cut one still exports).
# An existing teacher export instead of (b): TEACHER=/path/to/hf STAGE=distill ... (the report
# then needs RL=<its run dir> for the teacher's level and curve).
#
# Needs on the device what scripts/device/arith_learning_run.sh needs (vLLM, hydra-core,
# omegaconf, gguf on PYTHONPATH, as scripts/device/session.sh sets up; the SmolLM2 GGUF joined by
# scripts/device/smollm2_pieces.sh into /tmp/smollm2_site). Checked before anything runs.
# Back here: cp <files_at>/distill.md <files_at>/distill.png benchmarks/results/ (distill_runs.tgz:
# the three runs' metrics, plans and consoles; distill_teacher_run.tgz: the teacher run's)
# CPU dry run of the same path (a tiny student and its tiny RL-trained teacher, HF rollout, 2 steps):
#   OUT=/tmp/o DRY_CPU=1 STAGE=teacher bash scripts/device/distill_run.sh
#   OUT=/tmp/o DRY_CPU=1 STAGE=distill bash scripts/device/distill_run.sh
set -uo pipefail
: "${OUT:?OUT must name the folder that comes back}"
STAGE=${STAGE:?STAGE must be teacher or distill}
RUNS=${RUNS:-/tmp/distill_runs}
RL=${RL:-$RUNS/b_rl}
DST=$RUNS/a_distill
SFT=$RUNS/c_sft
TEACHER=${TEACHER:-$RUNS/teacher_hf}
py=${PYTHON:-python3}
[ -d /tmp/smollm2_site ] && export PYTHONPATH=/tmp/smollm2_site:${PYTHONPATH:-}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false COLUMNS=200
if [ -n "${DRY_CPU:-}" ]; then  # the same path on CPU in a few minutes: tiny models, HF rollout
  STEPS=${STEPS:-2}
  base=(trainer=arith_gpu rollout=hf trainer.device=cpu model=tiny trainer.prompts_per_step=2
        algorithm.n=2 trainer.eval.limit=8 trainer.eval.every=1 rollout.sampling.max_new_tokens=8
        trainer.eval.max_new_tokens=8)
  side=()
  need="hydra omegaconf"
else
  STEPS=${STEPS:-60}
  base=(trainer=arith_gpu rollout=vllm trainer.device=cuda)
  # two runs share the GPU (as session.sh's learning phase): a quarter of it for each vLLM
  # engine (their KV caches are fixed by trainer=arith_gpu), 2 engine processes each
  side=(rollout.vllm.gpu_memory_utilization=0.25 rollout.vllm.engine_procs=2)
  need="vllm hydra omegaconf gguf"
fi
NEED="$need" DRY="${DRY_CPU:-}" $py scripts/device/check_ready.py || exit 3

train() {  # train RUN_DIR TIMEOUT_S overrides...: one flowrl train, cut at TIMEOUT_S (Ctrl-C)
  local run=$1 limit=$2; shift 2
  rm -rf "$run" && mkdir -p "$run"
  # later overrides win (Hydra): the caller's come last
  local cmd="$py -m flowrl.train ${base[*]} trainer.total_steps=$STEPS logger.progress=false hydra.run.dir=$run $*"
  echo "$cmd" > "$run/command.txt"
  echo "${FLOWRL_COMMIT:-?}" > "$run/commit.txt"
  local t0=$SECONDS
  timeout -s INT -k 30 "$limit" $cmd > "$run/console.log" 2>&1
  local rc=$?
  echo "$((SECONDS - t0)) (exit $rc)" > "$run/wall_s.txt"
  echo "[$(basename "$run")] flowrl train exit $rc after $((SECONDS - t0))s: $cmd"
  grep -E "^(flowrl|eval|machine)" "$run/console.log" | tail -n 12 | sed "s|^|[$(basename "$run")] |"
  [ $rc -eq 0 ] || tail -n 40 "$run/console.log" | sed "s|^|[$(basename "$run")] |"
  return $rc
}

mkdir -p "$RUNS" "$OUT"
case "$STAGE" in
teacher)
  # a checkpoint every 20 steps (keep_last 1): a run cut by the timeout still leaves a teacher
  train "$RL" "${TRAIN_TIMEOUT_S:-420}" trainer.save_every=20 "$@"
  rc=$?
  ckpt=$(ls -d "$RL"/checkpoints/step_* 2>/dev/null | sort | tail -n 1)
  [ -n "$ckpt" ] || { echo "no checkpoint in $RL"; exit 4; }
  rm -rf "$TEACHER"
  $py -m flowrl.cli export "$ckpt" "$TEACHER" || exit 5
  echo "teacher: $ckpt -> $TEACHER"; ls "$TEACHER"
  # what comes back: the teacher run's metrics and console (the export stays in the device's /tmp)
  (cd "$RUNS" && tar czf "$OUT/distill_teacher_run.tgz" --exclude=checkpoints "$(basename "$RL")")
  exit $rc
  ;;
distill)
  [ -f "$TEACHER/config.json" ] || { echo "no teacher export at $TEACHER: run STAGE=teacher first"; exit 4; }
  limit=${TRAIN_TIMEOUT_S:-420}
  # (a) and (c) side by side from the same base; the second starts once the first's engines
  # have profiled the device (as session.sh's learning phase)
  train "$DST" "$limit" graph=distill "teacher.path=$TEACHER" "${side[@]}" "$@" > "$RUNS/a_distill.log" 2>&1 &
  a=$!
  [ -n "${DRY_CPU:-}" ] || sleep 20
  train "$SFT" "$limit" graph=sft_teacher "teacher.path=$TEACHER" "${side[@]}" "$@" > "$RUNS/c_sft.log" 2>&1 &
  c=$!
  wait $a; rc_a=$?
  wait $c; rc_c=$?
  cat "$RUNS/a_distill.log" "$RUNS/c_sft.log"
  rm -rf "$RUNS/report" && mkdir -p "$RUNS/report"
  $py benchmarks/distill_report.py --teacher "$RL" --run "a_distill=$DST" --run "c_sft=$SFT" \
    --run "b_rl=$RL" --out-stem "$RUNS/report/distill" --commit "${FLOWRL_COMMIT:-?}" \
    --command "STAGE=teacher|distill STEPS=$STEPS bash scripts/device/distill_run.sh $*" || exit 6
  # $OUT brings back a few files: the report, its PNG, and the kept runs + consoles as one archive
  cp "$RUNS"/report/distill.md "$OUT/"; cp "$RUNS"/report/distill.png "$OUT/" 2>/dev/null
  (cd "$RUNS" && tar czf "$OUT/distill_runs.tgz" report ./*.log ./*/console.log)
  [ $rc_a -eq 0 ] && [ $rc_c -eq 0 ] || exit 7
  ;;
*) echo "STAGE must be teacher or distill, got $STAGE"; exit 2 ;;
esac
