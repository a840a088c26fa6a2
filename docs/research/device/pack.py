"""Pack trained drafters for the trip back from a lent GPU machine (at most 8 files of 16 MiB each come back).

    python pack.py common RUN [RUN ...]               # the largest step every run has complete, or nothing
    python pack.py pack NAME RUN STEP|last LOG DST    # that step of RUN as DST (NAME.tar.xz)

A run (an `hf-chainflow train --out` folder) holds a step when its final drafter is there (`model.safetensors`
beside `train_summary.json`, whose `steps` it is) or a complete checkpoint (`checkpoint-N/` with its
`trainer_state.json`, which the Trainer writes last). `last` is the largest. A run stopped by its time limit keeps
its checkpoints, so a killed training still packs; `common` lets drafters compared at one budget be packed at the
same step. The archive holds the drafter in float16 (ChainFlow or DFlash), its config and generation config, the
model card, summary or trainer state that came with it, the training log, and `packed.json` (what was packed).
"""

import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import torch


def steps(run: Path) -> dict[int, Path]:
    """{step: folder} of every complete drafter in `run`."""
    found = {}
    for ckpt in run.glob("checkpoint-*"):
        if (ckpt / "trainer_state.json").is_file() and (ckpt / "model.safetensors").is_file():
            found[int(ckpt.name.split("-")[1])] = ckpt
    summary = run / "train_summary.json"
    if summary.is_file() and (run / "model.safetensors").is_file():
        found[json.loads(summary.read_text())["steps"]] = run
    return found


def common(*runs):
    shared = set.intersection(*(set(steps(Path(r))) for r in runs))
    if shared:
        print(max(shared))


def pack(name, run, step, log, dst):
    run, log, dst = Path(run), Path(log), Path(dst)
    have = steps(run)
    if not have:
        sys.exit(f"{run}: no complete drafter to pack")
    step = max(have) if step == "last" else int(step)
    src = have[step]
    cfg = json.loads((src / "config.json").read_text())
    tmp = Path(tempfile.mkdtemp()) / name
    if cfg.get("model_type") == "chainflow":
        from hf_chainflow import ChainFlowDrafter
        ChainFlowDrafter.from_pretrained(src).to(torch.float16).save_pretrained(tmp)
    else:  # DFlash: a plain transformers model folder
        from transformers import AutoModel
        AutoModel.from_pretrained(src, dtype=torch.float16).save_pretrained(tmp)
    for extra in ("generation_config.json", "README.md", "train_summary.json", "trainer_state.json"):
        if (src / extra).is_file() and not (tmp / extra).exists():
            shutil.copy(src / extra, tmp / extra)
    if log.is_file():
        shutil.copy(log, tmp / "train.log")
    (tmp / "packed.json").write_text(json.dumps(
        {"name": name, "source": str(src), "step": step, "final": src == run, "steps_available": sorted(have)},
        indent=1))
    with tarfile.open(dst, "w:xz", preset=6) as tar:
        tar.add(tmp, arcname=name)
    shutil.rmtree(tmp.parent)
    print(f"packed {name}: step {step} of {run} ({'final' if src == run else src.name}) -> {dst}")


if __name__ == "__main__":
    {"common": common, "pack": pack}[sys.argv[1]](*sys.argv[2:])
