"""`python -m hf_chainflow.vllm config [--drafter-path DIR] [--num-speculative-tokens K] [--set NAME=VALUE ...]`:
print the `--speculative-config` JSON for `vllm serve` (see `hf_chainflow.vllm.speculative_config`)."""

from __future__ import annotations

import argparse
import json
import sys

from hf_chainflow.cli_args import check_model_source
from hf_chainflow.vllm.settings import speculative_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_chainflow.vllm", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("config", help="print the speculative config JSON for `vllm serve --speculative-config`")
    c.add_argument("--drafter-path", help="a saved ChainFlow drafter (default: the shipped one)")
    c.add_argument("--num-speculative-tokens", type=int, default=3, help="chain length (default 3)")
    c.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a drafting setting, e.g. num_flow_steps=2 or lookup_trust_ngram=2 (the value is JSON)")
    args = p.parse_args(argv)
    settings = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set takes NAME=VALUE, got {item!r}")
        try:
            settings[name] = json.loads(value)
        except json.JSONDecodeError:
            settings[name] = value
    try:
        if args.drafter_path is not None:
            check_model_source("--drafter-path", args.drafter_path)
        spec = speculative_config(args.drafter_path, args.num_speculative_tokens, **settings)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
