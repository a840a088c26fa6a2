"""How far left padding moves the real target's float32 logits (the batched bench's float32 padded tolerance).

Scores each evaluation prompt alone and inside a left-padded batch of 8 (the batch's widest prompt sets the padding)
in float32, and reports, over every prompt position, the largest |change| of a logit and of the gap between the two
top logits. Usage: python docs/research/scripts/padding_float32_drift.py --limit 32 --threads 2
"""

import argparse
import json

import torch

from hf_chainflow.bench.batched import left_padded
from hf_chainflow.bench.prompts import load_prompts, stratified_selection, tokenize_prompts
from hf_chainflow.targets import load_model_and_tokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model_and_tokenizer("smollm2-135m-instruct", torch.float32)
    prompts = tokenize_prompts(tok, stratified_selection(load_prompts(), args.limit))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    worst_logit, worst_gap, positions = 0.0, 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(prompts), args.batch_size):
            batch = prompts[i: i + args.batch_size]
            ids, mask = left_padded(batch, pad)  # (B, W)
            padded = model(input_ids=ids, attention_mask=mask).logits  # (B, W, V)
            for b, p in enumerate(batch):
                alone = model(input_ids=p.input_ids).logits[0]  # (L, V)
                inside = padded[b, ids.shape[1] - alone.shape[0]:]  # (L, V)
                worst_logit = max(worst_logit, float((alone - inside).abs().max()))
                gaps = [x.topk(2, -1).values for x in (alone, inside)]  # (L, 2) each
                worst_gap = max(worst_gap, float(((gaps[0][:, 0] - gaps[0][:, 1]) -
                                                  (gaps[1][:, 0] - gaps[1][:, 1])).abs().max()))
                positions += alone.shape[0]
    print(json.dumps({"prompts": len(prompts), "positions": positions, "batch_size": args.batch_size,
                      "max_abs_logit_change": worst_logit, "max_top2_gap_change": worst_gap}, indent=1))


if __name__ == "__main__":
    main()
