"""Checks of drafter settings shared by the configuration, the model and `hf_chainflow.generation`.

They live here, beside the model, so that the dependencies point downward (generation and training import the
model side, never the reverse). Standard library only (`hf_chainflow.checks` besides): importing this module imports
neither torch nor transformers (the command line checks its options with `check_num_flow_steps` before loading
anything).
"""

from __future__ import annotations

from hf_chainflow.checks import is_int


def check_num_flow_steps(value, name: str = "num_flow_steps") -> None:
    """Euler steps of a drafting pass: None (the drafter's `config.num_flow_steps`) or a positive integer."""
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"`{name}` must be None (use the drafter's `config.num_flow_steps`) or a positive integer "
                         f"(Euler steps per drafter pass), got {value!r}.")


def token_bits(vocab_size: int) -> int:
    """Bits per packed token of a corpus-lookup table (`hf_chainflow.generation.corpus_lookup`): enough for
    `token + 1` with `0 <= token < vocab_size`."""
    return max(1, int(vocab_size).bit_length())


def check_table_shape(vocab_size: int, min_ngram: int, max_ngram: int, min_count: int = 1, *,
                      prefix: str = "") -> None:
    """The rules of a corpus-lookup table's sizes (`ValueError` naming the value, the rule and the fix); `prefix`
    names the fields as their owner does (the drafter config's `continuation_min_ngram`, ...)."""
    for name, value in (("vocab_size", vocab_size), (f"{prefix}min_ngram", min_ngram),
                        (f"{prefix}max_ngram", max_ngram), ("min_count", min_count)):
        if not is_int(value) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    if min_ngram > max_ngram:
        raise ValueError(f"`{prefix}min_ngram` ({min_ngram}) cannot exceed `{prefix}max_ngram` ({max_ngram}).")
    bits = token_bits(vocab_size)
    if max_ngram * bits > 64:
        raise ValueError(f"`{prefix}max_ngram` ({max_ngram}) n-grams of a {vocab_size}-token vocabulary need "
                         f"{max_ngram * bits} bits, more than a 64-bit key holds; use `{prefix}max_ngram` <= "
                         f"{64 // bits}.")


__all__ = ["check_num_flow_steps", "check_table_shape", "token_bits"]
