"""A LoRA language adapter for a trained ChainFlow drafter: one base drafter, one small adapter per language.

    python examples/language_adapter.py --target MODEL_DIR --drafter DRAFTER_DIR --language tr \
        --prompts tr-train.jsonl --heldout tr-heldout.jsonl --out runs/tr

1. The target answers the new language's prompts and its states are cached, as for any drafter (`OUT/data`).
2. A LoRA adapter over the drafter's flow network and feedback heads trains on them with the paper's adaptation
   rate; the base drafter's weights stay frozen (`OUT/adapters/LANGUAGE`, a few hundred KB for a small drafter).
3. Held-out tau of the base drafter and of the adapter, on the new language's responses.
4. The adapter merged into a copy of the drafter (`OUT/drafter-LANGUAGE`), a plain drafter for
   `generate(assistant_model=...)`. To keep several languages on one base instead, load each adapter with
   `hf_chainflow.training.adapters.load_language_adapter` and switch with `model.set_adapter(name)`.

The drafter keeps its draft vocabulary (the tokens of its first training data): new-language tokens outside it are
never drafted, so build the first drafter from data of every language you will adapt to.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.training.adapters import add_language_adapter, lora_config
from hf_chainflow.training.windows import ChainFlowWindowDataset
from hf_chainflow.training.prepare import prepare
from hf_chainflow.training.evaluation import evaluate_offline
from hf_chainflow.targets import KNOWN_TARGETS, load_target
from hf_chainflow.training.trainer import ChainFlowTrainer
from hf_chainflow.training.adaptation import adaptation_arguments


def main(target: str, drafter: str, language: str, prompts, heldout_prompts, out: str, *, rank: int = 8,
         max_new_tokens: int = 256, generation_dtype: str = "bfloat16", max_steps: int = 1000, batch_size: int = 64,
         learning_rate: float = 1.2e-4, seed: int = 0) -> dict:
    """Train the adapter `language`; returns `{"base": report, "adapter": report, "adapter_dir", "merged_dir"}`,
    the reports those of `hf_chainflow.training.evaluation.evaluate_offline` on the held-out responses."""
    out = Path(out)
    model, tokenizer = (load_target(target) if target in KNOWN_TARGETS else  # a known name, or a model folder
                        (AutoModelForCausalLM.from_pretrained(target).eval(), AutoTokenizer.from_pretrained(target)))
    base = ChainFlowDrafter.from_pretrained(drafter, target=model)  # bound to the target
    model.requires_grad_(False)
    for name, rows in (("data", prompts), ("data-heldout", heldout_prompts)):
        prepare(model, tokenizer, out / name, prompts=rows, max_new_tokens=max_new_tokens,
                generation_dtype=getattr(torch, generation_dtype))
    windows = ChainFlowWindowDataset.for_drafter(out / "data", base.config)
    heldout = ChainFlowWindowDataset.for_drafter(out / "data-heldout", base.config)
    reports = {"base": evaluate_offline(base, heldout, num_tokens=3)}

    adapted = add_language_adapter(base, language, lora_config(r=rank))  # a PeftModel; base weights frozen
    args = adaptation_arguments(str(out / "run"), learning_rate=learning_rate, max_steps=max_steps,
                                per_device_train_batch_size=batch_size, seed=seed, save_strategy="no",
                                logging_steps=max(1, max_steps // 10), report_to="none",
                                dataloader_pin_memory=torch.cuda.is_available())
    ChainFlowTrainer(model=adapted, args=args, train_dataset=windows).train()
    adapted.save_pretrained(str(out / "adapters"))  # OUT/adapters/LANGUAGE/adapter_model.safetensors
    reports["adapter"] = evaluate_offline(adapted, heldout, num_tokens=3)

    merged = adapted.merge_and_unload()  # the base drafter with the adapter folded into its weights
    merged.save_pretrained(str(out / f"drafter-{language}"))
    print(f"held-out tau on {language!r} (chain of 3): base drafter {reports['base']['tau']:.3f}, with the adapter "
          f"{reports['adapter']['tau']:.3f}; adapter in {out / 'adapters' / language}, merged drafter in "
          f"{out / f'drafter-{language}'}")
    return {**reports, "adapter_dir": out / "adapters" / language, "merged_dir": out / f"drafter-{language}"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, what in (("--target", "known target name or local model folder"),
                       ("--drafter", "the trained base drafter's folder"), ("--language", "the adapter's name, e.g. tr"),
                       ("--prompts", "JSONL of training prompts in that language"),
                       ("--heldout", "JSONL of held-out prompts in that language"),
                       ("--out", "output folder (data, adapter, merged drafter)")):
        parser.add_argument(flag, required=True, help=what)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=1.2e-4)
    args = parser.parse_args()
    main(args.target, args.drafter, args.language, args.prompts, args.heldout, args.out, rank=args.rank,
         max_steps=args.max_steps, learning_rate=args.lr)
