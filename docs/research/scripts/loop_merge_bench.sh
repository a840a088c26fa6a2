#!/usr/bin/env bash
# Issue 63: the one batched loop against the two loops it replaced, old / new / old / new, on one machine.
# OLD is a checkout of the commit before the merge (e.g. `git worktree add /tmp/old 314d761`), run through
# PYTHONPATH; NEW is this checkout. Same bench command each time: batch 1 (the journaled bench) and batch 2
# (`--batch-sizes 2`), bf16, 12 evaluation prompts stratified by domain, 96 new tokens, 2 threads.
# Usage, from outside the checkout (a `python -c` run in it would import it before PYTHONPATH):
#   cd /tmp && /work/main/docs/research/scripts/loop_merge_bench.sh /tmp/old /work/main/runs/loop-merge
set -euo pipefail
OLD=$1; OUT=$2
mkdir -p "$OUT"
for pass in 1 2; do
  for side in old new; do
    if [ "$side" = old ]; then export PYTHONPATH="$OLD"; else unset PYTHONPATH; fi
    python -c "import hf_chainflow; print('$side', hf_chainflow.__file__)"
    hf-chainflow bench --arms ar@bfloat16,tree+lookup@bfloat16 --dtypes bfloat16 --limit 12 --max-new-tokens 96 \
      --threads 2 --no-progress --overwrite --output-dir "$OUT/b1-$side-$pass" > "$OUT/b1-$side-$pass.log" 2>&1
    hf-chainflow bench --arms ar@bfloat16,tree+lookup@bfloat16 --dtypes bfloat16 --limit 12 --max-new-tokens 96 \
      --threads 2 --no-progress --batch-sizes 2 --output-dir "$OUT/b2-$side-$pass" > "$OUT/b2-$side-$pass.log" 2>&1
  done
done
unset PYTHONPATH
# the demo's text, tau and verdicts, old and new
for side in old new; do
  if [ "$side" = old ]; then export PYTHONPATH="$OLD"; else unset PYTHONPATH; fi
  hf-chainflow demo > "$OUT/demo-$side.log" 2>&1
done
unset PYTHONPATH
