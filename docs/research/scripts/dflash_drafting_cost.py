"""Micro-benchmark (not a test): drafting seconds per round of the shipped ChainFlow drafter (its default tree arm
and a chain of 3, from `drafter.last_stats`) and of a DFlash drafter of the same size (stock transformers'
`DFlashTokenCandidateGenerator.get_candidates` timed: the drafter's forward, the target's LM head over the masks,
the argmax), on the first evaluation prompts, with the target's plain step for scale.

    python docs/research/scripts/dflash_drafting_cost.py [--dflash DIR] [--prompts 4] [--max-new-tokens 64] [--threads 1]

Without `--dflash`, a randomly initialised drafter of docs/research/recipes/train_smollm2_dflash.yaml is timed (the
cost of a round does not depend on the weights; a random drafter's rounds add one context state each, a trained
one's a few: a little more projection work).
"""

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import yaml
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.bench.prompts import load_prompts, stratified_selection, tokenize_prompts
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.training.dflash import build_dflash_drafter, load_dflash_drafter, parameter_count
from hf_chainflow.targets import load_target

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "train_smollm2_dflash.yaml"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dflash", help="a trained DFlash drafter folder (default: the recipe's sizes, random)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2-135m-instruct")
    if args.dflash:
        dflash = load_dflash_drafter(args.dflash, target)
    else:
        dflash = build_dflash_drafter(target, seed=0, **yaml.safe_load(RECIPE.read_text())["drafter"]).eval()
    chainflow = ChainFlowDrafter.from_pretrained(default_drafter_path(), target=target).eval()
    defaults = copy.deepcopy(chainflow.generation_config)
    prompts = tokenize_prompts(tokenizer, stratified_selection(load_prompts(None), args.prompts))

    rounds = []
    original = DFlashTokenCandidateGenerator.get_candidates

    def timed(self, input_ids, *a, **kw):
        start = time.perf_counter()
        out = original(self, input_ids, *a, **kw)
        if out[0].shape[1] > input_ids.shape[1]:  # a round that drafted (the first call only hands over)
            rounds.append(time.perf_counter() - start)
        return out

    DFlashTokenCandidateGenerator.get_candidates = timed
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    stats = {"tree": [], "chain": []}
    plain = []
    with torch.inference_mode():
        for p in prompts:
            ids, mask = p.input_ids, torch.ones_like(p.input_ids)
            start = time.perf_counter()
            out = target.generate(ids, attention_mask=mask, **kw)
            plain.append((time.perf_counter() - start) / (out.shape[1] - ids.shape[1]))
            target.generate(ids, attention_mask=mask, assistant_model=dflash, speculation_type="dflash", **kw)
            for mode in stats:
                chainflow.generation_config.draft_mode = mode
                if mode == "chain":
                    chainflow.generation_config.lookup_num_tokens = None
                target.generate(ids, attention_mask=mask, assistant_model=chainflow, **kw)
                s = chainflow.last_stats
                stats[mode].append(s.draft_time / max(s.rounds, 1))
            chainflow.generation_config = copy.deepcopy(defaults)
    print(json.dumps({
        "threads": args.threads, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "parameters": {"dflash": parameter_count(dflash), "chainflow": parameter_count(chainflow)},
        "plain_step_ms": 1e3 * statistics.median(plain),
        "draft_ms_per_round": {"dflash": 1e3 * statistics.median(rounds), "dflash_rounds": len(rounds),
                               "chainflow_tree": 1e3 * statistics.median(stats["tree"]),
                               "chainflow_chain3": 1e3 * statistics.median(stats["chain"])},
    }, indent=1))


if __name__ == "__main__":
    main()
