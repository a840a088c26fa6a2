#!/usr/bin/env bash
# Reproduces the drafters shipped in hf_chainflow/checkpoints/ and their offline evaluation (docs/results.md):
# the hidden states of SmolLM2-135M-Instruct's own greedy responses, ChainFlow and the FlashMap-style comparison
# trained on the same 7 shards with the same budget, offline tau on the held-out shards 7-10.
#   bash examples/reproduce_smollm2.sh [SHARED_DIR] [OUT_DIR]
set -euo pipefail
SHARED=${1:-../shared}
OUT=${2:-runs/smollm2}
hf-chainflow prepare --responses "$SHARED/data/responses/smollm2-135m-instruct.jsonl" --out "$OUT/data" \
    --shard-size 128 --shuffle-seed 0 --threads 1 --max-shards 11
hf-chainflow train --config examples/train_smollm2.yaml --data "$OUT/data" --out "$OUT/chainflow"
hf-chainflow train --config examples/train_smollm2_flashmap.yaml --data "$OUT/data" --out "$OUT/flashmap"
for name in chainflow flashmap; do
    hf-chainflow eval-offline --drafter "$OUT/$name" --data "$OUT/data" --shards 7-10 --out "$OUT/eval-$name" \
        --max-windows 3000 --tree 8x4 --max-tree-windows 300 --threads 1
done
