"""`hf-chainflow`: prepare data, train and evaluate ChainFlow drafters, benchmark and demo speculative decoding.

    hf-chainflow generate-responses --prompts P.jsonl --corpus DIR # the target's responses into a corpus
    hf-chainflow prepare --responses responses.jsonl --out DIR     # cache hidden states of given responses
    hf-chainflow prepare --prompts prompts.jsonl --out DIR         # generate greedy responses first
    hf-chainflow train --data DIR --out DRAFTER                    # train a drafter
    hf-chainflow eval-offline --drafter DRAFTER --data DIR         # offline acceptance length tau
    hf-chainflow corpus-lookup --drafter D --corpus C --out D2    # add a corpus-lookup table to a drafter
    hf-chainflow bench --limit 16                                  # wall-clock speedup of ar/pld/chain/tree arms
    hf-chainflow demo                                              # stream speculative generations
    hf-chainflow calibrate                                         # the machine's cost curve (tree_budget="auto")

One module per subcommand (`generate_responses.py`, `prepare.py`, `train.py`, `eval_offline.py`,
`corpus_lookup.py`, `bench.py`, `demo.py`, `calibrate.py`), each holding its argument parsing
(`add_<name>_parser`) and one `run_<name>` that checks the options and calls the library; torch is imported there, when the subcommand runs, not
when the parser is built.
"""

from __future__ import annotations

import argparse
import os

from hf_chainflow.commands.bench import add_bench_parser
from hf_chainflow.commands.calibrate import add_calibrate_parser
from hf_chainflow.commands.corpus_lookup import add_corpus_lookup_parser
from hf_chainflow.commands.demo import add_demo_parser
from hf_chainflow.commands.eval_offline import add_eval_offline_parser
from hf_chainflow.commands.generate_responses import add_generate_responses_parser
from hf_chainflow.commands.prepare import add_prepare_parser
from hf_chainflow.commands.train import add_train_parser
from hf_chainflow.fileio import FolderBusyError

# Errors of the user's input (our `ValueError`s name the option and the fix; a missing or misplaced file is an
# `OSError`; a folder another job is writing, a `FolderBusyError` naming that job): printed as one line, like
# argparse's own errors. HF_CHAINFLOW_TRACEBACK=1 shows the traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, FolderBusyError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-chainflow", description=__doc__.splitlines()[0],
                                     epilog="Set HF_CHAINFLOW_TRACEBACK=1 to see the traceback of an error.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_responses_parser(sub)
    add_prepare_parser(sub)
    add_train_parser(sub)
    add_eval_offline_parser(sub)
    add_corpus_lookup_parser(sub)
    add_bench_parser(sub)
    add_demo_parser(sub)
    add_calibrate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `hf-chainflow` console script (`python -m hf_chainflow.commands` does the same)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as err:
        if os.environ.get("HF_CHAINFLOW_TRACEBACK"):
            raise
        raise SystemExit(f"hf-chainflow {args.command}: error: {err}") from None


__all__ = ["USER_ERRORS", "build_parser", "main"]
