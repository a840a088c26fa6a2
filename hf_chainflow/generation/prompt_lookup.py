"""Prompt lookup as an extra branch of a ChainFlow draft (optional; off by default).

SmolLM2's answers often copy spans of their own prompt or of what they already wrote (retrieval contexts, code,
summaries). A learned drafter cannot copy text it never sees; an n-gram match over the committed tokens can, for
free. With `drafter.generation_config.lookup_num_tokens = k`, each round of hf_chainflow's own loop looks the
last n-gram up (longest first, `lookup_ngram` down to 1) in the committed tokens, takes the `k` tokens that
followed its latest earlier occurrence, and

- adds them to the ChainFlow tree as one more root-to-leaf branch (shared prefixes merge), or
- when the match is at least `lookup_trust_ngram` tokens long, verifies that branch alone and skips drafting.

With `lookup_max_tokens = m` (default None: fixed length), a branch verified alone and accepted whole is followed
by one twice as long, up to `m`, and one accepted in part by one as long as what held (+1), never below `k`: long
copies (a retrieved passage, a repeated code block) then take fewer rounds. Merged branches keep `k` tokens, so
the tree's verify stays narrow.

Verification is unchanged (one forward, greedy path matching), so the output stays exactly plain greedy decoding;
with `do_sample=True` the branch is accepted child by child as a fixed proposal (`accept_sampling_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_chainflow.generation.settings import lookup_settings  # noqa: F401  (the rules of the `lookup_*` fields; `hf_chainflow.bench` reads
# them from here)


def prompt_lookup(committed: torch.LongTensor, num_tokens: int, max_ngram: int = 3,
                  min_ngram: int = 1) -> tuple[torch.LongTensor | None, int]:
    """Continuation of the last n-gram of `committed` `(L,)` at its latest earlier occurrence.

    Tries `n = max_ngram .. min_ngram`; returns `(tokens (<= num_tokens,), n)` for the first `n` that matches, or
    `(None, 0)`.
    """
    if committed.dim() != 1:
        raise ValueError(f"`committed` must be the committed token ids of one sequence, shape (L,), got "
                         f"{tuple(committed.shape)}; pass `ids[0]` for a batch of one.")
    if not 1 <= min_ngram <= max_ngram or num_tokens < 1:
        raise ValueError(f"Need 1 <= min_ngram <= max_ngram and num_tokens >= 1, got min_ngram={min_ngram}, "
                         f"max_ngram={max_ngram}, num_tokens={num_tokens}.")
    L = committed.shape[0]
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        pattern = committed[L - n:]  # (n,)
        windows = committed[: L - 1].unfold(0, n, 1)  # (L-n, n): window i covers i..i+n-1, followed by i+n <= L-1
        hits = (windows == pattern).all(1).nonzero()[:, 0]  # (h,)
        if hits.numel():
            start = int(hits[-1]) + n
            return committed[start: start + num_tokens], n
    return None, 0


def next_lookup_length(current: int, held: int, verified: int, base: int, longest: int) -> int:
    """Length of the next looked-up branch after one verified alone: `held` of its `verified` tokens were accepted.

    Accepted whole -> twice `current`; in part -> `held + 1`; always within `[base, longest]`.
    """
    grown = 2 * current if held == verified else held + 1
    return max(base, min(grown, longest))


@dataclass(frozen=True)
class RoundBranches:
    """The looked-up branches of one round: `lookup` (prompt lookup, `(k,)` or None), `trusted` (verify `lookup`
    alone, without a drafter pass) and `recalled` (corpus lookup, `hf_chainflow.generation.corpus_lookup`, or None)."""

    lookup: torch.LongTensor | None = None
    trusted: bool = False
    recalled: torch.LongTensor | None = None


def round_branches(committed: torch.LongTensor, room: int, lookup_len: int | None, settings,
                   table=None) -> RoundBranches:
    """The branches a round adds to its draft, for the committed tokens `committed` `(L,)` of one row with `room`
    tokens left before `max_length`. `settings` is the call's `SpeculativeSettings` (`lookup_*`,
    `corpus_lookup_*`), `lookup_len` the current prompt-lookup length (it grows with `lookup_max_tokens`), `table`
    the drafter's `ContinuationTable` (read when `corpus_lookup_num_tokens` is set)."""
    if room < 1:
        return RoundBranches()
    lookup, ngram = None, 0
    if settings.lookup_num_tokens is not None:
        lookup, ngram = prompt_lookup(committed, min(lookup_len, room), settings.lookup_ngram)
    trusted = lookup is not None and settings.lookup_trust_ngram is not None and ngram >= settings.lookup_trust_ngram
    if lookup is not None and not trusted:  # merged into a tree: the base length keeps the verify narrow
        lookup = lookup[: settings.lookup_num_tokens]
    recalled = None
    if settings.corpus_lookup_num_tokens is not None:  # every round, beside a drafted tree or a trusted branch
        recalled = table.propose(committed, min(settings.corpus_lookup_num_tokens, room))
    return RoundBranches(lookup, trusted, recalled)
