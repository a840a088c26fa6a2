"""Micro-benchmark (not a test): drafting latency of a ChainFlow drafter on the real SmolLM2 target, split into
VAE / flow / head / search, next to the target's own one-token step and multi-token verification times.

    python docs/research/scripts/benchmark_drafting.py [--drafter PATH] [--threads 2] [--repeats 30] [--context 300] [--compile]

Without `--drafter`, a randomly initialised drafter with the default config for the target is timed (latency does
not depend on the weights' values). `--compile` also times the drafting round with the transport
(`ChainFlowDrafter.predict_states`: VAE encode, flow, VAE decode) wrapped in `torch.compile`, and the compile time.
"""

import argparse
import statistics
import time

import torch

import hf_chainflow  # noqa: F401
from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.targets import load_target


def timed(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3  # ms


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="saved drafter directory (default: random default config)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=300, help="committed tokens in the target's cache")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target dtype")
    parser.add_argument("--shortlist-from", default=None,
                        help="prepared data dir whose shortlist the random drafter uses (default: none)")
    parser.add_argument("--compile", action="store_true",
                        help="also time drafting with predict_states under torch.compile (an experiment, not served)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, _ = load_target("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    if args.drafter:
        drafter = ChainFlowDrafter.from_pretrained(args.drafter, target=target).eval()
    else:
        shortlist = None
        if args.shortlist_from:
            from hf_chainflow.data import read_shortlist

            shortlist = read_shortlist(args.shortlist_from)
        config = ChainFlowConfig.for_target(target.config, shortlist=shortlist)
        drafter = ChainFlowDrafter(config).eval().bind_target(target)
    cfg = drafter.config
    ids = torch.randint(100, 20000, (1, args.context))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True, use_cache=True)
    h = out.hidden_states[-1]
    g = drafter.generation_config

    with torch.no_grad():
        context, mask = drafter._context(h)
        z0 = drafter.source(context, mask)
        z1 = drafter.integrate(z0, context, mask, cfg.num_flow_steps)
        states = drafter.decode(z1)[0]
        rows = {
            "vae encode (context)": timed(lambda: drafter._context(h), args.repeats),
            f"flow ({cfg.num_flow_steps} Euler step, {cfg.num_experts}x{cfg.num_blocks} blocks)":
                timed(lambda: drafter.integrate(drafter.source(context, mask), context, mask, cfg.num_flow_steps),
                      args.repeats),
            "vae decode": timed(lambda: drafter.decode(z1), args.repeats),
            f"candidate head pass 1 ({g.tree_depth} positions, {drafter.config.serving_head_dtype})": timed(
                lambda: drafter._candidates(states[: g.tree_depth], drafter.serving_head_weight()), args.repeats),
            f"search chain {g.num_assistant_tokens}": timed(
                lambda: drafter.search(states, ids[0], mode="chain", num_tokens=g.num_assistant_tokens), args.repeats),
            f"search tree {g.tree_width}x{g.tree_depth}": timed(
                lambda: drafter.search(states, ids[0], mode="tree", tree_width=g.tree_width,
                                       tree_depth=g.tree_depth), args.repeats),
            f"full draft, tree {g.tree_width}x{g.tree_depth}": timed(
                lambda: drafter.draft(h, ids, mode="tree", tree_width=g.tree_width, tree_depth=g.tree_depth),
                args.repeats),
            f"full draft, chain {g.num_assistant_tokens}": timed(
                lambda: drafter.draft(h, ids, mode="chain", num_tokens=g.num_assistant_tokens), args.repeats),
        }
        budget = getattr(g, "tree_budget", None)
        if budget:
            rows[f"full draft, tree {g.tree_width}x{g.tree_depth} cut to {budget} nodes"] = timed(
                lambda: drafter.draft(h, ids, mode="tree", tree_width=g.tree_width, tree_depth=g.tree_depth,
                                      tree_budget=budget), args.repeats)
        if args.compile:
            eager = drafter.predict_states
            drafter.predict_states = torch.compile(eager, dynamic=False)
            start = time.perf_counter()
            drafter.predict_states(h)
            rows["torch.compile of predict_states (one-off)"] = (time.perf_counter() - start) * 1e3
            rows["compiled: predict_states"] = timed(lambda: drafter.predict_states(h), args.repeats)
            rows["eager: predict_states"] = timed(lambda: eager(h), args.repeats)
            cut = f" cut to {budget} nodes" if budget else ""
            rows[f"compiled: full draft, tree {g.tree_width}x{g.tree_depth}{cut}"] = timed(
                lambda: drafter.draft(h, ids, mode="tree", tree_width=g.tree_width, tree_depth=g.tree_depth,
                                      tree_budget=budget), args.repeats)
            drafter.predict_states = eager
        cache = out.cache if "cache" in out else out.past_key_values
        for n in (1, 4, 8, 11, 13, 23, 32, 33):  # 11: PLD-10; 23: tree + merged branch; 32/33: a kernel step
            def step(n=n):
                target(torch.randint(100, 20000, (1, n)), cache=cache, use_cache=True)
                cache.crop(-n)
            rows[f"target forward, {n} token(s) ({args.dtype})"] = timed(step, args.repeats)

    params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {params / 1e6:.2f} M parameters; Z={cfg.latent_size}, C={cfg.context_size}, "
          f"K={cfg.num_draft_positions}, threads={args.threads}, context={args.context}")
    print(f"{'component':48s} {'median ms':>10s}")
    for name, ms in rows.items():
        print(f"{name:48s} {ms:10.2f}")


if __name__ == "__main__":
    main()
