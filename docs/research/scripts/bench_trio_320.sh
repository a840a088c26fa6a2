#!/usr/bin/env bash
# Issue 40's 320-prompt bench ([../results/bench-trio-320/README.md]), resumed from its committed journal, in one
# command:
#
#   MINUTES=150 bash docs/research/scripts/bench_trio_320.sh     # run at most 150 minutes, keep what finished
#   bash docs/research/scripts/bench_trio_320.sh status          # where it stands: runs no prompt, any machine
#
# 1. Seeds runs/bench-trio-320/runs.jsonl from the committed part holding the most finished prompts
#    (partN/runs.jsonl), unless the local journal holds as many already.
# 2. Refuses a CPU of another kind than the journal's first part's (a 2-core AMD EPYC Zen 4 with AVX-512 BF16):
#    the run's pooled figures are for one kind of machine (the bench itself would only warn).
# 3. Resumes the bench; after MINUTES (unset: no limit) it is stopped as Ctrl-C stops it, keeping every finished
#    prompt. Run it with nothing else on the machine.
# 4. Not finished: copies the journal into the record as partN/runs.jsonl (N: its parts so far), to commit. Finished:
#    copies the results, the journal and the plots into the record and writes the comparisons (compare/) that the
#    reading needs; the record's README, docs/results.md, docs/dflash.md and the DFlash model card are then written
#    by hand from them.
set -euo pipefail
cd "$(dirname "$0")/../../.."
RECORD=docs/research/results/bench-trio-320
OUT=${OUT:-runs/bench-trio-320}
ARGS=(--limit 320 --dtypes bfloat16 --max-new-tokens 128 --threads 2 --compile-drafting
      --drafter flashmap=docs/research/results/cpu-trio/drafters/flashmap
      --dflash hf_chainflow/checkpoints/smollm2-135m-instruct-dflash
      --arms ar,pld,chain,tree,tree+lookup,flashmap-tree,dflash --output-dir "$OUT" --no-progress --resume)

prompts() {  # finished prompts in a journal (0 where there is none)
    if [ -f "$1" ]; then grep -c '"type": "prompt"' "$1" || true; else echo 0; fi
}

# 1. the journal
mkdir -p "$OUT"
best=$(for f in "$RECORD"/part*/runs.jsonl; do echo "$(prompts "$f") $f"; done | sort -n | tail -1)
if [ "$(prompts "$OUT/runs.jsonl")" -lt "${best%% *}" ]; then
    cp "${best#* }" "$OUT/runs.jsonl"
    echo "seeded $OUT/runs.jsonl from ${best#* }"
fi
done_before=$(prompts "$OUT/runs.jsonl")
echo "finished prompts: $done_before of 320"
if [ "${1:-}" = status ]; then
    hf-chainflow bench "${ARGS[@]}" --partial-report
    exit 0
fi

# 2. the machine
python - "$OUT/runs.jsonl" <<'EOF'
import json, sys
from hf_chainflow.bench.journal import cpu_kind_differences
from hf_chainflow.bench.machine import machine_info
first = next(json.loads(l) for l in open(sys.argv[1]) if '"type": "part"' in l)
differ = cpu_kind_differences(first["machine"], machine_info())
if differ:
    sys.exit(f"bench_trio_320.sh: this CPU is another kind than part 0's ({', '.join(differ)} differ: "
             f"{ {k: first['machine'][k] for k in differ} } there); the run must finish on that kind of machine.")
EOF

# 3. the run
if [ -n "${MINUTES:-}" ]; then
    timeout --signal=INT --kill-after=300 "${MINUTES}m" hf-chainflow bench "${ARGS[@]}" || true
else
    hf-chainflow bench "${ARGS[@]}"
fi

# 4. the record
done_now=$(prompts "$OUT/runs.jsonl")
if [ ! -f "$OUT/results.json" ] || [ "$done_now" -lt 320 ]; then
    [ "$done_now" -gt "$done_before" ] || { echo "no prompt finished in this part"; exit 1; }
    n=$(grep -c '"type": "part"' "$OUT/runs.jsonl")  # partN holds the journal of parts 1 to N
    mkdir -p "$RECORD/part$n" && cp "$OUT/runs.jsonl" "$RECORD/part$n/"
    echo "$done_now of 320 prompts finished: commit $RECORD/part$n/runs.jsonl and rerun this script on a machine of the same kind"
    exit 0
fi
cp "$OUT"/runs.jsonl "$OUT"/results.json "$OUT"/results.md "$OUT"/*.png "$RECORD/"
mkdir -p "$RECORD/compare"
for pair in "tree dflash" "chain dflash" "tree flashmap-tree" "tree+lookup dflash"; do
    set -- $pair
    python docs/research/scripts/compare_arms.py "$OUT/runs.jsonl" --a "$1" --b "$2" --out "$RECORD/compare/$1-vs-$2.md"
done
python docs/research/scripts/tau_for_bars.py "$RECORD/results.json" | tee "$RECORD/tau_for_bars.txt"
echo "finished: the results are in $RECORD; write its README, docs/results.md, docs/dflash.md and the model card"
