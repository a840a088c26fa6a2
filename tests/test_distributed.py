"""Training under `torchrun` with two CPU processes (gloo): the processes stay in step, and `hf-chainflow train`
writes once and counts every process's windows.  Slow: each launch starts two Python processes."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_chainflow.cli import main
from hf_chainflow.targets import load_tokenizer
from hf_chainflow.testing import tiny_target

PROMPTS = Path("/work/shared/data/prompts/train.jsonl")
DRAFTER = {"num_blocks": 1, "num_heads": 2, "ffn_multiplier": 2, "vae_num_layers": 1, "vae_num_heads": 2,
           "path_hidden_size": 16, "markov_rank": 8}


def launch(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_CHAINFLOW_TRACEBACK": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    if not PROMPTS.is_file():
        pytest.skip(f"needs the shared prompts at {PROMPTS}")
    tmp = tmp_path_factory.mktemp("ddp")
    tokenizer = load_tokenizer()
    target = tiny_target("llama", vocab_size=len(tokenizer), hidden_size=64, num_layers=2)
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    target.generation_config.pad_token_id = tokenizer.pad_token_id
    target.save_pretrained(tmp / "target")
    tokenizer.save_pretrained(tmp / "target")
    (tmp / "prompts.jsonl").write_text("\n".join(PROMPTS.read_text().splitlines()[:16]) + "\n")
    assert main(["prepare", "--target", str(tmp / "target"), "--prompts", str(tmp / "prompts.jsonl"), "--out",
                 str(tmp / "data"), "--max-new-tokens", "32", "--dtype", "float32", "--threads", "1"]) == 0
    return tmp


@pytest.mark.slow
def test_two_processes_stay_in_step(prepared):
    # The VAE pre-training averages its gradients across processes by hand (the Trainer's DDP wrapper comes later):
    # with the same initial weights and different batches per process, the VAEs must still be equal afterwards.
    script = prepared / "check.py"
    script.write_text(textwrap.dedent(f"""
        import hashlib, json, torch, torch.distributed as dist
        from transformers import AutoModelForCausalLM
        from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
        from hf_chainflow.data import ChainFlowWindowDataset, read_shortlist, state_statistics
        from hf_chainflow.trainer import ChainFlowTrainer, ChainFlowTrainingArguments

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
    run = launch(prepared, str(script))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["world"] == 2
    first, second = result["ranks"]
    assert first["batch"] != second["batch"]  # each process trains on its own windows
    assert first["vae"] == second["vae"] and first["all"] == second["all"]


@pytest.mark.slow
def test_cli_train_under_torchrun(prepared):
    train = ["-m", "hf_chainflow.cli", "train", "--target", "target", "--data", "data", "--max-steps", "6",
             "--batch-size", "4", "--vae-pretrain-steps", "2", "--save-steps", "1000", "--threads", "1",
             *[f"--drafter-arg={k}={v}" for k, v in DRAFTER.items()]]
    # Without `use_cpu` transformers sets up no distributed training on a machine without GPUs: refused, not run twice.
    run = launch(prepared, *train, "--out", "refused")
    assert run.returncode != 0
    assert "launched as 2 processes" in run.stderr and "--training-arg use_cpu=true" in run.stderr
    assert not (prepared / "refused").exists()
    run = launch(prepared, *train, "--out", "drafter", "--training-arg", "use_cpu=true")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("saved drafter to drafter") == 1  # the main process reports, once
    summary = json.loads((prepared / "drafter" / "train_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["steps"] == 6
    assert summary["windows_seen"] == 6 * 4 * 2  # steps x per-process batch x processes
    assert (prepared / "drafter" / "model.safetensors").is_file()
