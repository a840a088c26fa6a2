"""Which change moves the compiled drafts: the eager reference of `examples/check_compiled_round.py` against the
compiled round in four setups (head products unpacked or packed, inductor's Python or C++ wrapper) on the first N
held-out windows. Run from the repository root: `PYTHONPATH=. python docs/research/results/drafting-round-2026-12-05/setups.py 1500`.
"""
import sys, torch
from hf_chainflow import ChainFlowDrafter
from hf_chainflow.checkpoints import default_drafter_path
from hf_chainflow.generation import drafting, serving
from hf_chainflow.generation.drafting_round import compare_drafts, drafting_round, CompiledDraftingRound
from hf_chainflow.generation.search import DraftBatch, committed_tails
from hf_chainflow.generation.settings import SearchSettings, SpeculativeSettings
from hf_chainflow.targets import load_target
from windows import held_out_windows

N = int(sys.argv[1])
torch.set_num_threads(1)
target, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
drafter = ChainFlowDrafter.from_pretrained(default_drafter_path(), target=target).eval()
settings = SpeculativeSettings.from_drafter(drafter).replace(lookup_num_tokens=None, lookup_trust_ngram=None, lookup_max_tokens=None)
kwargs = settings.draft_kwargs(10 ** 6)
C, p, pad = drafter.context_size, drafter.config.path_order, drafter.config.pad_token_id or 0
search = SearchSettings(**{k: v for k, v in kwargs.items() if k != "num_flow_steps"}, max_depth=drafter.max_draft_depth)
tables0 = serving.serving_tables
setups = {"unpacked,py": (False, False), "packed,py": (True, False), "unpacked,cpp": (False, True), "packed,cpp": (True, True)}
rounds = {k: CompiledDraftingRound(cpp_wrapper=v[1]) for k, v in setups.items()}
counts = {k: {"same": 0, "near-tie": 0, "different": 0} for k in setups}
gaps = {k: 0.0 for k in setups}
with torch.inference_mode():
    for done, states, committed in held_out_windows(target, C, N):
        tables = tables0(drafter)._replace(velocity=drafter.velocity, head_linear=None, folded_linear=None)
        want = DraftBatch(*drafting_round(drafter, tables, states, committed_tails(committed, p, pad), search, kwargs["num_flow_steps"])).tree(0)
        for k, (packed, cpp) in setups.items():
            drafting.serving_tables = tables0 if packed else (lambda d: tables0(d)._replace(head_linear=None, folded_linear=None))
            drafter._runtime["compiled_round"] = rounds[k]
            got = drafting.draft(drafter, states, committed, **kwargs, compile=True)
            v = compare_drafts(want, got); counts[k][v] += 1
            if v == "same":
                gaps[k] = max(gaps[k], float((want.logprobs - got.logprobs).abs().max()))
            elif v == "different" and k == "packed,cpp":
                print("window", done, k, "want", want.tokens.tolist(), want.logprobs.tolist()[:4], "got", got.tokens.tolist(), got.logprobs.tolist()[:4], flush=True)
for k in setups:
    print(k, counts[k], f"max gap {gaps[k]:.2e}")
