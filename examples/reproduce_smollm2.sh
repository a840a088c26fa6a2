#!/usr/bin/env bash
# Reproduces the drafters shipped in hf_chainflow/checkpoints/ and their offline evaluation (docs/results.md):
# the hidden states of SmolLM2-135M-Instruct's own greedy responses (26 shards of 128 responses), ChainFlow and the
# FlashMap-style comparison trained with the same two-stage recipe on the same shards, offline tau on the held-out
# shards 21-25.
#   bash examples/reproduce_smollm2.sh [SHARED_DIR] [OUT_DIR]
set -euo pipefail
SHARED=${1:-../shared}
OUT=${2:-runs/smollm2}
hf-chainflow prepare --responses "$SHARED/data/responses/smollm2-135m-instruct.jsonl" --out "$OUT/data" \
    --shard-size 128 --shuffle-seed 0 --threads 1
# Stage 1: shards 0-6, 3000 steps (fresh drafters). Stage 2: shards 0-20, 6000 steps, warm-started.
# (A third stage, examples/train_smollm2_stage3.yaml, was run on a GPU and not shipped: docs/results.md.)
hf-chainflow train --config examples/train_smollm2.yaml --data "$OUT/data" --out "$OUT/chainflow-stage1"
hf-chainflow train --config examples/train_smollm2_flashmap.yaml --data "$OUT/data" --out "$OUT/flashmap-stage1"
for name in chainflow flashmap; do
    hf-chainflow train --config examples/train_smollm2_stage2.yaml --init-from "$OUT/$name-stage1" \
        --data "$OUT/data" --out "$OUT/$name"
    hf-chainflow eval-offline --drafter "$OUT/$name" --data "$OUT/data" --shards 21-25 --out "$OUT/eval-$name" \
        --max-windows 4000 --tree 8x4 --tree-budget 12 --max-tree-windows 600 --threads 1
done
