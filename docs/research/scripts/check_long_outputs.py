"""Check that speculative generation equals plain greedy generation over long answers on the real target (float32).

For each evaluation prompt: plain greedy `generate` up to `--max-new-tokens`, then the shipped drafter in three
serving modes (its shipped settings: an 8x4 tree cut to 12 nodes plus a prompt-lookup branch; the tree without the
branch; a chain of 3), each compared token for token with the plain output. A difference is reported with its first
diverging position and the plain model's logits for both tokens there (in float32 any difference is a bug).

    python docs/research/scripts/check_long_outputs.py --per-domain 1 --extra mt-bench:154 --max-new-tokens 400 --threads 2 \
        --out docs/research/results/long-outputs/long_outputs.jsonl
"""

import argparse
import copy
import json
import time
from pathlib import Path

import torch

import hf_chainflow  # noqa: F401  (installs the generate hook)
from hf_chainflow import ChainFlowDrafter
from hf_chainflow.bench import load_prompts, stratified_selection
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.targets import load_target

MODES = {  # overrides of the drafter's shipped generation config
    "shipped": {},
    "tree": {"lookup_num_tokens": None},
    "chain": {"draft_mode": "chain", "num_assistant_tokens": 3, "lookup_num_tokens": None},
}


def first_difference(target, prompt_ids, plain: list[int], spec: list[int]) -> dict:
    k = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    a = plain[k] if k < len(plain) else None
    b = spec[k] if k < len(spec) else None
    prefix = torch.cat([prompt_ids, torch.tensor([plain[:k]], dtype=torch.long)], 1)  # (1, P + k)
    with torch.no_grad():
        logits = target(input_ids=prefix).logits[0, -1].float()  # (V,)
    return {"position": k, "plain_token": a, "spec_token": b,
            "plain_logit": None if a is None else logits[a].item(),
            "spec_logit": None if b is None else logits[b].item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default=str(default_drafter_path()))
    parser.add_argument("--per-domain", type=int, default=1, help="evaluation prompts per domain")
    parser.add_argument("--extra", nargs="*", default=[], help="more evaluation prompt ids")
    parser.add_argument("--max-new-tokens", type=int, default=400)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True, help="a JSONL file, one line per (prompt, mode)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = load_prompts()
    by_id = {r["id"]: r for r in rows}
    unknown = [i for i in args.extra if i not in by_id]
    if unknown:
        parser.error(f"--extra names no evaluation prompt: {unknown}")
    prompts = stratified_selection(rows, args.per_domain * len({r["domain"] for r in rows}))
    prompts += [by_id[i] for i in args.extra if i not in {p["id"] for p in prompts}]
    target, tok = load_target(dtype=torch.float32)
    drafter = ChainFlowDrafter.from_pretrained(args.drafter, target=target)
    shipped = copy.deepcopy(drafter.generation_config)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    n = args.max_new_tokens
    for p in prompts:
        inputs = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
        start = inputs["input_ids"].shape[1]
        t0 = time.perf_counter()
        plain = target.generate(**inputs, do_sample=False, max_new_tokens=n)[0, start:].tolist()
        records = [{"id": p["id"], "domain": p["domain"], "mode": "plain", "new_tokens": len(plain),
                    "seconds": round(time.perf_counter() - t0, 2)}]
        for mode, overrides in MODES.items():
            drafter.generation_config = copy.deepcopy(shipped)
            for key, value in overrides.items():
                setattr(drafter.generation_config, key, value)
            t0 = time.perf_counter()
            spec = target.generate(**inputs, assistant_model=drafter, do_sample=False,
                                   max_new_tokens=n)[0, start:].tolist()
            record = {"id": p["id"], "domain": p["domain"], "mode": mode, "equal": spec == plain,
                      "new_tokens": len(spec), "tau": round(drafter.last_stats.tau, 3),
                      "seconds": round(time.perf_counter() - t0, 2)}
            if spec != plain:
                record["first_difference"] = first_difference(target, inputs["input_ids"], plain, spec)
            records.append(record)
        drafter.generation_config = copy.deepcopy(shipped)
        with out.open("a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        print(" | ".join(f"{r['mode']} {r['new_tokens']}" + ("" if r["mode"] == "plain" else
                         f" {'equal' if r['equal'] else 'DIFFERS'} tau {r['tau']}") for r in records),
              f"({p['id']})", flush=True)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    spec = [r for r in lines if r["mode"] != "plain"]
    print(f"{sum(r['equal'] for r in spec)} of {len(spec)} speculative outputs equal plain greedy generation")


if __name__ == "__main__":
    main()
