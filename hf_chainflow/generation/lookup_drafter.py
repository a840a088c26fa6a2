"""Prompt lookup without a drafter model, in hf_chainflow's loop: `assistant_model=PromptLookupDrafter(...)`.

transformers' own prompt lookup (`generate(prompt_lookup_num_tokens=k)`) runs in its assisted loop, eagerly on a
dynamic cache. The same idea in hf_chainflow's loop (`hf_chainflow.generation.prompt_lookup`: the last n-gram,
`ngram` tokens down to 1, looked up in the committed tokens, the `num_tokens` that followed its latest occurrence
verified as a chain) can verify compiled (`compile_verification=True`, `hf_chainflow.generation.compiled_verification`)
and take a batch of prompts; its output is plain `generate`'s, greedy or sampled.

    drafter = PromptLookupDrafter(num_tokens=10, compile_verification=True)
    out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=128)
    drafter.last_stats.tau                    # tokens per target forward
"""

from __future__ import annotations

from transformers import GenerationConfig

from hf_chainflow.checks import is_int

__all__ = ["PromptLookupDrafter"]


class PromptLookupDrafter:
    """A drafter with no model: each round proposes the prompt-lookup branch alone (`LookupProposer`).

    Args:
        num_tokens: tokens proposed per round (`lookup_num_tokens`).
        ngram: the longest n-gram looked up (`lookup_ngram`; tried down to 1).
        trust_ngram / max_tokens: a match of at least `trust_ngram` tokens grows while it holds, up to `max_tokens`
            (`lookup_trust_ngram`, `lookup_max_tokens`; default off: a fixed length, as transformers' lookup).
        compile_verification: verify compiled on a static cache (see `compiled_verification`).

    Its settings live in `generation_config`, as a drafter's do; `last_stats` holds the last call's statistics.
    """

    is_chainflow_drafter = True  # `generate(assistant_model=...)` routes it to hf_chainflow's loop
    is_bound = True  # nothing to bind: it reads only the committed tokens
    context_size = 1
    max_draft_depth = None
    state_layers = ()
    lookup_only = True  # `proposers.make_proposer` gives it the lookup branch alone

    def __init__(self, num_tokens: int = 10, ngram: int = 3, trust_ngram: int | None = None,
                 max_tokens: int | None = None, compile_verification: bool = False):
        for name, value in (("num_tokens", num_tokens), ("ngram", ngram)):
            if not is_int(value) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        self.generation_config = GenerationConfig(
            draft_mode="chain", num_assistant_tokens=1, num_assistant_tokens_schedule="constant",
            lookup_num_tokens=num_tokens, lookup_ngram=ngram, lookup_trust_ngram=trust_ngram,
            lookup_max_tokens=max_tokens, compile_verification=compile_verification)
        self.last_stats = None

    def check_target(self, target) -> None:
        """Any target: prompt lookup reads only token ids."""

    def __repr__(self) -> str:
        g = self.generation_config
        return (f"PromptLookupDrafter(num_tokens={g.lookup_num_tokens}, ngram={g.lookup_ngram}, "
                f"trust_ngram={g.lookup_trust_ngram}, max_tokens={g.lookup_max_tokens}, "
                f"compile_verification={g.compile_verification})")
