"""Summarise `loop_merge_bench.sh`'s runs: per pass and side, batch 1 (the journaled bench) and batch 1/2 of the
batched bench: tokens/s of `ar` and `tree+lookup`, the speedup, tau; then the spread of the speedups.

    python docs/research/scripts/summarise_loop_merge.py runs/loop-merge > docs/research/results/loop-merge/summary.md
"""

import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows, speed = [], {}
for side in ("old", "new"):
    for p in (1, 2):
        b1 = json.loads((out / f"b1-{side}-{p}" / "results.json").read_text())
        arms = b1["arms"]
        ar, tl = arms["ar@bfloat16"], arms["tree+lookup@bfloat16"]
        b2 = json.loads((out / f"b2-{side}-{p}" / "batched_results.json").read_text())
        r = {"side": side, "pass": p, "b1 ar tok/s": ar["tokens_per_second"], "b1 tree+lookup tok/s":
             tl["tokens_per_second"], "b1 speedup": tl["speedup"], "b1 tau": tl["tau"]}
        for bs in ("1", "2"):
            cell = b2["by_batch_size"][bs]
            r[f"batched b{bs} speedup"] = cell["tree+lookup@bfloat16"]["speedup"]
            r[f"batched b{bs} tau"] = cell["tree+lookup@bfloat16"]["tau"]
        rows.append(r)
keys = list(rows[0])
print("| " + " | ".join(keys) + " |")
print("|" + "---|" * len(keys))
for r in rows:
    print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
print()
for k in ("b1 speedup", "batched b1 speedup", "batched b2 speedup"):
    old = [r[k] for r in rows if r["side"] == "old"]
    new = [r[k] for r in rows if r["side"] == "new"]
    print(f"- {k}: old {min(old):.3f}-{max(old):.3f} (spread {max(old) - min(old):.3f}), "
          f"new {min(new):.3f}-{max(new):.3f} (spread {max(new) - min(new):.3f}); "
          f"mean new / mean old {sum(new) / len(new) / (sum(old) / len(old)):.3f}")
