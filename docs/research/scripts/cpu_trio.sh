#!/usr/bin/env bash
# Issue 40's trio on a CPU: the DFlash, FlashMap-style and ChainFlow stage-1 recipes, each from scratch on the same
# responses with the same steps and batch (the GPU runbook's trio, docs/research/device/README.md, at a CPU budget),
# exported in float16 and judged on the corpus's held-out responses. Rates and sizing:
# docs/research/results/cpu-stage/README.md, "Rates for issue 40's trio". Resumable: rerun after a kill (every
# phase skips what is done; trainings resume from their newest checkpoint). Two cores; nothing else beside it.
#
#     bash docs/research/scripts/cpu_trio.sh        # about 27 + 75 + 30 minutes at the defaults
#
# Env: STEPS (default 1500, x 64 windows for each drafter); SHARDS (default: enough of the train split's plan that the
#   steps draw each response's windows about an eighth of an epoch, 8 x STEPS x 64 / 19,256 windows a shard: 40 at
#   the defaults); W (work folder, default runs/cpu-trio); HELDOUT (the walk's held-out data, default
#   runs/cpu-stage/heldout when it is there); LIMIT (dry run: the first LIMIT responses of each split, 4 a shard,
#   batch 8, 8 walked responses).
set -euo pipefail
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-1500}
W=${W:-runs/cpu-trio}
C=corpus/smollm2-135m-instruct
R=docs/research/recipes
HERE=$(cd "$(dirname "$0")" && pwd)
if [ -n "${LIMIT:-}" ]; then
  SMALL=(--limit "$LIMIT" --shard-size 4) TBS=8 VAE=(--vae-pretrain-steps 2) WALK=8 SAVE=2
else
  SMALL=() TBS=64 VAE=() WALK=632 SAVE=100
fi
SHARDS=${SHARDS:-$(( (8 * STEPS * TBS + 19255) / 19256 ))}
mkdir -p "$W/export"
log() { echo "[$(date -u +%H:%M:%S)] trio: $*" | tee -a "$W/trio.log"; }
shards_in() { ls "$1/shards" 2>/dev/null | grep -c '^shard-' || true; }
prepare() {  # prepare OUT SPLIT N LAYERS: the first N shards of SPLIT (all when N is empty), bfloat16 states
  local have; have=$(shards_in "$1")
  if [ -z "$3" ] || [ "$have" -lt "$3" ]; then
    hf-chainflow prepare --corpus $C --split "$2" --target-layers "$4" --hidden-dtype bfloat16 --threads 2 \
      --out "$1" ${3:+--max-shards $(( $3 - have ))} "${SMALL[@]}" >> "$1.log" 2>&1
  fi
}

# 1. Data: the first SHARDS shards of the train split's plan (shuffle seed 0) with the DFlash layers; the FlashMap-style
#    and ChainFlow recipes read their final states from the same shards.
log "1. prepare $SHARDS shards with layers 1,10,18,27"
prepare "$W/D" train "$SHARDS" 1,10,18,27

# 2. The three trainings: DFlash on one core, the other two one after the other on the other core.
train() {  # train NAME RECIPE [options]
  local n=$1 recipe=$2 resume=()
  shift 2
  [ -f "$W/$n/train_summary.json" ] && return 0
  ls -d "$W/$n"/checkpoint-* > /dev/null 2>&1 && resume=(--resume last)
  hf-chainflow train --config "$recipe" --data "$W/D" --shards "0-$(( SHARDS - 1 ))" --max-steps "$STEPS" \
    --batch-size $TBS --threads 1 --save-steps $SAVE --save-total-limit 2 --logging-steps 50 \
    --training-arg disable_tqdm=true --out "$W/$n" "$@" "${resume[@]}" >> "$W/train-$n.log" 2>&1
}
log "2. train DF, FM, CF: $STEPS steps x $TBS each"
train DF $R/train_smollm2_dflash.yaml &
DF=$!
( train FM $R/train_smollm2_flashmap.yaml && train CF $R/train_smollm2.yaml "${VAE[@]}" ) &
FMCF=$!
wait $DF && wait $FMCF
for n in DF FM CF; do  # float16, as the GPU runbook packs them
  [ -f "$W/export/$n/model.safetensors" ] && continue
  python "$HERE/../device/pack.py" pack $n "$W/$n" last "$W/train-$n.log" "$W/$n.tar.xz"
  tar -C "$W/export" -xJf "$W/$n.tar.xz"
done
log "2. trained: $(for n in DF FM CF; do printf '%s %s s; ' $n "$(python -c "import json; print(json.load(open('$W/$n/train_summary.json')).get('train_seconds'))")"; done)"

# 3. Judge data: the held-out split with the walk's layers (the levers judge's) and with the DFlash layers.
HELDOUT=${HELDOUT:-runs/cpu-stage/heldout}
if [ -n "${LIMIT:-}" ] || [ ! -f "$HELDOUT/manifest.json" ]; then HELDOUT=$W/heldout; fi
log "3. held-out data: $HELDOUT, $W/heldout-dflash"
[ "$HELDOUT" = "$W/heldout" ] && prepare "$W/heldout" heldout "" 1,14,26
prepare "$W/heldout-dflash" heldout "" 1,10,18,27

# 4. The FlashMap-style and ChainFlow walks on the held-out responses side by side (one thread each), their paired
#    difference, then DFlash's offline tau held out and on its own training shards (did it memorise?).
walk() {  # walk NAME
  [ -f "$W/walk-$1/offline_eval.json" ] || hf-chainflow eval-offline --drafter "$W/export/$1" --data "$HELDOUT" \
    --shards "0-$(( $(shards_in "$HELDOUT") - 1 ))" --out "$W/walk-$1" --max-windows 4000 --tree 8x4 --tree-budget 12 \
    --max-tree-windows 600 --threads 1 --walk-sequences $WALK > "$W/walk-$1.log" 2>&1
}
log "4. walks"
walk FM & walk CF & wait
python "$HERE/compare_walks.py" "$W/walk-FM/offline_eval.json" "$W/walk-CF/offline_eval.json" | tee "$W/compare-FM-CF.txt"
[ -f "$W/dflash-offline.json" ] || python - "$W" <<'EOF'
import json, sys
import torch
from hf_chainflow import DFlashWindowDataset
from hf_chainflow.training.dflash import load_dflash_drafter
from hf_chainflow.training.dflash_trainer import evaluate_dflash_offline
from hf_chainflow.targets import load_model_and_tokenizer
torch.set_num_threads(2)
w = sys.argv[1]
target, _ = load_model_and_tokenizer("smollm2-135m-instruct")
drafter = load_dflash_drafter(f"{w}/export/DF", target)
out = {}
for name, data in (("heldout", f"{w}/heldout-dflash"), ("trained_on", f"{w}/D")):
    windows = DFlashWindowDataset.for_drafter(data, drafter.config, max_windows=4000)
    out[name] = {k: v for k, v in evaluate_dflash_offline(drafter, target, windows).items()}
    print(name, {k: out[name][k] for k in ("tau", "accuracy", "windows")})
json.dump(out, open(f"{w}/dflash-offline.json", "w"), indent=1, default=float)
EOF
log "done"
