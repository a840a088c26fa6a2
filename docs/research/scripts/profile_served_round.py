"""Profile (not a test): where a served ChainFlow round's time goes on the real SmolLM2 target.

    python docs/research/scripts/profile_served_round.py [--dtype bfloat16] [--mode tree] [--lookup] [--prompts 8] [--threads 2]

Generates evaluation prompts greedily with the shipped drafter (`target.generate(assistant_model=drafter)`, the
drafter's own tree shape and budget; the prompt-lookup branch off unless `--lookup`) and times each phase of the
decoding loop by wrapping the functions `hf_chainflow.generation.loop` calls: the drafter's `draft`, `verify_forward`
(and inside it the target's backbone and `lm_head`), the logits processing, acceptance and the cache commit. The
prompts are those `hf-chainflow bench --limit N` takes (round-robin over the domains; the default 8 is one per
domain). Then, at the first prompt's context, it times the same 13-token forward three ways: plain causal, through
`verify_forward` (tree position ids and 4D ancestor mask), and a one-token step, so the mask's own cost can be read
off.

It wraps the single-prompt loop's functions as they were before the one batched loop (issue 63): run it at commit
314d761 (`git worktree add /tmp/old 314d761`, then `PYTHONPATH=/tmp/old python ...`); the same holds for
`benchmark_drafting.py --served-round` and `levers_drafting_cost.py`, which time `drafter.draft`.
"""

import argparse
import collections
import time

import torch

import hf_chainflow.generation.loop as decoding
import hf_chainflow.generation.verification as verification
from hf_chainflow import ChainFlowDrafter
from hf_chainflow.bench import load_prompts, stratified_selection
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.targets import load_target
from hf_chainflow.generation.tree import DraftTree


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="saved drafter directory (default: the shipped drafter)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="target dtype")
    parser.add_argument("--mode", default="tree", choices=["chain", "tree"])
    parser.add_argument("--lookup", action="store_true", help="keep the drafter's prompt-lookup branch on")
    parser.add_argument("--prompts", type=int, default=8,
                        help="how many evaluation prompts, taken as `hf-chainflow bench --limit` takes them")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tok = load_target("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    drafter = ChainFlowDrafter.from_pretrained(args.drafter or default_drafter_path(), target=target,
                                               dtype=torch.float32).eval()
    drafter.generation_config.draft_mode = args.mode
    if not args.lookup:
        drafter.generation_config.lookup_num_tokens = None

    seconds, calls = collections.defaultdict(float), collections.Counter()
    in_verify = [False]  # the target's backbone and lm_head are timed inside `verify_forward` only (not prefill)

    def timed(name, fn, verify_only=False):
        def wrapper(*a, **k):
            if verify_only and not in_verify[0]:
                return fn(*a, **k)
            start = time.perf_counter()
            out = fn(*a, **k)
            seconds[name] += time.perf_counter() - start
            calls[name] += 1
            return out
        return wrapper

    def verify(*a, **k):
        in_verify[0] = True
        try:
            return timed_verify(*a, **k)
        finally:
            in_verify[0] = False

    timed_verify = timed("verify_forward", decoding.verify_forward)
    decoding.verify_forward = verify
    decoding._processed_rows = timed("  logits processing", decoding._processed_rows)
    decoding.accept_round = timed("  acceptance", decoding.accept_round)
    decoding.commit = timed("  cache commit", decoding.commit)
    verification.build_verify_inputs = timed("  tree inputs and mask", verification.build_verify_inputs)
    target.model.forward = timed("  target backbone", target.model.forward, verify_only=True)
    target.lm_head.forward = timed("  target lm_head", target.lm_head.forward, verify_only=True)
    drafter.draft = timed("draft", drafter.draft)

    rows = stratified_selection(load_prompts(), args.prompts)  # round-robin over the domains, as `bench --limit`
    encoded = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"] for r in rows]
    gen = target.generation_config

    def generate(ids, **kw):
        with torch.inference_mode():
            start = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, eos_token_id=gen.eos_token_id, pad_token_id=gen.pad_token_id, **kw)
            return out.shape[1] - ids.shape[1], time.perf_counter() - start

    generate(encoded[0], assistant_model=drafter)  # warm-up
    seconds.clear()
    calls.clear()
    tokens = wall = prefill = 0
    for ids in encoded:
        n, s = generate(ids, assistant_model=drafter)
        tokens, wall, prefill = tokens + n, wall + s, prefill + drafter.last_stats.prefill_time
    spec_seconds, spec_calls = dict(seconds), dict(calls)  # the speculative runs only (plain generation runs some too)
    plain_tokens = plain_wall = 0
    for ids in encoded:
        n, s = generate(ids)
        plain_tokens, plain_wall = plain_tokens + n, plain_wall + s

    rounds = max(1, spec_calls.get("verify_forward", 0))  # one target forward per round of the loop
    print(f"{args.dtype}, {args.mode}{' + lookup' if args.lookup else ''}, {len(encoded)} prompts: {tokens} tokens, "
          f"{rounds} rounds ({(tokens - len(encoded)) / rounds:.2f} tokens per round after the prefill's first); "
          f"{1e3 * (wall - prefill) / rounds:.1f} ms per round (prefill excluded); plain generate "
          f"{1e3 * plain_wall / max(1, plain_tokens):.1f} ms per token (prefill included)")
    print("prompts: " + ", ".join(f"{r['id']} ({r['domain']})" for r in rows))
    print(f"{'phase':32s} {'calls':>6s} {'ms per round':>13s}")
    for name in ("draft", "verify_forward", "  target backbone", "  target lm_head", "  tree inputs and mask",
                 "  logits processing", "  acceptance", "  cache commit"):
        print(f"{name:32s} {spec_calls.get(name, 0):6d} {1e3 * spec_seconds.get(name, 0.0) / rounds:13.2f}")

    # The same 13 tokens at the first prompt's context: causal, as a tree verification (4D mask), and one token.
    from transformers import DynamicCache

    def median_ms(fn, n_tokens, repeats=15):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            cache.crop(-n_tokens)
        return 1e3 * sorted(times)[repeats // 2]

    ids = encoded[0]
    x = ids[:, -13:]
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        causal = median_ms(lambda: target(input_ids=x, cache=cache, use_cache=True), 13)
        tree = median_ms(lambda: verification.verify_forward(target, cache, x[0, 0], DraftTree.chain(x[0, 1:])), 13)
        one = median_ms(lambda: target(input_ids=x[:, :1], cache=cache, use_cache=True), 1)
    print(f"at context {ids.shape[1]}: 13 tokens causal {causal:.1f} ms, 13 tokens via verify_forward (4D mask) "
          f"{tree:.1f} ms, 1 token {one:.1f} ms")


if __name__ == "__main__":
    main()
