"""Save a trained drafter in float16 (the shipped format) without its generation config."""
import sys
from pathlib import Path
import torch
from hf_chainflow import ChainFlowDrafter
src, dst = sys.argv[1], Path(sys.argv[2])
d = ChainFlowDrafter.from_pretrained(src).to(torch.float16)
d.save_pretrained(dst)
(dst / "generation_config.json").unlink(missing_ok=True)
print("exported", src, "->", dst, sorted(p.name for p in dst.iterdir()))
