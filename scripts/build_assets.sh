#!/usr/bin/env bash
# Reproduce the bundled tiny model pair and the eval prompt sets from this machine's CPython stdlib.
# Usage: bash scripts/build_assets.sh [STEP...]   steps: tokenizer evalsets verifier drafter install (default: all)
#        bash scripts/build_assets.sh smollm2        the three drafters for the real verifier `smollm2`: pretrained
#        (code corpus), then the verifier's synthetic answers, then distilled and sd2 from pretrained on them
#        (runs/smollm2/, every step resumable: rerun to continue; installed as assets/models/smollm2-*;
#        the distilled and sd2 steps can run as two parallel jobs of 1 thread each; smollm2-temperature then
#        calibrates each drafter's draft temperature and smollm2-heads trains each drafter's Pacer, SpecDec++ and
#        SPRINTER heads, SMOLLM2_HEADS_DRAFTERS choosing which drafters)
#        bash scripts/build_assets.sh smollm2 --device cuda   the same on a GPU (the smollm2 steps; DEVICE=cuda too):
#        one synth worker instead of two; the tiny pair's steps always train on the CPU
# Intermediate outputs (checkpoints) go to runs/assets/ (git-ignored); shipped files to steerspec/assets/.
# The shipped pair was made exactly so (verifier 600 steps, drafter 300 steps, 1 thread each, the two
# training steps run as two parallel jobs: `build_assets.sh verifier & build_assets.sh drafter`); the
# drafter's run directory was runs/assets/pretrained300 at the time. --resume continues an interrupted run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUNS=runs/assets
ASSETS=steerspec/assets
VERIFIER_STEPS=${VERIFIER_STEPS:-600}
DRAFTER_STEPS=${DRAFTER_STEPS:-300}
THREADS=${THREADS:-1}  # 1 thread per run: robust on a shared 2-core machine
DEVICE=${DEVICE:-cpu}  # where the smollm2 steps compute: cpu | cuda | cuda:N | auto
STEPS=()
while [ $# -gt 0 ]; do
  case $1 in
    --device) [ $# -ge 2 ] || { echo "build_assets.sh: --device needs a value (cpu, cuda, cuda:N, auto)" >&2; exit 2; }
              DEVICE=$2; shift 2 ;;
    --device=*) DEVICE=${1#--device=}; shift ;;
    *) STEPS+=("$1"); shift ;;
  esac
done
export DEVICE
[ ${#STEPS[@]} -eq 0 ] && STEPS=(tokenizer evalsets verifier drafter install)
export OMP_NUM_THREADS=$THREADS

install_model() {  # copy the Hugging Face files of a trained run into the package
  local src=$1 dst=$2
  mkdir -p "$dst"
  for f in config.json model.safetensors tokenizer.json tokenizer_config.json tokenizer_meta.json \
           train_report.json MODEL_CARD.md; do
    [ -f "$src/$f" ] && cp "$src/$f" "$dst/$f"
  done
}

for step in "${STEPS[@]}"; do
  case $step in
    tokenizer) $PY -m steerspec.data.tokenizer --out $RUNS/tokenizer ;;
    evalsets)  $PY -m steerspec.data.evalsets --tokenizer $RUNS/tokenizer --out $ASSETS/eval ;;
    verifier)  $PY -m steerspec train base --role verifier --out $RUNS/verifier --tokenizer $RUNS/tokenizer \
                 --steps "$VERIFIER_STEPS" --batch-size 16 --seq-len 256 --lr 2e-3 --seed 1234 --threads "$THREADS" --resume ;;
    drafter)   $PY -m steerspec train base --role drafter --out $RUNS/pretrained --tokenizer $RUNS/tokenizer \
                 --steps "$DRAFTER_STEPS" --batch-size 16 --seq-len 256 --lr 3e-3 --seed 1234 --threads "$THREADS" --resume ;;
    smollm2)   "$0" smollm2-pretrained smollm2-synth
               # distilled and sd2 side by side (one thread each, as the shipped pair was built): on 2 cores the
               # pair takes the longer one's time instead of the sum
               "$0" smollm2-distilled & distilled=$!
               "$0" smollm2-sd2 & sd2=$!
               status=0; wait "$distilled" || status=$?; wait "$sd2" || status=$?
               [ "$status" -eq 0 ] || { echo "build_assets.sh: smollm2-distilled or smollm2-sd2 failed (rerun to resume)" >&2; exit "$status"; }
               "$0" smollm2-temperature smollm2-heads ;;
    smollm2-pretrained)
               $PY -m steerspec train smollm2 --out runs/smollm2/trained --work runs/smollm2 \
                 --steps "${SMOLLM2_STEPS:-800}" --lr 1e-3 --batch-size 8 --seq-len 256 --seed 1234 --threads "$THREADS" \
                 --device "$DEVICE"
               mkdir -p $ASSETS/models/smollm2-pretrained
               cp runs/smollm2/trained/{config.json,generation_config.json,drafter.safetensors,MODEL_CARD.md} \
                 $ASSETS/models/smollm2-pretrained/ ;;
    smollm2-synth)  # the verifier's T=1 answers with its top-64 log-probs and SD² taps cached (resumable by
                    # shard); two workers of one thread each share the shards. 24 shards of 256 answers are what
                    # the shipped drafters learnt from (SMOLLM2_SYNTH_SHARDS=7 was the first, smaller build)
               pids=(); workers=2; [ "$DEVICE" = cpu ] || workers=1  # one process feeds a GPU
               for ((w = 0; w < workers; w++)); do
                 $PY -m steerspec train synth --verifier smollm2 --out runs/smollm2/synth --samples 8192 --batch-size 256 \
                   --prompt-min 16 --prompt-max 96 --max-new-tokens 128 --teacher-top-k 64 --seed 0 --threads 1 \
                   --shards "${SMOLLM2_SYNTH_SHARDS:-24}" --worker $w/$workers --device "$DEVICE" &
                 pids+=($!)
               done
               for pid in "${pids[@]}"; do wait "$pid"; done ;;  # fails when a worker failed
    smollm2-distilled|smollm2-sd2)  # the same data, steps, lr, initialisation and seed; sd2 adds steering
               # (the default 1,500 steps fit the CPU budget; the shipped pair: SMOLLM2_DISTILL_STEPS=3000
               # SMOLLM2_STEER_LR=2.5e-3 on a GPU, gpu_check.sh 7; 250 steps was the first, smaller build)
               kind=${step#smollm2-}; cmd=distill; extra=()
               if [ "$kind" = sd2 ]; then cmd=sd2; extra=(--k 4); fi
               # SMOLLM2_STEER_LR: a peak learning rate of its own for SD²'s W_hml and W_s (default --lr)
               if [ "$kind" = sd2 ] && [ -n "${SMOLLM2_STEER_LR:-}" ]; then extra+=(--steer-lr "$SMOLLM2_STEER_LR"); fi
               $PY -m steerspec train $cmd --data runs/smollm2/synth --verifier smollm2 --drafter smollm2-pretrained \
                 --out runs/smollm2/$kind --steps "${SMOLLM2_DISTILL_STEPS:-1500}" --batch-size 16 --lr 5e-4 \
                 --eval-every 80 --save-every 10 --seed 0 --threads "$THREADS" --device "$DEVICE" "${extra[@]}"
               mkdir -p $ASSETS/models/$step
               cp runs/smollm2/$kind/{config.json,generation_config.json,drafter.safetensors,MODEL_CARD.md,train_report.json} \
                 $ASSETS/models/$step/
               if [ "$kind" = sd2 ]; then cp runs/smollm2/sd2/steering.{json,safetensors} $ASSETS/models/$step/; fi ;;
    smollm2-temperature)  # each drafter's draft temperature (the scale of its logits that maximises one draft's
               # acceptance on train-split answers), written into its config.json; before the heads, since
               # SPRINTER's features hold q. A retrained drafter is saved uncalibrated, so this follows it
               for d in ${SMOLLM2_HEADS_DRAFTERS:-smollm2-pretrained smollm2-distilled smollm2-sd2}; do
                 $PY -m steerspec train temperature --verifier smollm2 --drafter $d --prompts 48 --max-new-tokens 64 \
                   --seed 1 --threads "$THREADS" --write || exit $?
               done ;;
    smollm2-heads)  # Pacer's and SpecDec++'s draft-length heads and the SPRINTER classifier of each drafter,
               # written into the drafter's package directory; one one-thread worker per drafter
               pids=()
               for d in ${SMOLLM2_HEADS_DRAFTERS:-smollm2-pretrained smollm2-distilled smollm2-sd2}; do
                 ( for kind in pacer specdecpp; do
                     $PY -m steerspec train $kind --verifier smollm2 --drafter $d --work runs/smollm2/heads-$d \
                       --prompts 80 --gamma 20 --stride 4 --epochs 8 --seed 0 --threads 1 --device "$DEVICE"
                   done
                   $PY -m steerspec train sprinter --verifier smollm2 --drafter $d --work runs/smollm2/sprinter-$d \
                     --lambda 1 --train-tokens 60000 --heldout-tokens 10000 --epochs 8 --seed 0 --threads 1 \
                     --device "$DEVICE" ) &
                 pids+=($!)
               done
               for pid in "${pids[@]}"; do wait "$pid"; done ;;
    install)   install_model $RUNS/verifier $ASSETS/models/verifier
               install_model $RUNS/pretrained $ASSETS/models/pretrained ;;
    *) echo "unknown step: $step" >&2; exit 2 ;;
  esac
done
