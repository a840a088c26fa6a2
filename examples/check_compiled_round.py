"""Check (not a test): the shipped drafter's compiled drafting round drafts what its eager round drafts.

    python examples/check_compiled_round.py [--windows 3000] [--dtype bfloat16] [--threads 1]

Windows come from the committed held-out corpus (`corpus/smollm2-135m-instruct`): each response is run once through
the target (prompt + response, the target's own greedy continuation), and every position with a full context of
`C` states is one window (its last `C` states, its committed tokens). For each window the drafter's own tree
(`generation_config`: shape, budget, flow steps) is drafted eagerly and compiled; the verdicts of
`hf_chainflow.drafting_round.compare_drafts` are counted (same / near-tie within 1e-3 / different), with the largest
log-probability gap among identical drafts and the per-round times of both, interleaved.
"""

import argparse
import statistics
import time

import torch

from hf_chainflow import ChainFlowDrafter
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.corpus import ResponseCorpus
from hf_chainflow.drafting_round import compare_drafts
from hf_chainflow.settings import SpeculativeSettings
from hf_chainflow.targets import load_target


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=3000)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="target dtype")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    drafter = ChainFlowDrafter.from_pretrained(default_drafter_path(), target=target).eval()
    drafter.generation_config.compile_drafting = True
    settings = SpeculativeSettings.from_drafter(drafter).replace(lookup_num_tokens=None, lookup_trust_ngram=None,
                                                                 lookup_max_tokens=None)
    kwargs = settings.draft_kwargs(10 ** 6)
    with torch.inference_mode():
        warm = drafter.warm_up_drafting(settings)
    C = drafter.context_size
    counts = {"same": 0, "near-tie": 0, "different": 0}
    gap, eager_s, compiled_s, done = 0.0, [], [], 0
    rows = ResponseCorpus("corpus/smollm2-135m-instruct").responses("heldout")
    with torch.inference_mode():
        for row in rows.values():
            ids = torch.tensor([list(row["prompt_ids"]) + list(row["response_ids"])])
            h = target(input_ids=ids, output_hidden_states=True).hidden_states[-1]  # (1, L, D)
            for t in range(C - 1, ids.shape[1] - 1):
                states, committed = h[:, t - C + 1: t + 1], ids[:, : t + 2]
                start = time.perf_counter()
                want = drafter.draft(states, committed, **kwargs, compile=False)
                eager_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                got = drafter.draft(states, committed, **kwargs, compile=True)
                compiled_s.append(time.perf_counter() - start)
                verdict = compare_drafts(want, got)
                counts[verdict] += 1
                if verdict == "same":
                    gap = max(gap, float((want.logprobs - got.logprobs).abs().max()))
                done += 1
                if done >= args.windows:
                    break
            if done >= args.windows:
                break
    print(f"{done} windows, {kwargs['mode']} {kwargs['tree_width']}x{kwargs['tree_depth']} budget "
          f"{kwargs['tree_budget']}: {counts}; largest logprob gap among same drafts {gap:.2e}")
    print(f"compile (warm-up, {len(drafter.compiled_round.keys)} shapes) {warm:.1f} s; per round eager "
          f"{1e3 * statistics.median(eager_s):.2f} ms, compiled {1e3 * statistics.median(compiled_s):.2f} ms "
          f"(medians, interleaved, {args.threads} thread(s))")


if __name__ == "__main__":
    main()
