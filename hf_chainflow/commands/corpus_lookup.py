"""`hf-chainflow corpus-lookup`: give a drafter a corpus-lookup table built from the target's responses.

    hf-chainflow corpus-lookup --drafter DRAFTER_DIR --corpus CORPUS_DIR --out NEW_DRAFTER_DIR [--num-tokens 6]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_chainflow.cli_args import check_model_source, check_writable_output, positive_int


def add_corpus_lookup_parser(sub) -> None:
    p = sub.add_parser("corpus-lookup", help="Add a corpus-lookup table (the target's responses) to a drafter.",
                       description="Count every n-gram of the corpus's greedy responses and the token the target "
                                   "wrote after it most often; save the drafter with that table and the branch "
                                   "turned on (`generation_config.corpus_lookup_num_tokens`).")
    a = p.add_argument
    a("--drafter", required=True, help="drafter directory or Hub id (save_pretrained)")
    a("--corpus", required=True, help="corpus folder of the target's responses (hf-chainflow generate-responses)")
    a("--out", required=True, help="directory to save the drafter with its table (may be --drafter itself)")
    a("--num-tokens", type=positive_int, default=6, help="corpus_lookup_num_tokens: longest branch per round")
    a("--split", default="train", help="the corpus split to count (default train; never the held-out split you "
                                       "judge on)")
    a("--min-count", type=positive_int, default=2, help="keep n-grams seen at least this many times")
    a("--max-ngram", type=positive_int, help="longest n-gram (default: 4, or what a 64-bit key holds)")
    a("--prompt-tail", type=int, default=4, help="prompt tokens counted before each response")
    p.set_defaults(func=run_corpus_lookup)


def run_corpus_lookup(args: argparse.Namespace) -> int:
    check_model_source("--drafter", args.drafter)
    if not Path(args.corpus).is_dir():
        raise ValueError(f"`--corpus` must be a corpus folder, got {args.corpus!r}, which does not exist.")
    check_writable_output("--out", args.out)
    from hf_chainflow.training.corpus import ResponseCorpus
    from hf_chainflow.training.workflows import add_corpus_lookup

    ResponseCorpus(args.corpus)  # a corpus (its corpus.json reads), before the drafter loads

    table = add_corpus_lookup(args.drafter, args.corpus, args.out, num_tokens=args.num_tokens, split=args.split,
                              min_count=args.min_count, max_ngram=args.max_ngram, prompt_tail=args.prompt_tail)
    print(f"{len(table):,} n-grams ({table.min_ngram}-{table.max_ngram} tokens) from {args.corpus} -> {args.out}")
    return 0
