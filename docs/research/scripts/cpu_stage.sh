#!/usr/bin/env bash
# One segment of the CPU stage of issue 39 (docs/research/results/cpu-stage/PLAN.md): continue the drafter INIT on
# segment K's shards of the corpus's train split, export it in float16 and walk it on the 632 held-out responses.
# Resumable: rerun the same command after a kill (every phase skips what is done; training resumes from its newest
# checkpoint). Two cores; nothing else should run beside phases 1-3.
#
#     bash docs/research/scripts/cpu_stage.sh K INIT [REFERENCE_WALK]
#
# K: segment number (segment K reads the shards S(K-1) .. SK-1 of the train split's plan, shuffle seed 0, where S is
#   SHARDS_PER_SEGMENT).
# INIT: the drafter folder it starts from (segment 1: the shipped round-14 drafter).
# REFERENCE_WALK: an offline_eval.json walked on the same held-out data (default: INIT's walk on this machine, made in
#   phase 4 beside the segment's own walk).
# Env: SHARDS_PER_SEGMENT (default 40, segment 1's), STEPS (default 500, x 512 windows), W (work folder, default
#   runs/cpu-stage). Segment 1 (40 shards, 500 steps) memorised its responses and gained nothing held out
#   (docs/research/results/cpu-stage/README.md); the half-corpus stage that replaced it is
#   SHARDS_PER_SEGMENT=121 STEPS=250 W=runs/cpu-half (about 8 windows a response, round 14's breadth).
set -euo pipefail
K=$1
INIT=$2
REFERENCE_WALK=${3:-}
SHARDS_PER_SEGMENT=${SHARDS_PER_SEGMENT:-40}
STEPS=${STEPS:-500}   # x 512 windows; 500 = 256,000, the size of round 14's GPU stage
CORPUS=corpus/smollm2-135m-instruct
W=${W:-runs/cpu-stage}
SEG=$W/segment-$K
FIRST=$(( (K - 1) * SHARDS_PER_SEGMENT ))
END=$(( K * SHARDS_PER_SEGMENT ))
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$SEG"
log() { echo "[$(date -u +%H:%M:%S)] segment $K: $*" | tee -a "$SEG/stage.log"; }
shards_in() { ls "$1/shards" 2>/dev/null | grep -c '^shard-' || true; }

# 1. Data: segment K's shards in a folder of their own, bfloat16 states (final layer only).
#    Segment 1 is the plan folder's own first 40 shards; a later segment cuts its rows out of the plan
#    (docs/research/device/plan_parts.py) and prepares them in plan order, which gives the same shards numbered from 0.
if [ "$K" = 1 ]; then
  DATA=$W/data
  have=$(shards_in "$DATA")
  if [ "$have" -lt "$END" ]; then
    log "1. prepare shards $have..$((END - 1)) into $DATA"
    hf-chainflow prepare --corpus $CORPUS --split train --hidden-dtype bfloat16 --threads 2 --out "$DATA" \
      --max-shards $(( END - have )) >> "$SEG/prepare.log" 2>&1
  fi
  SHARDS=(--shards "0-$((END - 1))")
else
  if [ ! -f "$W/data/plan.json" ]; then
    log "1a. the plan (shard 0 of the plan folder)"
    hf-chainflow prepare --corpus $CORPUS --split train --hidden-dtype bfloat16 --threads 2 --out "$W/data" \
      --max-shards 1 >> "$SEG/prepare.log" 2>&1
  fi
  DATA=$SEG/data
  [ -f "$SEG/rows/part-0.jsonl" ] || python "$HERE/../device/plan_parts.py" "$W/data" $CORPUS train $FIRST $END 1 "$SEG/rows"
  have=$(shards_in "$DATA")
  if [ "$have" -lt "$SHARDS_PER_SEGMENT" ]; then
    log "1b. prepare plan shards $FIRST..$((END - 1)) into $DATA"
    hf-chainflow prepare --responses "$SEG/rows/part-0.jsonl" --keep-order --hidden-dtype bfloat16 --threads 2 \
      --out "$DATA" --max-shards $(( SHARDS_PER_SEGMENT - have )) >> "$SEG/prepare.log" 2>&1
  fi
  SHARDS=()  # every shard of the folder
fi
log "1. data ready: $DATA ${SHARDS[*]:-(every shard)}"

# 2. Train: round 14's recipe (batch 512, lr 2e-4, warm-up, linear decay), warm-up STEPS/5 (100 at 500), decayed to
#    0 at STEPS, seed K (fresh windows), checkpoints every 50 steps for the resume.
RUN=$SEG/run
if [ ! -f "$RUN/train_summary.json" ]; then
  RESUME=()
  ls -d "$RUN"/checkpoint-* > /dev/null 2>&1 && RESUME=(--resume last)
  log "2. train from $INIT (${RESUME[*]:-fresh})"
  hf-chainflow train --data "$DATA" "${SHARDS[@]}" --init-from "$INIT" --out "$RUN" --max-steps $STEPS \
    --batch-size 512 --lr 2e-4 --seed "$K" --threads 2 --num-workers 0 --logging-steps 10 --save-steps 50 \
    --save-total-limit 2 --train-flow-steps 1 --training-arg lr_scheduler_type=linear \
    --training-arg warmup_steps=$(( STEPS / 5 )) --training-arg loss_kd_weight=1.0 "${RESUME[@]}" >> "$SEG/train.log" 2>&1
fi
if [ ! -f "$SEG/drafter/model.safetensors" ]; then  # float16, as the GPU runbook packs a drafter
  python "$HERE/../device/pack.py" pack drafter "$RUN" last "$SEG/train.log" "$SEG/drafter.tar.xz"
  tar -C "$SEG" -xJf "$SEG/drafter.tar.xz"
fi
log "2. trained: $SEG/drafter (float16)"

# 3. The judge's data: the corpus's held-out split, bfloat16 states (the levers judge's command).
HELDOUT=$W/heldout
if [ ! -f "$HELDOUT/manifest.json" ] || [ "$(shards_in "$HELDOUT")" -lt 5 ]; then
  log "3. prepare the held-out split"
  hf-chainflow prepare --corpus $CORPUS --split heldout --target-layers 1,14,26 --hidden-dtype bfloat16 --threads 2 \
    --out "$HELDOUT" >> "$W/prepare-heldout.log" 2>&1
fi

# 4. The walk on all 632 held-out responses, one thread (the judge since round 11); INIT walked beside it on the
#    other core unless a reference walk is given.
walk() {  # walk DRAFTER OUT
  [ -f "$2/offline_eval.json" ] || hf-chainflow eval-offline --drafter "$1" --data "$HELDOUT" --shards 0-4 --out "$2" \
    --max-windows 4000 --tree 8x4 --tree-budget 12 --max-tree-windows 600 --threads 1 --walk-sequences 632 \
    > "$2.log" 2>&1
}
log "4. walk"
walk "$SEG/drafter" "$SEG/walk632" &
if [ -z "$REFERENCE_WALK" ]; then
  walk "$INIT" "$SEG/walk632-init" &
  REFERENCE_WALK=$SEG/walk632-init/offline_eval.json
fi
wait
python "$HERE/compare_walks.py" "$REFERENCE_WALK" "$SEG/walk632/offline_eval.json" | tee "$SEG/compare.txt"
log "done"
