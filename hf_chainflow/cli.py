"""The former home of the `hf-chainflow` command, kept as an alias: `hf_chainflow.cli.main` and
`python -m hf_chainflow.cli ...` (e.g. `torchrun -m hf_chainflow.cli train ...`) run `hf_chainflow.commands.main`."""

import sys

from hf_chainflow.commands import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
