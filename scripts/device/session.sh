#!/usr/bin/env bash
# One lease of the lent H200, phase by phase: each device call runs one phase (the machine is given
# back 30 s after a call, so the calls go in a row, prepared here). Everything installed lives in
# the device's /tmp while the machine stays warm.
#
# Here, once: ../shared/tools/vllm-on-device.sh prepare; OUT=. bash scripts/device/session.sh repiece;
#             bash scripts/device/wheels.sh;
#             bash scripts/device/smollm2_pieces.sh split 3  (the tree is ~19 MiB: 3 pieces fit the 64 MiB)
# Device calls, in a row:
#   carry [".vllm/p1"]:           bash scripts/device/session.sh piece p1
#   carry [".vllm/p2"]:           bash scripts/device/session.sh piece p2
#   carry [".vllm/p3"]:           bash scripts/device/session.sh piece p3
#   carry [".vllm/p4", ".whl"]:   bash scripts/device/session.sh piece p4
#   carry [".vllm/p6"]:           bash scripts/device/session.sh piece p6   (the tree is ~22 MiB: vLLM in 4 pieces of 30 MB, see below)
#   carry [".model/a"]:           bash scripts/device/session.sh model a
#   carry [".model/b"]:           bash scripts/device/session.sh model b
#   carry [".model/c"]:           bash scripts/device/session.sh model c    (the last piece joins)
#   carry [".vllm/p5"]:           bash scripts/device/session.sh install first_step
#   carry [".flowrl_commit"]:     bash scripts/device/session.sh <phase> [<phase> ...]
#   (.flowrl_commit: `git rev-parse --short HEAD > .flowrl_commit` here first; git-ignored, so it
#   travels only when carried; the device copy's .git is stale and reports an old commit)
# Phases: first_step, learning, e2e, tier, vlm, nan, hfgen, distill_teacher, distill_arms, gsm8k_mv,
# tools, sync, lora_sync, neighbours, profile_vllm, profile_hf, profile_solo, sdpa, shapes, rollout_lp, gpu_new, e2e_mps,
# first_step_ab, startup_profile, decode_ab (see each below);
# `a+b` runs phases a and b side by side (e.g. tier+vlm: a learning or tier run beside another). Results land in $OUT.
# X="<flowrl overrides>" is appended to every flowrl run of a phase (e.g. a fallback setting).
# Next lease (issue 24). Last GPU runs (2026-12-07 09:37-09:54, an H100, bcc9a72): e2e 2.07x (0.5B)
# / 1.32x (SmolLM2), the 1.5B pair OOMed (both processes resident need ~108 GiB: the suite now
# skips it on a smaller card), GPU tier green (55 passed), first step 32.8 s (warm vLLM, cold GGUF
# cache). The day's third session got no machine (13 refused starts). Not run on a GPU yet:
# engine processes that import vLLM's engine before their build request (c37c84f); checkpoints'
# CRC-32; launcher.mps=auto deciding without nvidia-smi for the default job; the e2e report's
# flowrl start-up lines (where a 4-engine build's 75-154 s go) and this phase's console archive.
# 2026-12-07 19:05-22:05: no machine (eight refused starts, 1,096 s, then loans paused); nothing
# above was run. 2026-12-07 22:32-01:32: no machine either (nine refused starts, 1,081 s; the tool's
# none_now said neighbouring sessions got none too). Short of device time (< ~900 s), the tier needs no model pieces (its tests use
# tiny models and the bundled tokenizer): p1 p2 p3 p4 p6, then carry [".vllm/p5", ".flowrl_commit"]:
#   BYTE_COMPILE=0 TIER_TIMEOUT_S=300 HFGEN_ARGS="--variants trl,flowrl_liger,flowrl_liger_compile" \
#       ... install tier hfgen   (~8.5 min: the GPU tier at the commit, then the compiled HF decode)
# In this order (an H200 if offered: the 1.5B pair needs its memory):
#   pieces p1-p4 and p6, model a-c, then carry [".vllm/p5", ".flowrl_commit"]:
#   FIRST_STEP_ROUNDS=1 ... install first_step   (~1.5 min: a cold first step on the fresh machine;
#       estimated ~40 s against b1cbc10's 49.3 s, first_step_h200.md)
#   TIER_TIMEOUT_S=420 ... tier   (~4 min: the whole tests/gpu folder)
#   E2E_ARGS="--models qwen05b,smollm2 --rollout vllm" X="rollout.vllm.gpu_memory_utilization=0.2" ... e2e
#       (~8.5 min: the report's "flowrl start-up (its log)" lines say where the engine build goes)
#   on an H200: E2E_TAG=_qwen15b E2E_ARGS="--model qwen15b --rollout vllm" X="rollout.vllm.gpu_memory_utilization=0.2" ... e2e
#   FIRST_STEP_VARIANTS=default,v1runner FIRST_STEP_ROUNDS=1 ... first_step_ab   (the V2 runner's
#       10.9 s warmup JIT of a cold start against the V1 runner), then decode_ab (their decode speed)
#   E2E_TAG=_procs2 E2E_ARGS="--model qwen05b --rollout vllm" X="rollout.vllm.engine_procs=2 rollout.vllm.gpu_memory_utilization=0.2" ... e2e
#       (~4 min: under MPS, do 2 engines generate as fast as 4 with half the host RSS? 1.06x TRL now)
#   carry [".whl", ".flowrl_commit"]: HFGEN_ARGS="--variants trl,flowrl_liger,flowrl_liger_compile" \
#       ... wheels hfgen   (~2 min, no vLLM: does the compiled HF decode run at its 24.3k tok/s inside the
#       loop now that it decodes through eager_kernels (f01c58a)? liger inside it: 7 graph breaks, 1.31x
#       TRL's eager time, hf_generate_compile_h100.md; if so, rollout.hf.compile=null -> on for long
#       CUDA jobs and the e2e HF pair again: 0.77x TRL with it off)
# A start that fails costs 1.5-3 min of the 30: on 2026-12-07 nine of ten did, and the
# 2026-12-07 evening session's first try cost 180 s; plan for less.
# Short of device time and without vLLM: carry [".whl", ".flowrl_commit"]:
#   TIER_K="not vllm" TIER_TIMEOUT_S=200 bash scripts/device/session.sh wheels tier   (the HF half of the tier)
set -uo pipefail
: "${OUT:?OUT must name the folder that comes back}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false COLUMNS=200 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:/tmp/vsite:/tmp/site:/tmp/smollm2_site${PYTHONPATH:+:$PYTHONPATH}
COMMIT=$(cat .flowrl_commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo "?")
export FLOWRL_COMMIT=$COMMIT  # benchmarks/_common.git_revision reads it (the device .git is stale)
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
install_wheels() {  # <dir>: its wheels of scripts/device/wheels.sh into /tmp/site (on PYTHONPATH)
  mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site "$1"/*.whl 2>&1 | grep -v WARNING
}

phase_first_step() {  # ~3 min: the default job twice: cold (fresh machine), then warm (GGUF + vLLM compile caches)
  python3 benchmarks/first_step.py --variants ${FIRST_STEP_VARIANTS:-default} --rounds ${FIRST_STEP_ROUNDS:-2} --timeout-s 200 \
    --md-out "$OUT/first_step_h200.md" --log-dir "$OUT/first_step_logs" -- ${X:-}
}
phase_first_step_ab() {  # ~7 min: cold starts again and again on one machine (--fresh-caches: empty
  # compile caches per run, the page cache dropped where allowed): the default job against vLLM's
  # V1 model runner (the V2 runner's Triton JIT took 16.3 s of a cold H100 start at a033fa5) and
  # against liger on (auto leaves it off for the default job since 2026-12-06's second stop)
  python3 benchmarks/first_step.py --variants ${FIRST_STEP_VARIANTS:-default,v1runner,liger} --rounds ${FIRST_STEP_ROUNDS:-2} \
    --fresh-caches --timeout-s 150 --md-out "$OUT/first_step_ab_h200.md" --log-dir "$OUT/first_step_ab_logs" -- ${X:-}
}
phase_startup_profile() {  # ~1 min: where the default job's seconds before the model load go (the
  # H200 at ce93b88, warm: machine defaults 6.3 s and machine check 10.2 s of a 34.6 s step 1):
  # Python's import times twice (cold, then warm), then a cProfile of prepare + the machine check
  local code='import time, flowrl.train as t; t0 = time.perf_counter(); s = t.prepare([]); t1 = time.perf_counter(); t.check_machine(s.config); print(f"prepare {t1 - t0:.2f} s, check {time.perf_counter() - t1:.2f} s; parts", s.startup)'
  for r in 1 2; do
    python3 -X importtime -c "$code" 2> "$OUT/importtime_r$r.txt" | tail -n 1
    sort -t'|' -k2 -n -r "$OUT/importtime_r$r.txt" | head -n 25
  done
  printf '%s\n' "$code" > /tmp/startup_code.py
  python3 -m cProfile -s cumulative /tmp/startup_code.py > "$OUT/prepare_profile.txt" 2>&1
  grep -v "^$" "$OUT/prepare_profile.txt" | head -n 70
}
phase_learning() {  # ~9 min: the arith task, full fine-tuning and LoRA side by side (and the tier)
  # two runs share the GPU: half the default vLLM budget each (their KV caches are fixed anyway)
  local mem=rollout.vllm.gpu_memory_utilization=0.25
  rm -rf /tmp/learn_out && mkdir -p /tmp/learn_out
  OUT=/tmp/learn_out TRAIN_TIMEOUT_S=${TRAIN_TIMEOUT_S:-500} FLOWRL_COMMIT=$COMMIT \
    bash scripts/device/arith_learning_run.sh full $mem ${X:-} > "$OUT/learning_full.log" 2>&1 &
  local a=$!
  sleep 20  # the second run's engines start after the first's have profiled
  OUT=/tmp/learn_out TRAIN_TIMEOUT_S=${TRAIN_TIMEOUT_S:-480} FLOWRL_COMMIT=$COMMIT \
    bash scripts/device/arith_learning_run.sh lora $mem ${X:-} > "$OUT/learning_lora.log" 2>&1 &
  local b=$!
  if [ -n "${WITH_TIER:-}" ]; then TIER_N=4 phase_tier; fi
  wait $a; wait $b
  tail -n 25 "$OUT/learning_full.log" "$OUT/learning_lora.log"
  # $OUT brings back at most 8 files: the report's kept runs and the consoles as one archive
  cp /tmp/learn_out/learning_h200.md /tmp/learn_out/learning_h200.png "$OUT/" 2>/dev/null
  (cd /tmp && tar czf "$OUT/learning_runs.tgz" learn_out arith_runs/*/console.log 2>/dev/null)
}
phase_e2e() {  # ~6 min a model: flowrl vs TRL, interleaved rounds (E2E_ARGS --child-timeout >= the pair's --plan seconds: 240 s killed flowrl at 3c9da7b)
  # E2E_TAG names this call's files (two e2e phases in one call keep both)
  # the whole console comes back gzipped (the call's reply keeps its last 12,000 characters): the
  # children's start-up lines say where an engine build's seconds went
  python3 benchmarks/e2e_vs_trl.py --suite gpu ${E2E_ARGS:-} --out "$OUT/e2e_vs_trl_h200${E2E_TAG:-}.md" \
    --json-out "$OUT/e2e_vs_trl_h200${E2E_TAG:-}.json" ${X:-} 2>&1 | tee /tmp/e2e${E2E_TAG:-}.log
  local rc=${PIPESTATUS[0]}
  gzip -c /tmp/e2e${E2E_TAG:-}.log > "$OUT/e2e_console${E2E_TAG:-}.log.gz"
  return $rc
}
phase_e2e_mps() {  # ~4.5 min: phase e2e under CUDA MPS, for the overlap (X="placement.staleness=1"): on
  # af80c05 vLLM's engine processes and the trainer, separate CUDA contexts, took the H100 in turns
  # (the update 2.3x slower beside a rollout); MPS lets their kernels run at once. Both frameworks
  # of the pair run under it.
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  command -v nvidia-cuda-mps-control >/dev/null || { log "no nvidia-cuda-mps-control here"; return 3; }
  nvidia-cuda-mps-control -d || { log "MPS would not start"; return 3; }
  E2E_TAG=${E2E_TAG:-_mps} phase_e2e; local rc=$?
  echo quit | nvidia-cuda-mps-control
  return $rc
}
phase_hfgen() {  # ~3 min: flowrl's HF generate vs TRL's call (issue 24's 7.51 vs 6.88 s);
  # HFGEN_ARGS="--variants trl,flowrl_liger,flowrl_liger_fused --max-new-tokens 64": ~1 min, liger in the decode or not
  timeout -k 10 400 python3 benchmarks/hf_generate_check.py ${HFGEN_ARGS:-} --out "$OUT/hf_generate.md"
}
phase_gpu_new() {  # ~1 min: the GPU tests of what changed since the last full tier (GPU_NEW_K: -k)
  timeout -k 10 ${GPU_NEW_TIMEOUT_S:-200} python3 -m pytest -m gpu ${GPU_NEW_FILES:-tests/gpu/test_overlap_gpu.py} \
    ${GPU_NEW_K:+-k "$GPU_NEW_K"} -p no:cacheprovider -q -rA \
    2>&1 | tee "$OUT/gpu_new.log" | tail -n 25
}
phase_nan() {  # ~1 min: issue 25's NaN hypothesis, empty attention rows vs left-aligned rows
  timeout -k 10 300 python3 benchmarks/nan_layout_check.py --md-out "$OUT/nan_layout_h200.md"
}
phase_vlm() {  # ~5-6 min (estimate): Qwen2.5-VL-3B-shaped random model, HF and vLLM rollout with images (issue 29)
  HF_HUB_OFFLINE=1 timeout -k 10 ${VLM_TIMEOUT_S:-560} python3 benchmarks/vlm.py ${VLM_ARGS:-} \
    --md-out "$OUT/vlm_h200.md" > "$OUT/vlm.log" 2>&1; local rc=$?
  tail -n 30 "$OUT/vlm.log"; return $rc
}
phase_distill_teacher() {  # ~4 min: arm (b), RL on arith from the base, exported as the teacher
  OUT=$OUT STAGE=teacher FLOWRL_COMMIT=$COMMIT bash scripts/device/distill_run.sh ${DISTILL_ARGS:-} ${X:-}
}
phase_distill_arms() {  # ~4 min: arms (a) on-policy distillation and (c) SFT on teacher samples
  OUT=$OUT STAGE=distill FLOWRL_COMMIT=$COMMIT bash scripts/device/distill_run.sh ${DISTILL_ARGS:-} ${X:-}
}
# $OUT brings back at most 8 files: each run below comes back as one archive (report, PNG, run files)
learning_run() {  # <name> <STEM> <BASE> [overrides]: one gsm8k_learning_run.sh run, archived
  local name=$1 stem=$2 base=$3; shift 3
  rm -rf "/tmp/$name" && mkdir -p "/tmp/$name/out"
  OUT=/tmp/$name/out RUN=/tmp/$name/run STEM=$stem BASE="$base" FLOWRL_COMMIT=$COMMIT \
    TRAIN_TIMEOUT_S=${TRAIN_TIMEOUT_S:-480} bash scripts/device/gsm8k_learning_run.sh "$@" ${X:-}
  local rc=$?
  cp "/tmp/$name/run/console.log" "/tmp/$name/out/" 2>/dev/null
  (cd "/tmp/$name" && tar czf "$OUT/$name.tgz" out); return $rc
}
phase_gsm8k_mv() {  # ~7 min: GSM8K scored by math-verify, no format bonus (issue 25), 40 steps
  learning_run gsm8k_mv gsm8k_math_verify_h200 trainer=gsm8k_gpu \
    graph.path=$PWD/scripts/device/grpo_math_verify.yaml trainer.total_steps=${STEPS:-40} \
    rollout.vllm.gpu_memory_utilization=0.2
}
phase_tools() {  # ~6 min: graph=grpo_tools with SmolLM2 on data=arith (issue 25): tool use per step
  learning_run tools tools_smollm2_h200 graph=grpo_tools trainer.total_steps=${STEPS:-40} \
    trainer.prompts_per_step=16 trainer.eval.limit=256 trainer.eval.every=10 \
    rollout.vllm.gpu_memory_utilization=0.2
}
phase_sync() {  # ~3 min: weight sync per load path (reload vs auto -> direct), 4 engines, 0.5B shape
  VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout -k 10 ${SYNC_TIMEOUT_S:-300} python3 benchmarks/weight_sync.py \
    --paths reload,auto --rounds ${SYNC_ROUNDS:-8} --out "$OUT/weight_sync_paths.md" > "$OUT/sync.log" 2>&1
  local rc=$?; tail -n 30 "$OUT/sync.log"; return $rc
}
phase_lora_sync() {  # ~4 min: LoRA sync into vLLM, merged weights vs vLLM's LoRA adapter (issue 25)
  HF_HUB_OFFLINE=1 timeout -k 10 ${LORA_TIMEOUT_S:-330} python3 benchmarks/lora_sync.py ${LORA_ARGS:-} \
    --md-out "$OUT/lora_sync_h200.md" > "$OUT/lora_sync.log" 2>&1
  local rc=$?; tail -n 30 "$OUT/lora_sync.log"; return $rc
}
phase_neighbours() {  # ~4 min: the update beside 4 idle vLLM engine processes, awake / asleep / none (issue 24)
  VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout -k 10 ${NB_TIMEOUT_S:-400} python3 benchmarks/update_step.py \
    --variants ${NB_VARIANTS:-liger} --neighbours 4 --profile ${NB_VARIANTS:-liger} --profile-under none,awake \
    --out "$OUT/update_neighbours_h200.md" > "$OUT/neighbours.log" 2>&1
  local rc=$?; tail -n 30 "$OUT/neighbours.log"; return $rc
}
# issue 24's two open questions, profiled (trainer.profile: per step a table of each stage and the
# top kernels, back in $OUT/profile_*): why flowrl's update at step 2 takes 2.5-3.6 s beside 4
# vLLM engine processes (0.82-1.0 s from step 3), and why the compiled HF decode is slower than
# eager inside the loop (TORCH_LOGS names recompiles and skipped CUDA graphs)
phase_profile_vllm() {  # ~4.5 min: the qwen05b vLLM pair with TRL beside it (the slow step 2 came
  # only in pairs: flowrl alone at 12-04 had none), flowrl's steps 2 and 3 profiled (round 1: its
  # figures carry the profiler's overhead; rounds 2-3 are clean)
  python3 benchmarks/e2e_vs_trl.py --suite gpu --model qwen05b --rollout vllm \
    --out "$OUT/profile_vllm_e2e.md" --json-out "$OUT/profile_vllm_e2e.json" "trainer.profile.steps=[2,3]" \
    "trainer.profile.dir=$OUT/profile_vllm" trainer.profile.trace=false trainer.profile.row_limit=60 ${X:-}
  local rc=$?
  # only files at most one folder deep come back: the per-step summaries, flattened
  for f in "$OUT"/profile_vllm/step_*/rank*.txt; do [ -f "$f" ] && cp "$f" "$OUT/profile_$(basename "$(dirname "$f")")_$(basename "$f")"; done
  return $rc
}
phase_profile_hf() {  # ~3 min: flowrl alone, qwen05b, HF rollout compiled, steps 2 and 3 profiled
  TORCH_LOGS=recompiles,cudagraphs python3 benchmarks/e2e_vs_trl.py --suite gpu --model qwen05b \
    --rollout hf --only flowrl --rounds 1 --steps 3 --out "$OUT/profile_hf_e2e.md" \
    rollout.hf.compile=true "trainer.profile.steps=[2,3]" "trainer.profile.dir=$OUT/profile_hf" \
    trainer.profile.trace=false trainer.profile.row_limit=60 ${X:-} > "$OUT/profile_hf.log" 2>&1
  local rc=$?
  for f in "$OUT"/profile_hf/step_*/rank*.txt; do [ -f "$f" ] && cp "$f" "$OUT/profile_hf_$(basename "$(dirname "$f")")_$(basename "$f")"; done
  grep -iE "recompil|cudagraph|skipping" "$OUT/profile_hf.log" | head -40; tail -n 20 "$OUT/profile_hf.log"; return $rc
}
phase_profile_solo() {  # ~2.5 min: flowrl alone (P_MODEL, default smollm2; P_ROLLOUT, default vllm),
  # steps 3 and 4 profiled: where the update's time goes (tables by device and by host time)
  python3 benchmarks/e2e_vs_trl.py --suite gpu --model ${P_MODEL:-smollm2} --rollout ${P_ROLLOUT:-vllm} \
    --only flowrl --rounds 1 --steps 4 --out "$OUT/profile_solo_e2e.md" "trainer.profile.steps=[3,4]" \
    "trainer.profile.dir=$OUT/profile_solo" trainer.profile.trace=false trainer.profile.row_limit=45 ${X:-} \
    > "$OUT/profile_solo.log" 2>&1
  local rc=$?
  for f in "$OUT"/profile_solo/step_*/rank*.txt; do [ -f "$f" ] && cp "$f" "$OUT/profile_solo_$(basename "$(dirname "$f")")_$(basename "$f")"; done
  tail -n 15 "$OUT/profile_solo.log"; return $rc
}
phase_shapes() {  # ~5 min: the update alone with a new batch every step (micro-batch shapes change
  # as in the e2e run): the e2e's own engine (FSDP2 at one rank, fp32 master weights) keeping its
  # bf16 copies through the step (the default since reshard_after_forward=auto) against resharding
  # per micro-batch (before) and against cuDNN attention; the bf16 local engine as the old yardstick.
  # SmolLM2's shape and answers (90 % short), then the 0.5B shape with the e2e's lengths
  local v=${SHAPES_VARIANTS:-liger+fsdp,liger+fsdp+reshard,liger+fsdp+cudnn,liger}
  timeout -k 10 260 python3 benchmarks/update_step.py --shape smollm2 --variants $v \
    --vary-shapes --short-frac 0.9 --rounds 3 --steps 3 --profile '' \
    --out "$OUT/update_shapes_smollm2.md" > "$OUT/shapes_smollm2.log" 2>&1; local rc=$?
  timeout -k 10 260 python3 benchmarks/update_step.py --shape qwen05b --variants $v \
    --vary-shapes --rounds 3 --steps 2 --profile '' \
    --out "$OUT/update_shapes_qwen05b.md" > "$OUT/shapes_qwen05b.log" 2>&1 || rc=$?
  tail -n 9 "$OUT/shapes_smollm2.log" "$OUT/shapes_qwen05b.log"; return $rc
}
phase_sdpa() {  # ~30 s: masked SDPA at new shapes, cuDNN vs memory-efficient (trainer.engine.cudnn_attention)
  timeout -k 10 120 python3 benchmarks/sdpa_shapes.py --out "$OUT/sdpa_shapes.md"
}
phase_rollout_lp() {  # ~2 min: flowrl's 4 vLLM engine processes, 256 sequences, a generate call with
  # logprobs and without, 3 interleaved rounds on the same engines (what rollout.sampling.logprobs saves)
  timeout -k 10 ${RLP_TIMEOUT_S:-330} python3 benchmarks/rollout.py --variants flowrl-vllm-procs4 \
    --batches 256 --prompt-len 64 --flowrl-logprobs all,none --rounds 3 --child-timeout 300 \
    --json-out "$OUT/rollout_lp.json" --md-out "$OUT/rollout_lp.md" > "$OUT/rollout_lp.log" 2>&1
  local rc=$?; tail -n 25 "$OUT/rollout_lp.log"; return $rc
}
phase_decode_ab() {  # ~4 min: flowrl's 4 engine processes, 256 sequences of the 0.5B shape: serving with
  # 1 torch thread (the default since 2026-12-07) against torch's default, and vLLM's V1 model runner
  # against its default V2 (the V2 runner's Triton JIT costs a cold start 16 s), 3 interleaved rounds
  # per variant on its own engines (variants one after the other: no MPS here, as in rollout_h200.md)
  timeout -k 10 ${DAB_TIMEOUT_S:-330} python3 benchmarks/rollout.py \
    --variants ${DAB_VARIANTS:-flowrl-vllm-procs4,flowrl-vllm-procs4-threads,flowrl-vllm-procs4-v1runner} \
    --batches 256 --prompt-len 128 --flowrl-logprobs none --rounds 3 --child-timeout 150 \
    --json-out "$OUT/decode_ab.json" --md-out "$OUT/decode_ab.md" > "$OUT/decode_ab.log" 2>&1
  local rc=$?; tail -n 25 "$OUT/decode_ab.log"; return $rc
}
phase_tier() {  # ~5 min: the GPU tier (TIER_K: a -k selection)
  # the whole folder: a list kept by hand left test_mps_gpu.py out of the tier at ce93b88
  timeout -k 10 ${TIER_TIMEOUT_S:-540} python3 -m pytest ${TIER_K:+-k "$TIER_K"} -m "gpu or vllm" tests/gpu tests/vllm_backend/test_vllm_gpu.py \
    -n ${TIER_N:-8} -p no:cacheprovider -q -rA ${TIER_ARGS:-} \
    2>&1 | tee "$OUT/gpu_tier.log" | tail -n 60
}

case "${1:-}" in
repiece)  # HERE, not on the device, after the shared tool's `prepare`: its 40 MB vLLM pieces plus the
  # tree (~22 MiB of tracked files) pass the 64 MiB a call carries no more; re-cut into 4 × 30 MB
  # (.vllm/p1 p2 p3 p6) and let p5's install.sh join however many parts came
  set -e
  shopt -s nullglob  # .vllm/p6 exists only after a first repiece (a fresh prepare has none: cat failed)
  cat .vllm/p1/part0* .vllm/p2/part0* .vllm/p3/part0* .vllm/p6/part0* > /tmp/vllm_repiece.tar.xz
  rm -f .vllm/p1/part0* .vllm/p2/part0* .vllm/p3/part0* .vllm/p6/part0*; mkdir -p .vllm/p6
  split -b 30000000 -d /tmp/vllm_repiece.tar.xz /tmp/vllm_repiece.
  mv /tmp/vllm_repiece.00 .vllm/p1/part00; mv /tmp/vllm_repiece.01 .vllm/p2/part01
  mv /tmp/vllm_repiece.02 .vllm/p3/part02; mv /tmp/vllm_repiece.03 .vllm/p6/part03
  rm -f /tmp/vllm_repiece.*
  sed -i 's|cat /tmp/vparts/part00 /tmp/vparts/part01 /tmp/vparts/part02 |cat /tmp/vparts/part0[0-9] |' .vllm/p5/install.sh
  du -sh .vllm/p*; exit 0 ;;
piece)
  mkdir -p /tmp/vparts && cp .vllm/"$2"/* /tmp/vparts/ && ls /tmp/vparts | wc -l
  if [ -d .whl ]; then mkdir -p /tmp/whl && cp .whl/*.whl /tmp/whl/; fi
  exit 0 ;;
model)
  # the last piece (it carries NAME) joins; the others wait in /tmp
  if [ -f ".model/$2/NAME" ]; then bash scripts/device/smollm2_pieces.sh join; else bash scripts/device/smollm2_pieces.sh stash; fi
  exit $? ;;
wheels)  # no vLLM: the small wheels only (carry [".whl", ".flowrl_commit"]), for the phases
  # that need no vLLM (TIER_K="not vllm" tier, gpu_new, hfgen, e2e with --rollout hf on a random model)
  shift
  install_wheels .whl
  python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1  # as pip would (see install)
  python3 -c "import hydra, omegaconf, flowrl; print('ready without vLLM')" || exit 3
  ;;
install)
  shift
  t0=$SECONDS
  cp .vllm/p5/* /tmp/vparts/ && bash .vllm/p5/install.sh || { log "vLLM install failed"; exit 3; }
  install_wheels /tmp/whl
  # byte-compile what was unpacked, as `pip install` does for a user: without it the first import of
  # vLLM on a fresh machine compiled its .py files, seconds a user's cold first step never pays
  if [ "${BYTE_COMPILE:-1}" = 1 ]; then  # BYTE_COMPILE=0 when no cold first step is measured
    t1=$SECONDS; python3 -m compileall -q -j 0 /tmp/vsite /tmp/site > /dev/null 2>&1; log "byte-compiled in $((SECONDS - t1)) s"
  fi
  python3 -c "import vllm, hydra, trl, gguf, math_verify, flowrl; print('ready: vllm', vllm.__version__, 'trl', trl.__version__)" || exit 3
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
  # sdpa_varlen (the GPU's default attention for packed micro-batches) rests on this torch's kernel
  python3 -c "import inspect, torch; from torch.nn.attention.varlen import varlen_attn; print('varlen_attn', torch.__version__, torch.cuda.get_device_capability(), inspect.signature(varlen_attn))" 2>&1 | tail -1
  python3 -c "import torch; from flowrl.models.attention import varlen_probe; print('varlen probe:', varlen_probe(torch.device('cuda')) or 'ok')" 2>&1 | tail -1
  log "installed in $((SECONDS - t0)) s"
  ;;
esac
rc=0
for p in "$@"; do
  if [[ "$p" == *+* ]]; then  # side by side: each in the background, its output in a log
    log "phases ${p//+/ and } side by side"
    t0=$SECONDS; pids=()
    for q in ${p//+/ }; do ("phase_$q" > "$OUT/phase_$q.log" 2>&1; echo "phase $q exit $?" >> "$OUT/phase_$q.log") & pids+=($!); done
    wait "${pids[@]}"
    for q in ${p//+/ }; do echo "== phase $q"; tail -n 40 "$OUT/phase_$q.log"; done
    log "phases $p done in $((SECONDS - t0)) s"
    continue
  fi
  # every phase_* function above is a phase (a list kept by hand missed e2e_mps at 0235d2f)
  declare -F "phase_$p" > /dev/null || { log "unknown phase $p"; rc=2; continue; }
  log "phase $p"
  t0=$SECONDS
  "phase_$p" || { rc=$?; log "phase $p exit $rc"; }
  log "phase $p done in $((SECONDS - t0)) s"
done
# at most 8 files come back: past that, everything but the reports (*.md) goes into one archive
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && find . -type f ! -name '*.md' ! -name extra.tgz -print0 | tar czf /tmp/extra.tgz --null -T - \
    && find . -mindepth 1 ! -name '*.md' -delete 2>/dev/null; mv /tmp/extra.tgz "$OUT/extra.tgz")
  log "packed into extra.tgz: $(tar tzf "$OUT/extra.tgz" | wc -l) files; back as files: $(ls "$OUT" | tr '\n' ' ')"
fi
exit $rc
