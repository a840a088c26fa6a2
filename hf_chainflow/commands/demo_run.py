"""The demo behind `hf-chainflow demo`: stream speculative generations of a few prompts, then time plain generation of
the same prompts and compare (tau, speedup, identical outputs; each difference classified as the bench does,
`hf_chainflow.bench.numerics`).
"""

from __future__ import annotations

import time

import torch

from hf_chainflow.bench.defaults import DEFAULT_TIE_TOLERANCE
from hf_chainflow.checks import check_positive_int
from hf_chainflow.bench.numerics import explain_mismatch
from hf_chainflow.generation.stats import SpeculativeStats

DEMO_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a short docstring.",
    "Explain in three sentences why the sky is blue.",
    "Translate into French: \"The weather is lovely today, so we are going for a walk in the park.\"",
)


def _silent_streamer(tokenizer):
    """A `TextStreamer` that decodes like the printing one but prints nothing (fair timing of the plain runs)."""
    from transformers import TextStreamer

    class SilentStreamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False):
            pass

    return SilentStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def describe_settings(g) -> str:
    """One line naming the drafting settings of a generation config, e.g. `tree 8x4 cut to 12 nodes + prompt-lookup
    branch of 10`."""
    if g.draft_mode == "chain":
        text = f"chain of {g.num_assistant_tokens}"
    else:
        budget = getattr(g, "tree_budget", None)
        text = f"tree {g.tree_width}x{g.tree_depth}" + (f" cut to {budget} nodes" if budget else "")
    k = getattr(g, "lookup_num_tokens", None)
    if k:
        trust, longest = getattr(g, "lookup_trust_ngram", None), getattr(g, "lookup_max_tokens", None)
        if trust:
            grows = f", growing to {longest} while accepted whole" if longest else ""
            text += f" + prompt-lookup branch of {k} (alone on {trust}-gram matches{grows})"
        else:
            text += f" + prompt-lookup branch of {k}"
    corpus = getattr(g, "corpus_lookup_num_tokens", None)
    if corpus:
        text += f" + corpus-lookup branch of {corpus}"
    return text


def run_demo(target, tokenizer, drafter, prompts=DEMO_PROMPTS, *, mode: str | None = None, lookup: bool | None = None,
             max_new_tokens: int = 96, print_fn=print) -> dict:
    """Stream speculative generations of `prompts`, then time plain generation of the same prompts.

    `drafter` must be bound to `target`; `mode` is `"chain"` or `"tree"` (`None`: the drafter's `generation_config`;
    the shape stays the drafter's); `lookup=False` switches the prompt-lookup branch off (`None`: the drafter's
    setting). Returns `{"tau", "speedup", "identical", "differences", "speculative_seconds", "plain_seconds", ...}`,
    where `differences` classifies each output that differs from plain generation as the bench does.
    """
    from transformers import TextStreamer

    if mode not in (None, "chain", "tree"):
        raise ValueError(f"`--mode` must be 'chain' or 'tree', got {mode!r}.")
    check_positive_int("--max-new-tokens", max_new_tokens)
    if not prompts:
        raise ValueError("`prompts` is empty: give at least one prompt.")
    g = drafter.generation_config
    if mode is not None:
        g.draft_mode = mode
    if lookup is False:
        g.lookup_num_tokens = None
    mode = g.draft_mode
    described = describe_settings(g)
    print_fn(f"drafting: {described}")
    gen = target.generation_config
    encoded = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"] for p in prompts]

    def generate(ids, n, **kw):
        with torch.inference_mode():
            start = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                  eos_token_id=gen.eos_token_id, pad_token_id=gen.pad_token_id, **kw)
            return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start

    generate(encoded[0], 4)  # warm-up, both paths
    generate(encoded[0], 4, assistant_model=drafter)

    spec, plain, pooled = [], [], SpeculativeStats(mode=mode, loop="chainflow")
    for i, (text, ids) in enumerate(zip(prompts, encoded), 1):
        print_fn(f"\n[{i}/{len(prompts)}] {text}\n")
        tokens, seconds = generate(ids, max_new_tokens, assistant_model=drafter,
                                   streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
        stats = drafter.last_stats
        pooled.accepted += stats.accepted
        pooled.drafted_depth += stats.drafted_depth
        spec.append((tokens, seconds))
        print_fn(f"  ({len(tokens)} tokens, {len(tokens) / seconds:.1f} tok/s, tau {stats.tau:.2f})")
    print_fn("\nplain generation of the same prompts for comparison ...")
    for ids in encoded:
        plain.append(generate(ids, max_new_tokens, streamer=_silent_streamer(tokenizer)))

    spec_rate = sum(len(t) for t, _ in spec) / sum(s for _, s in spec)
    plain_rate = sum(len(t) for t, _ in plain) / sum(s for _, s in plain)
    dtype = str(target.dtype).replace("torch.", "")
    differences = _classify_differences(target, encoded, spec, plain, dtype)
    differing = {d["prompt"] for d in differences}
    identical = [i not in differing for i in range(1, len(prompts) + 1)]
    summary = {"mode": mode, "settings": described, "dtype": dtype, "tau": pooled.tau,
               "acceptance_per_depth": pooled.acceptance_per_depth(), "speculative_tokens_per_second": spec_rate,
               "plain_tokens_per_second": plain_rate, "speedup": spec_rate / plain_rate,
               "identical": identical, "differences": differences, "speculative_seconds": sum(s for _, s in spec),
               "plain_seconds": sum(s for _, s in plain)}
    print_fn(f"\n{described}, {dtype}: tau {pooled.tau:.2f} tokens per target forward, "
             f"{spec_rate:.1f} tok/s vs plain {plain_rate:.1f} tok/s -> speedup {summary['speedup']:.2f}x; "
             f"outputs identical to plain generation on {sum(identical)}/{len(identical)} prompts")
    for d in differences:
        kind = "a near-tie" if d["kind"] == "near_tie" else f"UNEXPLAINED ({d['reason']})"
        gap = "" if d["gap"] is None else f", plain logit gap {d['gap']:+.3f}"
        print_fn(f"  prompt {d['prompt']}: first differs at new token {d['position']} (plain {d['ar_token']}, "
                 f"speculative {d['arm_token']}{gap}): {kind}")
    if differences and all(d["kind"] == "near_tie" for d in differences):
        print_fn(f"  ({dtype}: scoring several tokens in one forward rounds differently from one at a time and flips "
                 "near-ties; `--dtype float32` is exact)")
    return summary


def _classify_differences(target, encoded, spec, plain, dtype: str) -> list[dict]:
    """Each prompt whose speculative tokens differ from plain generation's, classified as the bench does
    (`hf_chainflow.bench.numerics.explain_mismatch`): the first diverging position and whether the plain model of
    this dtype scores the two tokens as a near-tie."""
    differences = []
    for i, (ids, (spec_tokens, _), (plain_tokens, _)) in enumerate(zip(encoded, spec, plain), 1):
        d = explain_mismatch(target, ids, plain_tokens, spec_tokens, dtype, DEFAULT_TIE_TOLERANCE)
        if d is not None:
            differences.append({"prompt": i, **d})
    return differences



def demo(target: str, drafter_path: str | None = None, dtype: str = "bfloat16", prompts=DEMO_PROMPTS, *,
         mode: str | None = None, lookup: bool | None = None, max_new_tokens: int = 96, print_fn=print) -> dict:
    """`run_demo` on a target loaded by name or path (`hf_chainflow.targets.load_model_and_tokenizer`, in `dtype`)
    and the float32 drafter at `drafter_path` (default: the drafter shipped for the default target)."""
    from hf_chainflow.checkpoints import default_drafter_path
    from hf_chainflow.models.chainflow.modeling_chainflow import ChainFlowDrafter
    from hf_chainflow.targets import load_model_and_tokenizer

    path = drafter_path or default_drafter_path()
    model, tokenizer = load_model_and_tokenizer(target, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    drafter = ChainFlowDrafter.from_pretrained(path, target=model, dtype=torch.float32).eval()
    return run_demo(model, tokenizer, drafter, prompts, mode=mode, lookup=lookup, max_new_tokens=max_new_tokens,
                    print_fn=print_fn)


__all__ = ["DEMO_PROMPTS", "demo", "describe_settings", "run_demo"]
