"""`hf-chainflow demo`: speculative decoding on the embedded default target and drafter, streamed, then compared
with plain generation of the same prompts.

    hf-chainflow demo                                  # the drafter's own settings (best measured), 3 prompts
    hf-chainflow demo --mode chain --dtype float32     # chain drafting; float32 outputs equal plain greedy exactly
    hf-chainflow demo --no-lookup                      # pure ChainFlow drafting (no prompt-lookup branch)

Each prompt is generated greedily with the drafter (`generate(assistant_model=drafter, streamer=TextStreamer)`),
then plainly (same dtype, unprinted). The demo prints tau (tokens per target forward after the prefill, bonus
included), the speedup (pooled plain time per token / pooled speculative time per token) and whether the outputs
are identical. In bfloat16 an output may differ on a near-tie (see `hf_chainflow.bench.numerics`); float32 is exact.
The dtype is bfloat16 unless the CPU is known to lack bfloat16 matrix instructions (no AMX, no AVX-512 BF16): there
multi-token verification in bfloat16 costs several plain steps, so the demo runs in float32 and says so
(`hf_chainflow.bench.machine.demo_dtype`); `--dtype bfloat16` on such a CPU first prints a note
(`bf16_hardware_note`).
"""

from __future__ import annotations

import argparse
import os

from hf_chainflow.cli_args import check_model_source, positive_int


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="Stream speculative generations on the embedded default model and drafter.",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct", help="known target name or local model directory")
    p.add_argument("--drafter-path", help="ChainFlow drafter directory (default: the drafter shipped in the package)")
    p.add_argument("--mode", choices=("chain", "tree"), help="draft mode (default: the drafter's generation config)")
    p.add_argument("--no-lookup", action="store_true", help="switch the prompt-lookup branch off (pure ChainFlow)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="target dtype (default: bfloat16; float32 on a CPU without bfloat16 matrix instructions)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: 3 built-in prompts)")
    p.add_argument("--max-new-tokens", type=positive_int, default=96, help="new tokens per prompt (default 96)")
    p.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: all cores)")
    p.set_defaults(func=run_demo_command)


def run_demo_command(args: argparse.Namespace) -> int:
    if args.drafter_path:  # before anything loads
        check_model_source("--drafter-path", args.drafter_path)
    import torch

    from hf_chainflow.bench.machine import bf16_hardware_note, demo_dtype
    from hf_chainflow.checkpoints import default_drafter_path
    from hf_chainflow.commands.demo_run import DEMO_PROMPTS, demo

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    path = args.drafter_path or default_drafter_path()
    dtype = args.dtype or demo_dtype()
    if args.dtype is None and dtype == "float32":
        print(f"dtype: float32 (this CPU has no native bfloat16 matrix instructions; torch reports "
              f"{torch.backends.cpu.get_cpu_capability()}: verifying several tokens in bfloat16 costs several plain "
              "steps here). `--dtype bfloat16` runs in bfloat16.")
    note = bf16_hardware_note() if dtype == "bfloat16" else None
    if note is not None:
        print(note)
    demo(args.target, path, dtype, args.prompt or DEMO_PROMPTS, mode=args.mode,
         lookup=False if args.no_lookup else None, max_new_tokens=args.max_new_tokens)
    return 0


__all__ = ["add_demo_parser", "run_demo_command"]
