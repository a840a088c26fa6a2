"""Training under `torchrun` with two CPU processes (gloo): the processes stay in step, and `hf-chainflow train`
writes once and counts every process's windows.  Slow: each launch starts two Python processes."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _windows import TINY_DRAFTER as DRAFTER


def launch(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_CHAINFLOW_TRACEBACK": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_two_processes_stay_in_step(tiny_prepared):
    # The VAE pre-training averages its gradients across processes by hand (the Trainer's DDP wrapper comes later):
    # with the same initial weights and different batches per process, the VAEs must still be equal afterwards.
    script = tiny_prepared / "check.py"
    script.write_text(textwrap.dedent(f"""
        import hashlib, json, torch, torch.distributed as dist
        from transformers import AutoModelForCausalLM
        from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
        from hf_chainflow.training.windows import ChainFlowWindowDataset
        from hf_chainflow.training.prepared_data import read_shortlist, state_statistics
        from hf_chainflow.training.trainer import ChainFlowTrainer
        from hf_chainflow.training.arguments import ChainFlowTrainingArguments

        torch.set_num_threads(1)
        target = AutoModelForCausalLM.from_pretrained("target").eval().requires_grad_(False)
        config = ChainFlowConfig.for_target(target.config, shortlist=read_shortlist("data"), **{DRAFTER!r})
        torch.manual_seed(0)
        drafter = ChainFlowDrafter(config).bind_target(target)
        drafter.set_state_statistics(*state_statistics("data"))
        args = ChainFlowTrainingArguments(output_dir="api", max_steps=4, per_device_train_batch_size=4,
                                          vae_pretrain_steps=3, report_to="none", use_cpu=True, save_strategy="no",
                                          disable_tqdm=True)
        trainer = ChainFlowTrainer(model=drafter, args=args,
                                   train_dataset=ChainFlowWindowDataset.for_drafter("data", drafter))

        def digest(module):
            return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest()

        first = next(iter(trainer.get_train_dataloader()))["target_tokens"]
        trainer.pretrain_vae()
        after_vae = digest(trainer.drafter.vae)
        trainer.train()
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, dict(batch=first.tolist(), vae=after_vae, all=digest(trainer.drafter)))
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(dict(world=args.world_size, ranks=found)))
    """))
    run = launch(tiny_prepared, str(script))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["world"] == 2
    first, second = result["ranks"]
    assert first["batch"] != second["batch"]  # each process trains on its own windows
    assert first["vae"] == second["vae"] and first["all"] == second["all"]


@pytest.mark.slow
def test_cli_train_under_torchrun(tiny_prepared):
    train = ["-m", "hf_chainflow.cli", "train", "--target", "target", "--data", "data", "--max-steps", "6",
             "--batch-size", "4", "--vae-pretrain-steps", "2", "--save-steps", "1000", "--threads", "1",
             *[f"--drafter-arg={k}={v}" for k, v in DRAFTER.items()]]
    # Without `use_cpu` transformers sets up no distributed training on a machine without GPUs: refused, not run twice.
    run = launch(tiny_prepared, *train, "--out", "refused")
    assert run.returncode != 0
    assert "launched as 2 processes" in run.stderr and "--training-arg use_cpu=true" in run.stderr
    assert not (tiny_prepared / "refused").exists()
    run = launch(tiny_prepared, *train, "--out", "drafter", "--training-arg", "use_cpu=true")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("saved drafter to drafter") == 1  # the main process reports, once
    summary = json.loads((tiny_prepared / "drafter" / "train_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["steps"] == 6
    assert summary["windows_seen"] == 6 * 4 * 2  # steps x per-process batch x processes
    assert (tiny_prepared / "drafter" / "model.safetensors").is_file()
