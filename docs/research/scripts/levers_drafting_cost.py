"""Drafting ms per round of the levers arms (docs/research/results/levers/): the shipped drafter's architecture as
it is (R and P), with the bonus token's embedding (B), with fused target layers 1, 14, 26 (L), and with both (BL).

The cost of a round depends on the architecture, not on the trained values, so each arm is the shipped drafter grown
as `add_transport_inputs.py` grows it (the new inputs zero-initialised; the fused layers' statistics from the
windows below). Every arm drafts on the same windows of real target states (evaluation prompts answered greedily
by the target, one window per answer position, with the layers each arm reads), as the serving loop calls it
(`drafter.draft`, tree 8x4 cut to 12 and chain of 3), eager and compiled, interleaved round by round; medians.

    python docs/research/scripts/levers_drafting_cost.py [--dtype float32] [--threads 2] [--rounds 300] [--prompts 4] \
        [--out DIR]

With `--out`, also writes `DIR/drafting_cost.json` (per arm and round: eager and compiled medians in ms; P has R's
architecture), which `levers_table.py --drafting-cost` puts into the ablation table.
"""

import argparse
import copy
import json
import os
import statistics
import time

import torch

from benchmark_drafting import answered_windows  # this folder: evaluation prompts answered, one window a position
from hf_chainflow import ChainFlowDrafter
from hf_chainflow.bench.machine import machine_info
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.generation import drafting
from hf_chainflow.generation.settings import SpeculativeSettings
from hf_chainflow.targets import load_target

LAYERS = [1, 14, 26]  # the levers arms' fused layers (0-based decoder layers)
ARMS = {"R": "R / P (shipped)", "B": "B (bonus embedding)", "L": "L (layers 1, 14, 26)", "BL": "BL (both)"}


def grown(drafter: ChainFlowDrafter, target, *, bonus: bool, layers: list[int] | None, layer_states=None):
    """A copy of `drafter` with the transport inputs added (zero-initialised: it drafts what `drafter` drafts)."""
    config = copy.deepcopy(drafter.config)
    config.bonus_embedding, config.target_layer_ids = bonus, layers
    config.check_fields()
    new = ChainFlowDrafter(config).bind_target(target)
    missing, unexpected = new.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected or any("bonus_proj" not in k and "layer_fusion" not in k for k in missing):
        raise SystemExit(f"the copy does not take the drafter's weights: missing {missing}, unexpected {unexpected}")
    if layers:
        D = drafter.config.target_hidden_size
        flat = layer_states[..., D:].reshape(-1, len(layers), D)  # (N, n, D): every position's fused layers
        new.set_layer_statistics(flat.mean(0), flat.std(0).clamp_min(1e-4))
    new.generation_config = copy.deepcopy(drafter.generation_config)
    return new.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="target dtype")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=300, help="timed rounds per arm and setting")
    parser.add_argument("--prompts", type=int, default=4, help="evaluation prompts answered for the windows")
    parser.add_argument("--out", help="folder for drafting_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tokenizer = load_target("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    shipped = ChainFlowDrafter.from_pretrained(default_drafter_path(), target=target).eval()
    windows = answered_windows(target, tokenizer, args.prompts, shipped.context_size, layers=LAYERS)  # (1, C, 4D)
    all_states = torch.cat([w[0] for w in windows], 1)  # (1, N*C, 4D)
    D = shipped.config.target_hidden_size
    arms = {ARMS["R"]: shipped,
            ARMS["B"]: grown(shipped, target, bonus=True, layers=None),
            ARMS["L"]: grown(shipped, target, bonus=False, layers=LAYERS, layer_states=all_states),
            ARMS["BL"]: grown(shipped, target, bonus=True, layers=LAYERS, layer_states=all_states)}
    base = SpeculativeSettings.from_drafter(shipped).replace(lookup_num_tokens=None, lookup_trust_ngram=None,
                                                             lookup_max_tokens=None)
    rounds = {"tree 8x4 cut to 12": base.replace(mode="tree").draft_kwargs(10 ** 6),
              "chain of 3": base.replace(mode="chain").draft_kwargs(10 ** 6)}

    def states(drafter, w):  # what the serving loop hands this arm: final states, or final + fused layers
        return w[0] if drafter.state_layers else w[0][..., :D]

    with torch.inference_mode():
        for drafter in arms.values():  # the zero-initialised inputs draft what the shipped drafter drafts
            for kw in rounds.values():
                for w in windows[:16]:
                    a = drafting.draft(shipped, states(shipped, w), w[1], **kw)
                    b = drafting.draft(drafter, states(drafter, w), w[1], **kw)
                    if not (torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)):
                        raise SystemExit("a grown arm drafts differently from the shipped drafter")
        start = time.perf_counter()
        for drafter in arms.values():  # compile each arm's rounds outside timing
            for kw in rounds.values():
                drafting.draft(drafter, states(drafter, windows[0]), windows[0][1], **kw, compile=True)
        compile_s = time.perf_counter() - start
        times = {}
        for i in range(args.rounds + 10):  # the first 10 warm the caches
            w = windows[i % len(windows)]
            for arm, drafter in arms.items():
                for name, kw in rounds.items():
                    for compiled in (False, True):
                        begin = time.perf_counter()
                        drafting.draft(drafter, states(drafter, w), w[1], **kw, compile=compiled)
                        if i >= 10:
                            times.setdefault((arm, name, compiled), []).append(time.perf_counter() - begin)
    load = os.getloadavg()
    print(f"levers arms, one served drafting round: {len(windows)} windows of real target states ({args.dtype}), "
          f"{args.rounds} rounds per arm and setting, interleaved, {args.threads} thread(s); "
          f"compile {compile_s:.1f} s; load {load[0]:.2f} {load[1]:.2f}; "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'arm':22s} {'round':20s} {'eager ms':>9s} {'compiled ms':>12s}")
    medians = {}
    for arm in arms:
        for name in rounds:
            eager, compiled = (1e3 * statistics.median(times[(arm, name, c)]) for c in (False, True))
            medians.setdefault(arm, {})[name.split()[0]] = {"eager_ms": round(eager, 3),
                                                            "compiled_ms": round(compiled, 3)}
            print(f"{arm:22s} {name:20s} {eager:9.2f} {compiled:12.2f}")
    if args.out:
        by_arm = {key: medians[label] for key, label in ARMS.items()}
        by_arm["P"] = by_arm["S"] = by_arm["R"]  # the shipped drafter's architecture
        report = {"rounds": {"tree": "tree 8x4 cut to 12", "chain": "chain of 3"}, "dtype": args.dtype,
                  "threads": args.threads, "timed_rounds": args.rounds, "windows": len(windows),
                  "compile_seconds": round(compile_s, 1), "load_average_end": list(load), "machine": machine_info(),
                  "arms": by_arm}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "drafting_cost.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
