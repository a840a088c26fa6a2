"""Train a ChainFlow drafter for your own target: prepare -> train -> evaluate.

    python examples/train_drafter.py --target MODEL_DIR --prompts train.jsonl --heldout heldout.jsonl --out runs/mine

1. **Prepare**: the target answers the prompts greedily, then one float32 pass caches its final hidden states
   (`OUT/data`, `OUT/data-heldout`; resumable: the same command continues a stopped run).
2. **Train**: a fresh drafter sized for the target (`ChainFlowConfig.for_target`), its draft vocabulary the tokens
   of the responses, trained with `ChainFlowTrainer` (`OUT/drafter`).
3. **Evaluate**: offline acceptance length tau on the held-out responses, a chain and a tree, and the serving walk
   (the tau a serving loop would see; `OUT/eval/offline_eval.json`, `acceptance.png`).

Prompts are JSONL rows with a `prompt` (and optional `id`, `domain`), or a list of such dicts. Then
`python examples/generate.py --target MODEL_DIR --drafter OUT/drafter` generates with the drafter.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.training.windows import ChainFlowWindowDataset
from hf_chainflow.training.prepare import prepare
from hf_chainflow.training.prepared_data import read_shortlist, state_statistics
from hf_chainflow.training.evaluation import evaluate_offline
from hf_chainflow.targets import KNOWN_TARGETS, load_target
from hf_chainflow.training.trainer import ChainFlowTrainer
from hf_chainflow.training.arguments import ChainFlowTrainingArguments


def main(target: str, prompts, heldout_prompts, out: str, *, max_new_tokens: int = 256,
         generation_dtype: str = "bfloat16", max_steps: int = 3000, batch_size: int = 64, learning_rate: float = 5e-4,
         vae_pretrain_steps: int = 600, drafter_config: dict | None = None, tree: tuple[int, int] = (8, 4),
         tree_budget: int | None = 12, walk_sequences: int = 100, seed: int = 0) -> dict:
    """Prepare, train and evaluate; returns the offline report (`tau`, `tree`, `walk`, ...) of the trained drafter.

    `drafter_config`: `ChainFlowConfig` fields of the fresh drafter (e.g. `{"num_blocks": 2}`); the defaults are
    the paper's sizes for the target. The trained drafter drafts a chain of 3 tokens by default; set
    `drafter.generation_config` (`draft_mode="tree"`, `tree_width`, `tree_depth`, `tree_budget`) to serve a tree.
    """
    out = Path(out)
    model, tokenizer = (load_target(target) if target in KNOWN_TARGETS else  # a known name, or a model folder
                        (AutoModelForCausalLM.from_pretrained(target).eval(), AutoTokenizer.from_pretrained(target)))
    model.requires_grad_(False)
    for name, rows in (("data", prompts), ("data-heldout", heldout_prompts)):
        prepare(model, tokenizer, out / name, prompts=rows, max_new_tokens=max_new_tokens,
                generation_dtype=getattr(torch, generation_dtype))

    data = out / "data"
    config = ChainFlowConfig.for_target(model.config, shortlist=read_shortlist(data), **(drafter_config or {}))
    torch.manual_seed(seed)
    drafter = ChainFlowDrafter(config)
    drafter.set_state_statistics(*state_statistics(data))  # the drafter works in standardised state units
    args = ChainFlowTrainingArguments(output_dir=str(out / "drafter"), max_steps=max_steps,
                                      per_device_train_batch_size=batch_size, learning_rate=learning_rate,
                                      vae_pretrain_steps=vae_pretrain_steps, seed=seed, save_strategy="no",
                                      logging_steps=max(1, max_steps // 10), report_to="none",
                                      dataloader_pin_memory=torch.cuda.is_available())
    trainer = ChainFlowTrainer(model=drafter, args=args, target=model,
                               train_dataset=ChainFlowWindowDataset.for_drafter(data, config))
    trainer.train()
    trainer.save_model(str(out / "drafter"))  # config.json, model.safetensors, generation_config.json

    heldout = ChainFlowWindowDataset.for_drafter(out / "data-heldout", config)
    report = evaluate_offline(drafter, heldout, num_tokens=3, tree=tree, tree_budget=tree_budget,
                              walk_sequences=walk_sequences, output_dir=out / "eval")
    walk = report["walk"]
    print(f"held-out tau: chain of 3 {report['tau']:.3f} (serving walk {walk['chain']['tau']:.3f}), tree "
          f"{tree[0]}x{tree[1]} cut to {tree_budget} {report['tree']['tau']:.3f} (walk {walk['tree']['tau']:.3f}); "
          f"drafter saved to {out / 'drafter'}")
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="known target name or local model folder")
    parser.add_argument("--prompts", required=True, help="JSONL of training prompts")
    parser.add_argument("--heldout", required=True, help="JSONL of held-out prompts for the evaluation")
    parser.add_argument("--out", required=True, help="output folder (data, drafter, evaluation)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--generation-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    args = parser.parse_args()
    main(args.target, args.prompts, args.heldout, args.out, max_new_tokens=args.max_new_tokens,
         generation_dtype=args.generation_dtype, max_steps=args.max_steps, batch_size=args.batch_size,
         learning_rate=args.lr)
