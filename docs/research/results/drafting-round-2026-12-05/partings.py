"""Where the compiled round's drafts part from the eager round's (issue 35's "same drafts"): for the held-out windows
given (their index in `examples/check_compiled_round.py`'s order), the eager transport's states against the compiled
transport's, the candidate rows of each, and the eager search run on the compiled transport's states against the
compiled round. Run from the repository root: `PYTHONPATH=. python docs/research/results/drafting-round-2026-12-05/partings.py`.
"""
import sys, torch
from hf_chainflow import ChainFlowDrafter
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.generation import drafting, serving
from hf_chainflow.generation.drafting_round import compare_drafts
from hf_chainflow.generation.search import committed_tails, candidate_rows, search_levels, DraftBatch
from hf_chainflow.generation.settings import SpeculativeSettings, SearchSettings
from hf_chainflow.targets import load_target
from windows import held_out_windows
torch.set_num_threads(1)
target, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
drafter = ChainFlowDrafter.from_pretrained(default_drafter_path(), target=target).eval()
settings = SpeculativeSettings.from_drafter(drafter).replace(lookup_num_tokens=None, lookup_trust_ngram=None, lookup_max_tokens=None)
kwargs = settings.draft_kwargs(10 ** 6)
search = SearchSettings(**{k: v for k, v in kwargs.items() if k != "num_flow_steps"}, max_depth=drafter.max_draft_depth)
C, p, pad = drafter.context_size, drafter.config.path_order, drafter.config.pad_token_id or 0
M = drafter.config.candidate_budget
def transport(states, tails, velocity):
    return drafter.predict_states(states, num_flow_steps=kwargs["num_flow_steps"], bonus_tokens=tails[:, -1], velocity=velocity)
ctransport = torch.compile(transport, dynamic=False)
want = {26, 538, 668, 901}
with torch.inference_mode():
    for done, states, committed in held_out_windows(target, C, max(want) + 1):
        if done in want:
            tails = committed_tails(committed, p, pad)
            tables = serving.serving_tables(drafter)
            se = transport(states, tails, tables.velocity)
            sc = ctransport(states, tails, tables.velocity)
            re, _ = candidate_rows(se[:, :4], tables.head, M)
            rc, _ = candidate_rows(sc[:, :4], tables.head, M)
            diff_rows = len(set(re[0].tolist()) ^ set(rc[0].tolist()))
            te = DraftBatch(*search_levels(drafter, tables, se, tails, search)).tree(0)
            tec = DraftBatch(*search_levels(drafter, tables, sc, tails, search)).tree(0)
            tc = drafting.draft(drafter, states, committed, **kwargs, compile=True)
            print(done, f"states max|diff| {float((se - sc).abs().max()):.2e}", "candidate rows differ:", diff_rows,
                  "eager-search(compiled states) vs compiled round:", compare_drafts(tc, tec),
                  "eager vs compiled round:", compare_drafts(te, tc),
                  f"logprob gap {float((tec.logprobs - tc.logprobs).abs().max()) if compare_drafts(tc, tec) == 'same' else -1:.2e}", flush=True)
