"""Generate with a ChainFlow drafter: `target.generate(..., assistant_model=drafter)` gives plain greedy output,
token for token, in fewer target forwards.

    python examples/generate.py                                   # SmolLM2-135M-Instruct and its shipped drafter
    python examples/generate.py --prompt "Write a haiku about rain." --mode chain
    python examples/generate.py --target MODEL_DIR --drafter DRAFTER_DIR   # your target and a drafter trained for it

For each prompt it prints the speculative answer, tokens per target forward (tau), the time against plain
`generate`, and whether both outputs are equal.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.targets import KNOWN_TARGETS, load_target

PROMPTS = ("Explain in two sentences why the sky is blue.",
           "Write a Python function that returns the n-th Fibonacci number.")


def main(target: str = "smollm2-135m-instruct", drafter: str | None = None, prompts=PROMPTS,
         max_new_tokens: int = 128, mode: str | None = None, dtype: str = "float32") -> list[dict]:
    """Generate each prompt speculatively and plainly; returns one dict per prompt (`text`, `tau`, `equal`, times).

    `drafter`: a drafter folder or Hub id; `None` takes the drafter shipped for a known `target`. `mode`: `"chain"`
    or `"tree"` overrides the drafter's own drafting mode (its `generation_config`); `None` keeps it.
    """
    if drafter is None and target not in KNOWN_TARGETS:
        raise ValueError(f"`drafter` is None, and no drafter is shipped for target {target!r}: pass the folder of a "
                         f"drafter trained for it (examples/train_drafter.py trains one).")
    dtype = getattr(torch, dtype)  # a known target name, or a local transformers model folder
    model, tokenizer = (load_target(target, dtype=dtype) if target in KNOWN_TARGETS else
                        (AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval(),
                         AutoTokenizer.from_pretrained(target)))
    # Binds the drafter to the target: it borrows the target's lm_head and embeddings.
    assistant = ChainFlowDrafter.from_pretrained(drafter or default_drafter_path(target), target=model)
    if mode is not None:
        assistant.generation_config.draft_mode = mode
    results = []
    for prompt in prompts:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        greedy = dict(max_new_tokens=max_new_tokens, do_sample=False)
        start = time.perf_counter()
        out = model.generate(**inputs, assistant_model=assistant, **greedy)
        speculative_s = time.perf_counter() - start
        tau = assistant.last_stats.tau
        start = time.perf_counter()
        plain = model.generate(**inputs, **greedy)
        plain_s = time.perf_counter() - start
        text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        equal = torch.equal(out, plain)
        print(f"--- {prompt}\n{text}\n[tau {tau:.2f}, {plain_s / speculative_s:.2f}x plain generate, "
              f"{'equal to' if equal else 'DIFFERENT from'} plain greedy output]")
        results.append({"prompt": prompt, "text": text, "tau": tau, "equal": equal, "speculative_seconds":
                        speculative_s, "plain_seconds": plain_s})
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct", help="known target name or local model folder")
    parser.add_argument("--drafter", help="drafter folder or Hub id (default: the one shipped for --target)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable; default: two built-in prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--mode", choices=("chain", "tree"), help="override the drafter's drafting mode")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    main(args.target, args.drafter, args.prompt or PROMPTS, args.max_new_tokens, args.mode, args.dtype)
