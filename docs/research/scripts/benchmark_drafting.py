"""Micro-benchmark (not a test): drafting latency of a ChainFlow drafter on the real SmolLM2 target, split into
VAE / flow / head / search, next to the target's own one-token step and multi-token verification times.

    python docs/research/scripts/benchmark_drafting.py [--drafter PATH] [--threads 2] [--repeats 30] [--context 300] [--compile]
    python docs/research/scripts/benchmark_drafting.py --served-round [--drafter PATH] [--round-threads 1 2]
        [--rounds 200] [--profile] [--module-experts] [--packing]

Without `--drafter`, a randomly initialised drafter with the default config for the target is timed (latency does
not depend on the weights' values). `--compile` also times the drafting round with the transport
(`ChainFlowDrafter.predict_states`: VAE encode, flow, VAE decode) wrapped in `torch.compile`, and the compile time.

`--served-round` times one served drafting round instead (`drafter.draft`, as the speculative loop calls it: the
drafter's tree with its budget cut, and a chain of `num_assistant_tokens`), eager and compiled
(`compile=True`, warmed up outside timing), interleaved round by round, at each of `--round-threads`, on real target
states: a few evaluation prompts (`hf_chainflow/data/eval_prompts.jsonl`, one per domain) answered greedily by the
target, each position of the answers one window. `--module-experts` also times every arm with the flow's experts run
one by one (their module forward, as before `StackedExperts`), interleaved; `--packing` also times it with the head
products unpacked (`F.linear`, as before `PackedLinear`) and compiled with inductor's Python wrapper, and packed
with the Python wrapper. `--profile` adds a per-op profile (`torch.profiler`, self CPU time per round) of the
compiled tree round of each setup.
"""

import argparse
import os
import statistics
import time

import torch

import hf_chainflow  # noqa: F401
from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
from hf_chainflow.generation import drafting, serving
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
    parser.add_argument("--served-round", action="store_true",
                        help="time one served drafting round (eager and compiled) on real target states instead")
    parser.add_argument("--round-threads", type=int, nargs="+", default=[1, 2], help="--served-round: thread counts")
    parser.add_argument("--rounds", type=int, default=200, help="--served-round: timed rounds per arm")
    parser.add_argument("--prompts", type=int, default=4, help="--served-round: evaluation prompts answered")
    parser.add_argument("--profile", action="store_true", help="--served-round: per-op profile of the compiled round")
    parser.add_argument("--module-experts", action="store_true",
                        help="--served-round: also time the rounds with the experts' module forward")
    parser.add_argument("--packing", action="store_true",
                        help="--served-round: also time the rounds with the head products unpacked and the compiled "
                             "round with inductor's Python wrapper (before), and packed with the Python wrapper")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.served_round:
        return served_round(args)

    target, _ = load_target("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    if args.drafter:
        drafter = ChainFlowDrafter.from_pretrained(args.drafter, target=target).eval()
    else:
        shortlist = None
        if args.shortlist_from:
            from hf_chainflow.training.prepared_data import read_shortlist

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
        from hf_chainflow.generation.search import candidate_rows

        latents, condition, mask = drafter._context(h)  # (1, C, Z), the velocity's conditioning, None
        velocity, tables = serving.serving_velocity(drafter), serving.serving_tables(drafter)  # as served

        def flow():
            return drafter.integrate(drafter.source(latents, mask), condition, mask, cfg.num_flow_steps,
                                     velocity=velocity)

        z1 = flow()  # (1, K, Z)
        states = drafter.decode(z1)[0]  # (K, D)
        head = tables.head if tables.head_linear is None else tables.head_linear
        rows = {
            "vae encode (context)": timed(lambda: drafter._context(h), args.repeats),
            f"flow ({cfg.num_flow_steps} Euler step, {cfg.num_experts}x{cfg.num_blocks} blocks, stacked)":
                timed(flow, args.repeats),
            "vae decode": timed(lambda: drafter.decode(z1), args.repeats),
            f"candidate head pass 1 ({g.tree_depth} positions, {drafter.config.serving_head_dtype})": timed(
                lambda: candidate_rows(states[None, : g.tree_depth], head, cfg.candidate_budget), args.repeats),
            f"search chain {g.num_assistant_tokens}": timed(
                lambda: drafting.search(drafter, states, ids[0], mode="chain", num_tokens=g.num_assistant_tokens),
                args.repeats),
            f"search tree {g.tree_width}x{g.tree_depth}": timed(
                lambda: drafting.search(drafter, states, ids[0], mode="tree", tree_width=g.tree_width,
                                        tree_depth=g.tree_depth), args.repeats),
            f"full draft, tree {g.tree_width}x{g.tree_depth}": timed(
                lambda: drafting.draft(drafter, h, ids, mode="tree", tree_width=g.tree_width,
                                       tree_depth=g.tree_depth), args.repeats),
            f"full draft, chain {g.num_assistant_tokens}": timed(
                lambda: drafting.draft(drafter, h, ids, mode="chain", num_tokens=g.num_assistant_tokens),
                args.repeats),
        }
        budget = getattr(g, "tree_budget", None)
        if budget:
            rows[f"full draft, tree {g.tree_width}x{g.tree_depth} cut to {budget} nodes"] = timed(
                lambda: drafting.draft(drafter, h, ids, mode="tree", tree_width=g.tree_width, tree_depth=g.tree_depth,
                                       tree_budget=budget), args.repeats)
        if args.compile:
            eager = drafter.predict_states
            drafter.predict_states = torch.compile(eager, dynamic=False)
            start = time.perf_counter()
            drafter.predict_states(h, velocity=velocity)
            rows["torch.compile of predict_states (one-off)"] = (time.perf_counter() - start) * 1e3
            rows["compiled: predict_states"] = timed(lambda: drafter.predict_states(h, velocity=velocity), args.repeats)
            rows["eager: predict_states"] = timed(lambda: eager(h, velocity=velocity), args.repeats)
            cut = f" cut to {budget} nodes" if budget else ""
            rows[f"compiled: full draft, tree {g.tree_width}x{g.tree_depth}{cut}"] = timed(
                lambda: drafting.draft(drafter, h, ids, mode="tree", tree_width=g.tree_width, tree_depth=g.tree_depth,
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


def answered_windows(target, tokenizer, num_prompts: int, context: int, new_tokens: int = 64, layers=()):
    """Windows of real target states: `num_prompts` evaluation prompts (one per domain first) answered greedily by
    the target, then run once through it; every answer position with `context` states before it is one window
    `(states (1, C, D), committed ids (1, L))`; with `layers` (0-based decoder layers), the states are the final
    ones followed by those layers' outputs, `(1, C, (1 + n) D)` (`select_target_states`)."""
    from hf_chainflow.bench.prompts import load_prompts, stratified_selection
    from hf_chainflow.generation.verification import select_target_states

    windows = []
    with torch.inference_mode():
        for row in stratified_selection(load_prompts(), num_prompts):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"][:, -512:]  # (1, P)
            gen = target.generation_config
            ids = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=gen.pad_token_id or gen.eos_token_id)  # (1, L)
            h = select_target_states(target(input_ids=ids, output_hidden_states=True).hidden_states, layers)
            # h: (1, L, D), or (1, L, (1 + n) D) with layers
            start = ids.shape[1] - new_tokens
            for t in range(max(start, context - 1), ids.shape[1] - 1):
                windows.append((h[:, t - context + 1: t + 1].clone(), ids[:, : t + 2]))
    return windows


def served_round(args):
    """`--served-round`: per-round medians of `drafter.draft`, eager and compiled, tree and chain, interleaved."""
    from hf_chainflow.checkpoints import default_drafter_path
    from hf_chainflow.generation.drafting_round import CompiledDraftingRound
    from hf_chainflow.generation.settings import SpeculativeSettings

    target, tokenizer = load_target("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    drafter = ChainFlowDrafter.from_pretrained(args.drafter or default_drafter_path(), target=target).eval()
    g = drafter.generation_config
    g.compile_drafting = True
    windows = answered_windows(target, tokenizer, args.prompts, drafter.context_size)
    base = SpeculativeSettings.from_drafter(drafter).replace(lookup_num_tokens=None, lookup_trust_ngram=None,
                                                             lookup_max_tokens=None)
    arms = {f"tree {g.tree_width}x{g.tree_depth} cut to {g.tree_budget}": base.replace(mode="tree"),
            f"chain {g.num_assistant_tokens}": base.replace(mode="chain")}
    kwargs = {name: s.draft_kwargs(10 ** 6) for name, s in arms.items()}
    # setup -> (the velocity `serving_tables` hands the round, packed head products?, inductor's C++ wrapper?)
    stacked, tables = serving.serving_velocity, serving.serving_tables
    setups = {"served": (stacked, True, True)}
    if args.module_experts:
        setups["module"] = (lambda d: d.velocity, True, True)
    if args.packing:
        setups["unpacked, py"] = (stacked, False, False)
        setups["packed, py"] = (stacked, True, False)
    rounds = {name: CompiledDraftingRound(cpp_wrapper=setup[2]) for name, setup in setups.items()}

    def use(setup):  # module attributes shadowing the functions (`drafting.draft` reads `drafting.serving_tables`,
        # which reads `serving.serving_velocity`)
        velocity, packed, _ = setups[setup]
        serving.serving_velocity = velocity
        drafting.serving_tables = tables if packed else lambda d: tables(d)._replace(head_linear=None,
                                                                                     folded_linear=None)
        drafter._runtime["compiled_round"] = rounds[setup]

    def draft(states, ids, kw, compiled, setup):
        use(setup)
        drafting.draft(drafter, states, ids, **kw, compile=compiled)

    with torch.inference_mode():
        start = time.perf_counter()
        for kw in kwargs.values():  # compile the full-depth key of each arm, outside timing
            for setup in setups:
                draft(*windows[0], kw, True, setup)
        compile_s = time.perf_counter() - start
        times = {}
        for threads in args.round_threads:
            torch.set_num_threads(threads)
            for i in range(args.rounds + 10):  # the first 10 warm the caches at this thread count
                states, ids = windows[i % len(windows)]
                for name, kw in kwargs.items():
                    for setup in setups:
                        for compiled in (False, True):
                            begin = time.perf_counter()
                            draft(states, ids, kw, compiled, setup)
                            if i >= 10:
                                times.setdefault((name, setup, compiled, threads), []).append(
                                    time.perf_counter() - begin)
    load = os.getloadavg()
    print(f"served drafting round, {len(windows)} windows of real target states ({args.dtype}), "
          f"{args.rounds} rounds per arm, interleaved; compile {compile_s:.1f} s; load {load[0]:.2f} {load[1]:.2f}; "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'round':28s} {'setup':>12s} {'threads':>7s} {'eager ms':>9s} {'compiled ms':>12s}")
    for name in kwargs:
        for threads in args.round_threads:
            for setup in setups:
                eager, compiled = (1e3 * statistics.median(times[(name, setup, c, threads)]) for c in (False, True))
                print(f"{name:28s} {setup:>12s} {threads:7d} {eager:9.2f} {compiled:12.2f}")
    if args.profile:
        for setup in setups:
            use(setup)
            profile_round(drafter, windows, next(iter(kwargs.values())), args.round_threads[-1], args.rounds, setup)
    use("served")


def profile_round(drafter, windows, kwargs, threads, rounds, setup):
    """Self CPU time per round of each op in `rounds` compiled rounds (`torch.profiler`)."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(rounds):
            drafting.draft(drafter, *windows[i % len(windows)], **kwargs, compile=True)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows)
    print(f"profile of the compiled round ({kwargs['mode']}, {setup}, {threads} thread(s)), self CPU per round: "
          f"{total / 1e3 / rounds:.2f} ms in all")
    print(f"{'op':60s} {'calls/round':>11s} {'ms/round':>9s}")
    for e in rows[:25]:
        print(f"{e.key[:60]:60s} {e.count / rounds:11.1f} {e.self_cpu_time_total / 1e3 / rounds:9.3f}")


if __name__ == "__main__":
    main()
