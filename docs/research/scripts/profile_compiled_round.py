"""Where a compiled verification round's time goes (issue 65): SmolLM2-135M-Instruct in bfloat16, the shipped
drafter's tree + lookup setting, eager against compiled verification, on a few evaluation prompts.

    python docs/research/scripts/profile_compiled_round.py --prompts 8 --threads 2 --out DIR

Prints and writes (DIR/profile.json, DIR/profile.md) the seconds per round of each phase of hf_chainflow's loop
(drafting, the verify inputs and mask, the target forward, acceptance, the commit, the rest), timed by wrapping the
loop's functions, and the top operators of the compiled forward by self CPU time (torch.profiler).
"""

import argparse
import collections
import json
import time
from pathlib import Path

import torch

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.bench.machine import machine_info
from hf_chainflow.bench.prompts import choose_prompts, tokenize_prompts
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.generation import acceptance, compiled_verification, loop, proposers, verification
from hf_chainflow.targets import load_model_and_tokenizer

PHASES = {"inputs": (verification, "build_batch_verify_inputs"), "accept": (acceptance, "accept_round"),
          "process": (acceptance, "processed_rows"), "commit": (verification, "commit_batch")}


def timed(spent, name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tok = load_model_and_tokenizer("smollm2-135m-instruct", torch.bfloat16)
    drafter = ChainFlowDrafter.from_pretrained(str(default_drafter_path()), target=target, dtype=torch.float32).eval()
    prompts = tokenize_prompts(tok, choose_prompts(None, args.prompts)[0])
    longest = max(p.input_ids.shape[1] for p in prompts) + args.max_new_tokens
    report = {"machine": machine_info(), "threads": args.threads, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "arms": {}}
    with torch.inference_mode():
        report["warm_up"] = compiled_verification.warm_up(target, longest,
                                                          state_layers=tuple(drafter.state_layers or ()))
        spent = collections.Counter()
        originals = {name: getattr(mod, attr) for name, (mod, attr) in PHASES.items()}
        forward = compiled_verification.CompiledVerifier.forward
        for name, (mod, attr) in PHASES.items():
            setattr(mod, attr, timed(spent, name, originals[name]))
        compiled_verification.CompiledVerifier.forward = timed(spent, "forward (compiled)", forward)
        eager_call = type(target).__call__
        try:
            for arm in ("eager", "compiled", "eager", "compiled"):
                drafter.generation_config.compile_verification = arm == "compiled"
                spent.clear()
                rounds = tokens = 0
                seconds = draft = verify = 0.0
                for p in prompts:
                    start = time.perf_counter()
                    out = target.generate(p.input_ids, attention_mask=torch.ones_like(p.input_ids),
                                          max_new_tokens=args.max_new_tokens, do_sample=False,
                                          assistant_model=drafter)
                    seconds += time.perf_counter() - start
                    s = drafter.last_stats
                    rounds += s.rounds
                    tokens += out.shape[1] - p.input_ids.shape[1]
                    draft += s.draft_time
                    verify += s.verify_time
                ms = {k: 1e3 * v / rounds for k, v in spent.items()}
                ms["draft (drafting round + lookup)"] = 1e3 * draft / rounds
                ms["verify phase (all)"] = 1e3 * verify / rounds
                known = sum(v for k, v in ms.items() if k not in ("verify phase (all)", "draft (drafting round + lookup)"))
                ms["verify phase: forward, eager"] = (ms["verify phase (all)"] - known) if arm == "eager" else None
                report["arms"][arm] = {"tokens_per_second": tokens / seconds, "rounds": rounds,
                                       "ms_per_round": ms}
                print(arm, round(tokens / seconds, 2), {k: (round(v, 2) if v is not None else None)
                                                        for k, v in ms.items()}, flush=True)
        finally:
            for name, (mod, attr) in PHASES.items():
                setattr(mod, attr, originals[name])
            compiled_verification.CompiledVerifier.forward = forward
        # the compiled forward, operator by operator, over one prompt
        drafter.generation_config.compile_verification = True
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            p = prompts[0]
            target.generate(p.input_ids, attention_mask=torch.ones_like(p.input_ids), max_new_tokens=32,
                            do_sample=False, assistant_model=drafter)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        report["operators"] = table
        print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print("wrote", out / "profile.json")


if __name__ == "__main__":
    main()
