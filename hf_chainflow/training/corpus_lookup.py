"""Building a corpus-lookup table from a response corpus (the training side of corpus lookup): `table_from_corpus`
reads the target's greedy responses of a `ResponseCorpus` into a `ContinuationTable`
(`hf_chainflow.generation.corpus_lookup`, which reads draft branches from it at decode time). Behind
`hf-chainflow corpus-lookup` (`hf_chainflow.training.workflows.add_corpus_lookup`)."""

from __future__ import annotations

from hf_chainflow.checks import is_int
from hf_chainflow.generation.corpus_lookup import ContinuationTable, token_bits
from hf_chainflow.training.corpus import ResponseCorpus

__all__ = ["table_from_corpus"]


def table_from_corpus(corpus, *, split: str = "train", prompt_tail: int = 4, min_ngram: int = 2,
                      max_ngram: int | None = None, min_count: int = 2) -> ContinuationTable:
    """The continuation table of a corpus of the target's responses (`hf_chainflow.training.corpus.ResponseCorpus` or its
    folder): every greedy response of `split`, after the last `prompt_tail` tokens of its prompt (the chat template's
    assistant header, so that a response's first tokens have a context too). `max_ngram` None: the longest that
    fits a 64-bit key, at most 4."""
    if not is_int(prompt_tail) or prompt_tail < 0:
        raise ValueError(f"`prompt_tail` must be a non-negative integer (prompt tokens kept before each response), "
                         f"got {prompt_tail!r}.")
    corpus = corpus if isinstance(corpus, ResponseCorpus) else ResponseCorpus(corpus)
    vocab = corpus.vocab_size
    if max_ngram is None:
        max_ngram = max(min_ngram, min(4, 64 // token_bits(vocab)))
    rows = [r for r in corpus.table(split, ["prompt_ids", "response_ids", "do_sample"]).to_pylist()
            if not r["do_sample"]]
    if not rows:
        raise ValueError(f"The corpus {str(corpus.path)!r} holds no greedy `{split}` responses; generate some first "
                         f"(`hf-chainflow generate-responses`).")
    return ContinuationTable.build(((r["prompt_ids"][-prompt_tail:] if prompt_tail else []) + r["response_ids"]
                                    for r in rows), vocab_size=vocab, min_ngram=min_ngram, max_ngram=max_ngram,
                                   min_count=min_count)
