"""`hf-chainflow demo` on the real SmolLM2 target and the shipped drafter: every output that differs from plain
generation is classified as the bench classifies it, and float32 has none."""

import pytest
import torch

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.commands.demo_run import DEMO_PROMPTS, run_demo


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_demo_classifies_every_difference_from_plain_generation(dtype):
    from hf_chainflow.targets import load_target

    target, tok = load_target(dtype=dtype)
    drafter = ChainFlowDrafter.from_pretrained(default_drafter_path(), target=target)
    lines = []
    summary = run_demo(target, tok, drafter, DEMO_PROMPTS, max_new_tokens=48, print_fn=lines.append)
    differences = summary["differences"]
    if dtype == torch.float32:
        assert differences == [] and all(summary["identical"]), "\n".join(lines)
    else:
        assert all(d["kind"] == "near_tie" for d in differences), "\n".join(lines)
        printed = [line for line in lines if ": first differs at new token" in line]
        assert len(printed) == len(differences) and all("near-tie" in line for line in printed), "\n".join(lines)
