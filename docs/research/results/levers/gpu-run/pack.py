"""Pack a trained drafter: float16 weights, config, card, summary and training log into one NAME.tar.xz."""
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

name, src, log, dst = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
cfg = json.loads((src / "config.json").read_text())
tmp = Path(tempfile.mkdtemp()) / name
if cfg.get("model_type") == "chainflow":
    from hf_chainflow import ChainFlowDrafter
    d = ChainFlowDrafter.from_pretrained(src).to(torch.float16)
    d.save_pretrained(tmp)
    (tmp / "generation_config.json").unlink(missing_ok=True)
else:  # DFlash: a plain transformers model folder
    from transformers import AutoModel
    d = AutoModel.from_pretrained(src, dtype=torch.float16)
    d.save_pretrained(tmp)
for extra in ("README.md", "train_summary.json", "trainer_state.json"):
    for base in (src, src.parent):
        if (base / extra).exists() and not (tmp / extra).exists():
            shutil.copy(base / extra, tmp / extra)
if log.exists():
    shutil.copy(log, tmp / "train.log")
with tarfile.open(dst, "w:xz", preset=6) as tar:
    tar.add(tmp, arcname=name)
print("packed", src, "->", dst, sorted(p.name for p in tmp.iterdir()))
