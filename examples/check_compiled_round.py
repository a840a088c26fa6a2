"""Check (not a test): the shipped drafter's compiled drafting round drafts what its eager round drafts.

    python examples/check_compiled_round.py [--windows 3000] [--dtype bfloat16] [--threads 1] [--mode chain]

Windows come from the committed held-out corpus (`corpus/smollm2-135m-instruct`): each response is run once through
the target (prompt + response, the target's own greedy continuation), and every position with a full context of
`C` states is one window (its last `C` states, its committed tokens). For each window the drafter's own tree
(`generation_config`: shape, budget, flow steps; `--mode chain`: its chain of `num_assistant_tokens`) is drafted three
ways: eagerly with the velocity network's own expert-by-expert forward and the head products unpacked (`F.linear`;
the reference), eagerly as served (the experts stacked, `hf_chainflow.generation.serving.serving_velocity`; the head
products packed, `hf_chainflow.generation.packed_linear.PackedLinear`) and compiled. The verdicts of
`hf_chainflow.generation.drafting_round.compare_drafts` against the reference are counted (same / near-tie within 1e-3 /
different), with the largest log-probability gap among identical drafts and the per-round times, interleaved.
"""

import argparse
import statistics
import time

import torch

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.generation import drafting, serving
from hf_chainflow.training.corpus import ResponseCorpus
from hf_chainflow.generation.drafting_round import compare_drafts, drafting_round
from hf_chainflow.generation.search import DraftBatch, committed_tails
from hf_chainflow.generation.settings import SearchSettings, SpeculativeSettings
from hf_chainflow.targets import load_target


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=3000)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="target dtype")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mode", default=None, choices=["chain", "tree"], help="default: the drafter's draft_mode")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    drafter = ChainFlowDrafter.from_pretrained(default_drafter_path(), target=target).eval()
    drafter.generation_config.compile_drafting = True
    settings = SpeculativeSettings.from_drafter(drafter).replace(lookup_num_tokens=None, lookup_trust_ngram=None,
                                                                 lookup_max_tokens=None)
    if args.mode is not None:
        settings = settings.replace(mode=args.mode)
    kwargs = settings.draft_kwargs(10 ** 6)
    with torch.inference_mode():
        warm = drafting.warm_up_drafting(drafter, settings)
    C, p, pad = drafter.context_size, drafter.config.path_order, drafter.config.pad_token_id or 0
    search = SearchSettings(**{k: v for k, v in kwargs.items() if k != "num_flow_steps"},
                            max_depth=drafter.max_draft_depth)
    counts = {arm: {"same": 0, "near-tie": 0, "different": 0} for arm in ("eager", "compiled")}
    gap, times, done = 0.0, {"reference": [], "eager": [], "compiled": []}, 0
    rows = ResponseCorpus("corpus/smollm2-135m-instruct").responses("heldout")
    with torch.inference_mode():
        for row in rows.values():
            ids = torch.tensor([list(row["prompt_ids"]) + list(row["response_ids"])])
            h = target(input_ids=ids, output_hidden_states=True).hidden_states[-1]  # (1, L, D)
            for t in range(C - 1, ids.shape[1] - 1):
                states, committed = h[:, t - C + 1: t + 1], ids[:, : t + 2]
                start = time.perf_counter()
                # the module's forward, the head products unpacked (`F.linear`)
                tables = serving.serving_tables(drafter)._replace(velocity=drafter.velocity, head_linear=None,
                                                                  folded_linear=None)
                want = DraftBatch(*drafting_round(drafter, tables, states, committed_tails(committed, p, pad), search,
                                                  kwargs["num_flow_steps"])).tree(0)
                times["reference"].append(time.perf_counter() - start)
                for arm in ("eager", "compiled"):
                    start = time.perf_counter()
                    got = drafting.draft(drafter, states, committed, **kwargs, compile=arm == "compiled")
                    times[arm].append(time.perf_counter() - start)
                    verdict = compare_drafts(want, got)
                    counts[arm][verdict] += 1
                    if verdict == "same":
                        gap = max(gap, float((want.logprobs - got.logprobs).abs().max()))
                done += 1
                if done >= args.windows:
                    break
            if done >= args.windows:
                break
    shape = (f"tree {kwargs['tree_width']}x{kwargs['tree_depth']} budget {kwargs['tree_budget']}"
             if kwargs["mode"] == "tree" else f"chain {kwargs['num_tokens']}")
    print(f"{done} windows, {shape}, against the eager round with the experts' module forward: eager (stacked) "
          f"{counts['eager']}, compiled {counts['compiled']}; largest logprob gap among same drafts {gap:.2e}")
    print(f"compile (warm-up, {len(drafting.compiled_round(drafter).keys)} shapes) {warm:.1f} s; per round "
          + ", ".join(f"{arm} {1e3 * statistics.median(s):.2f} ms" for arm, s in times.items())
          + f" (medians, interleaved, {args.threads} thread(s))")


if __name__ == "__main__":
    main()
