"""Cut a prepared folder's plan into response files, one per range of shards, so that several `hf-chainflow prepare`
processes can fill one folder side by side (docs/research/device/stage.sh, `prep_parallel`).

`prepare` writes shard `s` from the plan's sequences `s * shard_size .. (s + 1) * shard_size - 1` (plan.json, fixed
by the folder's first run). A file holding exactly those rows, in plan order, prepared with `--responses FILE
--keep-order` and the folder's settings, gives the same shards numbered from 0; renamed to `first + j` they are the
folder's own, and the folder's next `prepare` run takes them as finished (the shard files are the truth) and
rebuilds its index, shortlist and manifest over them.

    python plan_parts.py DATA_DIR CORPUS SPLIT FIRST END PARTS OUT_DIR

writes OUT_DIR/part-K.jsonl for PARTS contiguous ranges of shards FIRST..END-1 and prints `FIRST_SHARD PATH` for each.
"""

import json
import sys
from pathlib import Path

from hf_chainflow.training.corpus import ResponseCorpus

FIELDS = ("id", "domain", "language", "source", "prompt_ids", "response_ids", "finish")


def main(data_dir, corpus, split, first, end, parts, out_dir):
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    first, end, parts = int(first), int(end), int(parts)
    plan = json.loads((data_dir / "plan.json").read_text())
    size = json.loads((data_dir / "manifest.json").read_text())["shard_size"]
    rows = ResponseCorpus(corpus).responses(split)
    out_dir.mkdir(parents=True, exist_ok=True)
    bounds = [first + (end - first) * k // parts for k in range(parts + 1)]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if a == b:
            continue
        path = out_dir / f"part-{k}.jsonl"
        with path.open("w") as f:
            for i in plan[a * size:b * size]:
                f.write(json.dumps({key: rows[i][key] for key in FIELDS}) + "\n")
        print(a, path)


if __name__ == "__main__":
    main(*sys.argv[1:])
