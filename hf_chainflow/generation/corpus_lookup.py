"""Corpus lookup: the target's most frequent continuation of the last n-gram, read from its own responses.

Prompt lookup (`hf_chainflow.generation.prompt_lookup`) copies from the text in front of the target; corpus lookup copies from what
the target wrote for other prompts. A `ContinuationTable` is built once from the corpus of the target's responses
(`hf_chainflow.training.corpus`; built by `hf_chainflow.training.corpus_lookup.table_from_corpus`): for every n-gram
of `min_ngram .. max_ngram` tokens seen at least `min_count` times, the token that followed it most often. A draft branch is read from it greedily, one token at a time, each from the
longest n-gram of the committed tokens (plus the tokens already proposed) that the table holds, until no n-gram
matches or the branch is `num_tokens` long.

The table is only a proposal: every token is verified by the target like any drafted node, so the output stays
exactly plain greedy decoding (with `do_sample=True` the branch is accepted child by child as a fixed proposal).

Storage: one sorted `int64` key per n-gram (its tokens packed `bits` bits each, `token + 1` so that n-grams of
different lengths never share a key) and the `int32` token that followed it. Packing is exact, so `max_ngram * bits`
must fit in 64 bits (SmolLM2's 49,152 tokens: 16 bits, up to 4-grams).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from hf_chainflow.models.chainflow.validation_chainflow import check_table_shape, token_bits  # noqa: F401  (re-exported)


def pack_ngrams(windows: np.ndarray, bits: int) -> np.ndarray:
    """`(N, n)` token ids -> `(N,)` int64 keys (`token + 1` in `bits`-bit fields, oldest token lowest)."""
    keys = np.zeros(windows.shape[0], dtype=np.uint64)
    for i in range(windows.shape[1]):
        keys |= (windows[:, i].astype(np.uint64) + np.uint64(1)) << np.uint64(bits * i)
    return keys.view(np.int64)


class ContinuationTable:
    """The most frequent next token of every n-gram the target wrote often enough (see the module docstring).

    Args:
        keys: `(E,)` int64, sorted: the packed n-grams (`pack_ngrams`).
        next_tokens: `(E,)` int32: the token that followed each most often.
        vocab_size, min_ngram, max_ngram: the sizes the keys were packed with.
    """

    def __init__(self, keys: torch.Tensor, next_tokens: torch.Tensor, *, vocab_size: int, min_ngram: int,
                 max_ngram: int):
        check_table_shape(vocab_size, min_ngram, max_ngram)
        if keys.dim() != 1 or keys.shape != next_tokens.shape or keys.dtype != torch.int64:
            raise ValueError(f"`keys` must be a 1-D int64 tensor with one entry per `next_tokens` entry, got "
                             f"{tuple(keys.shape)} {keys.dtype} and {tuple(next_tokens.shape)}.")
        self.keys, self.next_tokens = keys, next_tokens
        self.vocab_size, self.min_ngram, self.max_ngram = vocab_size, min_ngram, max_ngram
        self.bits = token_bits(vocab_size)

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], *, vocab_size: int, min_ngram: int = 2, max_ngram: int = 4,
              min_count: int = 2) -> "ContinuationTable":
        """Count every `min_ngram .. max_ngram`-gram of `sequences` (token id lists) and the token after it; keep
        the n-grams seen at least `min_count` times with their most frequent next token (ties: the smallest id)."""
        check_table_shape(vocab_size, min_ngram, max_ngram, min_count)
        bits = token_bits(vocab_size)
        keys, nexts = [], []
        for seq in sequences:
            ids = np.asarray(seq, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"`sequences` hold token ids outside [0, {vocab_size}): "
                                 f"{int(ids.min())}..{int(ids.max())}; pass the target's token ids.")
            for n in range(min_ngram, max_ngram + 1):
                if ids.size <= n:
                    continue
                windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # (L-n, n): window i precedes i+n
                keys.append(pack_ngrams(windows, bits))
                nexts.append(ids[n:])
        if not keys:
            return cls(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32), vocab_size=vocab_size,
                       min_ngram=min_ngram, max_ngram=max_ngram)
        key, nxt = np.concatenate(keys), np.concatenate(nexts)
        order = np.lexsort((nxt, key))  # by key, then next token
        key, nxt = key[order], nxt[order]
        # Runs of equal (key, next) -> counts; then per key the next token with the largest count.
        pair_start = np.flatnonzero(np.r_[True, (key[1:] != key[:-1]) | (nxt[1:] != nxt[:-1])])
        pair_count = np.diff(np.r_[pair_start, key.size])
        pkey, pnext = key[pair_start], nxt[pair_start]
        best = np.lexsort((-pair_count, pkey))  # by key, largest count first (stable: smallest id on ties)
        pkey, pnext, pair_count = pkey[best], pnext[best], pair_count[best]
        first = np.r_[True, pkey[1:] != pkey[:-1]]
        keep = first & (pair_count >= min_count)
        return cls(torch.from_numpy(pkey[keep].copy()), torch.from_numpy(pnext[keep].astype(np.int32)),
                   vocab_size=vocab_size, min_ngram=min_ngram, max_ngram=max_ngram)

    def propose(self, committed: torch.LongTensor, num_tokens: int) -> torch.LongTensor | None:
        """Up to `num_tokens` tokens continuing `committed` `(L,)`, or None when no n-gram of its end is known."""
        if committed.dim() != 1:
            raise ValueError(f"`committed` must be the committed token ids of one sequence, shape (L,), got "
                             f"{tuple(committed.shape)}.")
        if len(self) == 0 or num_tokens < 1:
            return None
        lengths = list(range(self.max_ngram, self.min_ngram - 1, -1))
        ctx = [int(t) + 1 for t in committed[-self.max_ngram:].tolist()]  # packed codes, oldest first
        out: list[int] = []
        for _ in range(num_tokens):
            queries = []
            for n in lengths:
                if len(ctx) < n:
                    continue
                key = 0
                for i, code in enumerate(ctx[-n:]):
                    key |= code << (self.bits * i)
                queries.append(key - (1 << 64) if key >= 1 << 63 else key)  # the int64 view of the packed key
            if not queries:
                break
            q = torch.tensor(queries, dtype=torch.int64)
            pos = torch.searchsorted(self.keys, q).clamp_(max=len(self) - 1)
            hit = (self.keys[pos] == q).nonzero()
            if hit.numel() == 0:
                break
            token = int(self.next_tokens[pos[hit[0, 0]]])  # the longest n-gram that is known
            out.append(token)
            ctx = ctx[1:] + [token + 1] if len(ctx) >= self.max_ngram else ctx + [token + 1]
        return committed.new_tensor(out) if out else None


__all__ = ["ContinuationTable", "check_table_shape", "pack_ngrams", "token_bits"]
