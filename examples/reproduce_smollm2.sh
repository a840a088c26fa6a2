#!/usr/bin/env bash
# Reproduces the drafters shipped in hf_chainflow/checkpoints/ and their offline evaluation (docs/results.md; every
# stage with its figures: docs/research/training-rounds.md; the recipes: docs/research/recipes/):
# the hidden states of SmolLM2-135M-Instruct's own greedy responses (26 shards of 128 responses), ChainFlow and the
# FlashMap-style comparison trained with the same recipe on the same data (fourteen stages; a fifteenth,
# round 14, for ChainFlow alone on a GPU), offline tau on the held-out
# shards 21-25. The third, fourth, fifth, seventh, eighth and ninth stages each first generate the target's responses
# to 1,536 more training prompts, the sixth to 768, rounds 10-12 to 1,423, 1,344 and 1,344 (the two round-13 stages
# add none) (about 50 minutes for 1,536 on a 2-core CPU with AVX-512 BF16, 2.4 hours on an
# AVX2-only one; minutes with `--device cuda`).
#   bash examples/reproduce_smollm2.sh [SHARED_DIR] [OUT_DIR]
set -euo pipefail
SHARED=${1:-../shared}
OUT=${2:-runs/smollm2}
hf-chainflow prepare --responses "$SHARED/data/responses/smollm2-135m-instruct.jsonl" --out "$OUT/data" \
    --shard-size 128 --shuffle-seed 0 --threads 1
# Stage 1: shards 0-6, 3000 steps (fresh drafters). Stage 2: shards 0-20, 6000 steps, warm-started. More-data
# stage: 6000 steps on the new responses + replay, warm-started. Round 4: 3000 steps on a fourth round of responses
# + replay, warm-started. Round 5: 2000 steps at lr 1e-4 on a fifth round + shards 0-3 replayed. Round 6: 1000
# steps on half a sixth round + shards 0-7 replayed, with the distillation term. Round 7: 2000 steps on a seventh
# round + shards 0-7 replayed, the distillation term, one training flow step for both drafters. Rounds 8 to 11: the
# round-7 command on each next round, one after the other. Round 12: the same on a twelfth round, with every
# earlier round replayed (repeated --replay) instead of shards 0-7 alone. Round 13: two consolidation stages on
# the same data with no new responses, the replayed part at 77.5 % of the mix.
# (A third stage, docs/research/recipes/train_smollm2_stage3.yaml, was run on a GPU and not shipped:
# docs/research/training-rounds.md.)
# Rounds 4 to 8 of the shipped drafters warm-started from the previous stage's float16 file (the one shipped), rounds
# 9 to 12 from the previous round's float32 output (rounds 8, 10 and 11 were not shipped on their own); this script
# warm-starts every stage from the previous stage's float32 output, which rounds to that file.
hf-chainflow train --config docs/research/recipes/train_smollm2.yaml --data "$OUT/data" --out "$OUT/chainflow-stage1"
hf-chainflow train --config docs/research/recipes/train_smollm2_flashmap.yaml --data "$OUT/data" --out "$OUT/flashmap-stage1"
python docs/research/scripts/select_training_prompts.py --prompts "$SHARED/data/prompts/train.jsonl" \
    --exclude "$SHARED/data/responses/smollm2-135m-instruct.jsonl" --domains-from "$SHARED/data/prompts/eval.jsonl" \
    --per-domain 192 --seed 2026 --out "$OUT/more/prompts.jsonl"
hf-chainflow prepare --prompts "$OUT/more/prompts.jsonl" --out "$OUT/more/data" --shard-size 128 --shuffle-seed 0 \
    --batch-size 32
python docs/research/scripts/select_training_prompts.py --prompts "$SHARED/data/prompts/train.jsonl" \
    --exclude "$SHARED/data/responses/smollm2-135m-instruct.jsonl" --exclude "$OUT/more/prompts.jsonl" \
    --domains-from "$SHARED/data/prompts/eval.jsonl" --per-domain 192 --seed 2027 --out "$OUT/more2/prompts.jsonl"
hf-chainflow prepare --prompts "$OUT/more2/prompts.jsonl" --out "$OUT/more2/data" --shard-size 128 \
    --shuffle-seed 0 --batch-size 32
# The fifth round excludes 64 prompts held out for the probes of docs/training.md (seed 3030) as well; it was
# generated in float32 on a CPU without bfloat16 matrix instructions.
python docs/research/scripts/select_training_prompts.py --prompts "$SHARED/data/prompts/train.jsonl" \
    --exclude "$SHARED/data/responses/smollm2-135m-instruct.jsonl" --exclude "$OUT/more/prompts.jsonl" \
    --exclude "$OUT/more2/prompts.jsonl" --domains-from "$SHARED/data/prompts/eval.jsonl" --per-domain 8 \
    --seed 3030 --out "$OUT/heldout/prompts.jsonl"
python docs/research/scripts/select_training_prompts.py --prompts "$SHARED/data/prompts/train.jsonl" \
    --exclude "$SHARED/data/responses/smollm2-135m-instruct.jsonl" --exclude "$OUT/more/prompts.jsonl" \
    --exclude "$OUT/more2/prompts.jsonl" --exclude "$OUT/heldout/prompts.jsonl" \
    --domains-from "$SHARED/data/prompts/eval.jsonl" --per-domain 192 --seed 2028 --out "$OUT/more3/prompts.jsonl"
hf-chainflow prepare --prompts "$OUT/more3/prompts.jsonl" --out "$OUT/more3/data" --shard-size 128 \
    --shuffle-seed 0 --batch-size 32 --dtype float32
# Round 6: half a round (96 prompts a domain), bfloat16 generation.
python docs/research/scripts/select_training_prompts.py --prompts "$SHARED/data/prompts/train.jsonl" \
    --exclude "$SHARED/data/responses/smollm2-135m-instruct.jsonl" --exclude "$OUT/more/prompts.jsonl" \
    --exclude "$OUT/more2/prompts.jsonl" --exclude "$OUT/heldout/prompts.jsonl" --exclude "$OUT/more3/prompts.jsonl" \
    --domains-from "$SHARED/data/prompts/eval.jsonl" --per-domain 96 --seed 2029 --out "$OUT/more4/prompts.jsonl"
hf-chainflow prepare --prompts "$OUT/more4/prompts.jsonl" --out "$OUT/more4/data" --shard-size 128 \
    --shuffle-seed 0 --batch-size 32
# Round 7: a whole round again (192 prompts a domain), bfloat16 generation.
python docs/research/scripts/select_training_prompts.py --prompts "$SHARED/data/prompts/train.jsonl" \
    --exclude "$SHARED/data/responses/smollm2-135m-instruct.jsonl" --exclude "$OUT/more/prompts.jsonl" \
    --exclude "$OUT/more2/prompts.jsonl" --exclude "$OUT/heldout/prompts.jsonl" --exclude "$OUT/more3/prompts.jsonl" \
    --exclude "$OUT/more4/prompts.jsonl" --domains-from "$SHARED/data/prompts/eval.jsonl" --per-domain 192 \
    --seed 2030 --out "$OUT/more5/prompts.jsonl"
hf-chainflow prepare --prompts "$OUT/more5/prompts.jsonl" --out "$OUT/more5/data" --shard-size 128 \
    --shuffle-seed 0 --batch-size 32
# Rounds 8 and 9: two more whole rounds (192 prompts a domain each), bfloat16 generation, each excluding all
# earlier selections.
excludes=(--exclude "$SHARED/data/responses/smollm2-135m-instruct.jsonl")
for name in more more2 heldout more3 more4 more5; do excludes+=(--exclude "$OUT/$name/prompts.jsonl"); done
for round in "more6 2031" "more7 2032"; do
    set -- $round
    python docs/research/scripts/select_training_prompts.py --prompts "$SHARED/data/prompts/train.jsonl" "${excludes[@]}" \
        --domains-from "$SHARED/data/prompts/eval.jsonl" --per-domain 192 --seed "$2" --out "$OUT/$1/prompts.jsonl"
    hf-chainflow prepare --prompts "$OUT/$1/prompts.jsonl" --out "$OUT/$1/data" --shard-size 128 \
        --shuffle-seed 0 --batch-size 32
    excludes+=(--exclude "$OUT/$1/prompts.jsonl")
done
# Rounds 10-12 (docs/data.md): MT-Bench's training prompts run out after round 9, so round 10 takes 192 prompts of
# each of the other seven evaluation domains and the 79 MT-Bench prompts left; rounds 11 and 12 the seven alone.
printf '{"domain": "%s"}\n' code math qa rag summ tool transl > "$OUT/domains7.jsonl"
echo '{"domain": "mt"}' > "$OUT/domains-mt.jsonl"
for round in "more8 2033" "more9 2034" "more10 2035"; do
    set -- $round
    mkdir -p "$OUT/$1"
    python docs/research/scripts/select_training_prompts.py --prompts "$SHARED/data/prompts/train.jsonl" "${excludes[@]}" \
        --domains-from "$OUT/domains7.jsonl" --per-domain 192 --seed "$2" --out "$OUT/$1/prompts7.jsonl"
    if [ "$1" = more8 ]; then
        python docs/research/scripts/select_training_prompts.py --prompts "$SHARED/data/prompts/train.jsonl" "${excludes[@]}" \
            --domains-from "$OUT/domains-mt.jsonl" --per-domain 79 --seed "$2" --out "$OUT/$1/prompts-mt.jsonl"
        cat "$OUT/$1/prompts7.jsonl" "$OUT/$1/prompts-mt.jsonl" > "$OUT/$1/prompts.jsonl"
    else
        cp "$OUT/$1/prompts7.jsonl" "$OUT/$1/prompts.jsonl"
    fi
    hf-chainflow prepare --prompts "$OUT/$1/prompts.jsonl" --out "$OUT/$1/data" --shard-size 128 \
        --shuffle-seed 0 --batch-size 32
    excludes+=(--exclude "$OUT/$1/prompts.jsonl")
done
for name in chainflow flashmap; do
    hf-chainflow train --config docs/research/recipes/train_smollm2_stage2.yaml --init-from "$OUT/$name-stage1" \
        --data "$OUT/data" --out "$OUT/$name-stage2"
    # The more-data stage: the 1,536 new responses, with stage 2's shards 0-20 replayed as 60 % of the mix.
    hf-chainflow train --config docs/research/recipes/train_smollm2_more_data.yaml --init-from "$OUT/$name-stage2" \
        --data "$OUT/more/data" --replay "$OUT/data" --out "$OUT/$name-more"
    # Round 4: a fourth round of 1,536 new responses, the same replay, half the steps.
    hf-chainflow train --config docs/research/recipes/train_smollm2_round4.yaml --init-from "$OUT/$name-more" \
        --data "$OUT/more2/data" --replay "$OUT/data" --out "$OUT/$name-round4"
done
# Round 5: the fifth round's 1,536 responses, shards 0-3 of the shared responses replayed as half of the mix, a
# quarter of the learning rate. Each drafter keeps its own config's train_flow_steps (ChainFlow 2, FlashMap-style 1).
hf-chainflow train --config docs/research/recipes/train_smollm2_round5.yaml --init-from "$OUT/chainflow-round4" \
    --data "$OUT/more3/data" --shards 0-11 --replay "$OUT/data" --lr 1e-4 --threads 2 --out "$OUT/chainflow-round5"
hf-chainflow train --config docs/research/recipes/train_smollm2_round5.yaml --init-from "$OUT/flashmap-round4" \
    --data "$OUT/more3/data" --shards 0-11 --replay "$OUT/data" --lr 1e-4 --threads 1 --out "$OUT/flashmap-round5"
# Round 6: the sixth round's 768 responses, shards 0-7 of the shared responses replayed as half of the mix, 1,000
# steps at lr 1e-4, with the distillation term (loss_kd_weight 1.0); again each drafter keeps its train_flow_steps.
hf-chainflow train --config docs/research/recipes/train_smollm2_round5.yaml --init-from "$OUT/chainflow-round5" \
    --data "$OUT/more4/data" --shards 0-5 --replay "$OUT/data" --replay-shards 0-7 --lr 1e-4 --max-steps 1000 \
    --threads 1 --training-arg loss_kd_weight=1.0 --out "$OUT/chainflow-round6"
hf-chainflow train --config docs/research/recipes/train_smollm2_round5.yaml --init-from "$OUT/flashmap-round5" \
    --data "$OUT/more4/data" --shards 0-5 --replay "$OUT/data" --replay-shards 0-7 --lr 1e-4 --max-steps 1000 \
    --threads 1 --training-arg loss_kd_weight=1.0 --train-flow-steps 1 --out "$OUT/flashmap-round6"
# Round 7: the seventh round's 1,536 responses, the same replay and term, 2,000 steps, and one training flow step
# for ChainFlow too (the step count it serves with).
for name in chainflow flashmap; do
    prev="$OUT/$name-round6"
    # Rounds 8 to 11: the round-7 command on each round in turn (rounds 10 and 11 were not shipped on their own).
    for round in "round7 more5 0-11" "round8 more6 0-11" "round9 more7 0-11" "round10 more8 0-11" "round11 more9 0-10"; do
        set -- $round
        hf-chainflow train --config docs/research/recipes/train_smollm2_round5.yaml --init-from "$prev" \
            --data "$OUT/$2/data" --shards "$3" --replay "$OUT/data" --replay-shards 0-7 --lr 1e-4 --max-steps 2000 \
            --threads 1 --training-arg loss_kd_weight=1.0 --train-flow-steps 1 --out "$OUT/$name-$1"
        prev="$OUT/$name-$1"
    done
    # Round 12: the same command on the twelfth round, replaying every earlier round's responses together (shards 0-7
    # of the shared responses and rounds 6-11; rounds 3-5 were no longer on the machine that trained it).
    replays=(--replay "$OUT/data" --replay-shards 0-7)
    for d in more4 more5 more6 more7 more8 more9; do replays+=(--replay "$OUT/$d/data" --replay-shards all); done
    hf-chainflow train --config docs/research/recipes/train_smollm2_round5.yaml --init-from "$prev" \
        --data "$OUT/more10/data" --shards 0-10 "${replays[@]}" --lr 1e-4 --max-steps 2000 --threads 1 \
        --training-arg loss_kd_weight=1.0 --train-flow-steps 1 --out "$OUT/$name-round12"
    # Round 13: two consolidation stages, no new responses: the same data and replays with the replayed part at
    # 77.5 % of the mix (a seeded half of the replay pool), 2,000 steps each, the second from the first with seed 1.
    round13=(--config docs/research/recipes/train_smollm2_round5.yaml --data "$OUT/more10/data" --shards 0-10 "${replays[@]}"
             --replay-fraction 0.775 --lr 1e-4 --max-steps 2000 --threads 1 --training-arg loss_kd_weight=1.0
             --train-flow-steps 1)
    hf-chainflow train "${round13[@]}" --init-from "$OUT/$name-round12" --seed 0 --out "$OUT/$name-round13a"
    hf-chainflow train "${round13[@]}" --init-from "$OUT/$name-round13a" --seed 1 --out "$OUT/$name"
done
# Round 14, ChainFlow only (run on one GPU): one stage over the whole train split of the response corpus (30,929
# responses), batch 512, lr 2e-4 over a 900-step schedule; the shipped file is its step-500 checkpoint (the device
# call's time limit stopped it there; docs/research/training-rounds.md, "A fourteenth stage").
hf-chainflow prepare --corpus corpus/smollm2-135m-instruct --split train --out "$OUT/full"
hf-chainflow train --data "$OUT/full" --init-from "$OUT/chainflow" --out "$OUT/chainflow-round14" --max-steps 900 \
    --batch-size 512 --lr 2e-4 --seed 0 --save-steps 100 --save-total-limit 5 --train-flow-steps 1 \
    --training-arg lr_scheduler_type=linear --training-arg warmup_steps=100 --training-arg loss_kd_weight=1.0
mv "$OUT/chainflow" "$OUT/chainflow-round13"
cp -r "$OUT/chainflow-round14/checkpoint-500" "$OUT/chainflow"
for name in chainflow flashmap; do
    hf-chainflow eval-offline --drafter "$OUT/$name" --data "$OUT/data" --shards 21-25 --out "$OUT/eval-$name" \
        --max-windows 4000 --tree 8x4 --tree-budget 12 --max-tree-windows 600 --threads 1
done
