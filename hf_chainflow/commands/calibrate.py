"""`hf-chainflow calibrate`: measure (or read from the cache) the machine's cost curve of a target's verification
forward, which `tree_budget="auto"` sizes each round's draft with.

    hf-chainflow calibrate                               # the embedded SmolLM2 target and the shipped drafter
    hf-chainflow calibrate --dtype float32 --threads 2   # another dtype / thread count: another curve
    hf-chainflow calibrate --no-cache                    # measure, store nothing
    hf-chainflow calibrate --refresh                     # measure again and overwrite the cached curve

Prints the curve (inputs per forward, milliseconds, and the same in single-input forwards), the drafting round's
cost, and where the curve is stored (`hf_chainflow.generation.calibration.calibration_dir`,
`HF_CHAINFLOW_CALIBRATION_DIR` to move it, `HF_CHAINFLOW_CALIBRATION_CACHE=0` to switch the cache off).
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

from hf_chainflow.cli_args import check_model_source, positive_int

_DTYPES = ("float32", "bfloat16")


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="Measure the machine's cost curve of verification (tree_budget='auto').",
                       description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--target", default="smollm2-135m-instruct", help="known target name or local model directory")
    a("--drafter-path", help="ChainFlow drafter whose drafting round is timed too (default: the shipped drafter)")
    a("--no-drafter", action="store_true", help="time the target's forward only (draft cost 0)")
    a("--dtype", choices=_DTYPES,
      help="target dtype (default: bfloat16; float32 on a CPU without bfloat16 matrix instructions)")
    a("--threads", type=positive_int, help="torch.set_num_threads (default: all cores); part of the cache key")
    a("--context", type=positive_int, default=256, help="committed tokens before the verified inputs (default 256)")
    a("--repeats", type=positive_int, default=5, help="timed sweeps; the median is kept (default 5)")
    a("--compile-verification", action="store_true",
      help="measure compiled verification (static cache, bucketed shapes; compiles first) instead of eager")
    a("--no-cache", action="store_true", help="measure and store nothing (as HF_CHAINFLOW_CALIBRATION_CACHE=0)")
    a("--refresh", action="store_true", help="measure again and overwrite the cached curve")
    p.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    if args.no_drafter and args.drafter_path:
        raise ValueError("`--no-drafter` times no drafter, but `--drafter-path` names one; give one of them.")
    if args.no_cache and args.refresh:
        raise ValueError("`--refresh` overwrites the cached curve, but `--no-cache` stores nothing; give one of "
                         "them.")
    if args.drafter_path:  # before anything loads
        check_model_source("--drafter-path", args.drafter_path)
    from hf_chainflow.targets import KNOWN_TARGETS

    check_model_source("--target", args.target, tuple(KNOWN_TARGETS))
    import torch

    from hf_chainflow.bench.machine import demo_dtype
    from hf_chainflow.generation import calibration

    if not args.no_cache:
        calibration.cache_enabled()  # a bad HF_CHAINFLOW_CALIBRATION_CACHE value, before the model loads
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    dtype = args.dtype or demo_dtype()
    from hf_chainflow.targets import load_model_and_tokenizer

    target, _ = load_model_and_tokenizer(args.target, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    drafter = None
    if not args.no_drafter:
        from hf_chainflow import ChainFlowDrafter
        from hf_chainflow.checkpoints import default_drafter_path

        path = args.drafter_path or default_drafter_path()
        drafter = ChainFlowDrafter.from_pretrained(path, target=target, dtype=torch.float32).eval()
    variant, how = calibration.verification_variant(
        SimpleNamespace(compile_verification=args.compile_verification), target)
    with torch.no_grad():  # as inside `generate` (a compiled graph is traced per grad mode)
        result = calibration.load_or_measure(target, drafter=drafter, refresh=args.refresh, variant=variant,
                                             cache=False if args.no_cache else None, context=args.context,
                                             repeats=args.repeats, **how)
    print(format_curve(result.curve))
    if result.path is None:
        print("not stored (cache off)")
    elif result.measured:
        print(f"measured and stored in {result.path}")
    else:
        print(f"read from {result.path} (measured earlier; `--refresh` measures again)")
    return 0


def format_curve(curve) -> str:
    """The curve as a small table: inputs per forward, milliseconds, single-input forwards; then the drafting round
    and what it was measured on."""
    lines = [f"{curve.target.get('name_or_path') or curve.target.get('model_type')}, {curve.dtype}, "
             f"{curve.threads} threads, {curve.variant} verification, context {curve.context}; {curve.machine}",
             f"{'inputs':>6}  {'ms':>8}  {'x 1-input':>9}"]
    for n, s in zip(curve.rows, curve.seconds):
        lines.append(f"{n:>6}  {s * 1e3:>8.2f}  {curve.steps(n):>9.2f}")
    lines.append(f"drafting round: {curve.draft_seconds * 1e3:.2f} ms" if curve.drafter is not None
                 else "drafting round: not timed (no ChainFlow drafter)")
    return "\n".join(lines)


__all__ = ["add_calibrate_parser", "format_curve", "run_calibrate"]
