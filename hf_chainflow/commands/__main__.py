"""`python -m hf_chainflow.commands ...` = `hf-chainflow ...` (e.g. under `torchrun -m`)."""

import sys

from hf_chainflow.commands import main

sys.exit(main())
