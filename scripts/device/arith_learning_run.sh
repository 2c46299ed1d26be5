#!/usr/bin/env bash
# The arith learning run on the lent GPU (issue 25): `flowrl train trainer=arith_gpu rollout=vllm`
# (conf/trainer/arith_gpu.yaml: GRPO on data=arith, 100 steps, held-out eval of 1,000 items before,
# after and every 10 steps), full fine-tuning or LoRA, one variant per device call (~7 min each);
# then benchmarks/arith_learning.py writes benchmarks/results/learning_h200.md + .png under $OUT
# from every run kept so far. The checkpoint stays in the device's /tmp.
#
#   FLOWRL_COMMIT=<sha> bash scripts/device/arith_learning_run.sh full [extra flowrl train overrides]
#   FLOWRL_COMMIT=<sha> bash scripts/device/arith_learning_run.sh lora [extra overrides]
#   (lora = +model.lora.rank=16 +model.lora.alpha=32 trainer.engine.lr=1e-4: adapters take a ~10x
#   larger lr than full fine-tuning; TRAIN_TIMEOUT_S=540 cuts the training; RUNS=/tmp/arith_runs)
#
# Needs on the device what scripts/device/gsm8k_learning_run.sh needs (vLLM on PYTHONPATH, the
# hydra-core/omegaconf/antlr4/gguf/math-verify wheels, the SmolLM2 GGUF joined by
# scripts/device/smollm2_pieces.sh into /tmp/smollm2_site), plus peft for `lora`; checked first.
# Back here: cp -r <files_at>/learning_h200* benchmarks/results/
# CPU dry run of the path (a tiny model, 2 steps, no vLLM):
#   OUT=/tmp/o DRY_CPU=1 bash scripts/device/arith_learning_run.sh full
set -uo pipefail
: "${OUT:?OUT must name the folder that comes back}"
variant=${1:?usage: arith_learning_run.sh full|lora [overrides]}
shift
RUNS=${RUNS:-/tmp/arith_runs}
RUN=$RUNS/$variant
py=${PYTHON:-python3}
[ -d /tmp/smollm2_site ] && export PYTHONPATH=/tmp/smollm2_site:${PYTHONPATH:-}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false COLUMNS=200
case "$variant" in
full) extra=() ;;
lora) extra=(+model.lora.rank=16 +model.lora.alpha=32 trainer.engine.lr=1.0e-4) ;;
*) echo "variant must be full or lora, got '$variant'"; exit 2 ;;
esac
if [ -n "${DRY_CPU:-}" ]; then  # the same path on CPU in a minute: tiny model, HF rollout
  base=(trainer=arith_gpu rollout=hf trainer.device=cpu model=tiny trainer.total_steps=2
        trainer.prompts_per_step=2 algorithm.n=2 trainer.eval.limit=8 trainer.eval.every=1
        rollout.sampling.max_new_tokens=8 trainer.eval.max_new_tokens=8)
  need="hydra omegaconf"
else
  base=(trainer=arith_gpu rollout=vllm trainer.device=cuda)
  need="vllm hydra omegaconf gguf"
fi
[ "$variant" = lora ] && need="$need peft"
NEED="$need" DRY="${DRY_CPU:-}" $py scripts/device/check_ready.py || exit 3
rm -rf "$RUN" && mkdir -p "$RUN"
# later overrides win (Hydra): the caller's come last
CMD="$py -m flowrl.train ${base[*]} ${extra[*]} logger.progress=false hydra.run.dir=$RUN $*"
echo "$CMD"
t0=$SECONDS
# cut at TRAIN_TIMEOUT_S (Ctrl-C: engines close) so the report still comes back within one call's
# 600 s; a cut run reports its steps and the evals it reached, from metrics.jsonl
timeout -s INT -k 30 "${TRAIN_TIMEOUT_S:-540}" $CMD > "$RUN/console.log" 2>&1
rc=$?
wall=$((SECONDS - t0))
echo "flowrl train exit $rc after ${wall}s"
grep -E "^(flowrl|eval|machine)" "$RUN/console.log" | tail -n 20
[ $rc -eq 0 ] || tail -n 60 "$RUN/console.log"
echo "$CMD" > "$RUN/command.txt"
echo "$wall (exit $rc)" > "$RUN/wall_s.txt"
echo "${FLOWRL_COMMIT:-?}" > "$RUN/commit.txt"
runs=()
for v in full lora; do [ -f "$RUNS/$v/metrics.jsonl" ] && runs+=("$v=$RUNS/$v"); done
$py benchmarks/arith_learning.py "${runs[@]}" --out-stem "$OUT/learning_h200"
exit $rc
