"""Micro-benchmark (not a test): one linear layer of the target over 1..33 rows, float32 and bfloat16.

Why verification width is nearly free on some CPUs and dear on others: a target forward over `n` tokens is mostly
linear layers with `n` rows. Where torch has bfloat16 matrix kernels (AMX, AVX-512 BF16) a few rows cost about what
one does; elsewhere the bfloat16 path's time grows with the rows. Prints the CPU capability torch reports and the
median time per call.

    python docs/research/scripts/benchmark_linear.py [--threads 2] [--repeats 50] [--in-features 576] [--out-features 1536]

The defaults are SmolLM2-135M's MLP up-projection (hidden 576, intermediate 1536).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--in-features", type=int, default=576)
    parser.add_argument("--out-features", type=int, default=1536)
    parser.add_argument("--rows", default="1,4,8,13,23,33", help="comma-separated row counts")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"threads {args.threads}, linear {args.in_features} -> {args.out_features}, median of {args.repeats}")
    header = " | ".join(f"{r} row{'' if r == 1 else 's'}" for r in rows)
    print(f"| dtype | {header} | {rows[-1]} rows ÷ {rows[0]} |")
    print("|---|" + "---|" * (len(rows) + 1))
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(args.out_features, args.in_features, dtype=dtype)
        times = []
        for r in rows:
            x = torch.randn(r, args.in_features, dtype=dtype)
            times.append(median_ms(lambda: torch.nn.functional.linear(x, weight), args.repeats))
        cells = " | ".join(f"{t:.3f} ms" for t in times)
        print(f"| {str(dtype).removeprefix('torch.')} | {cells} | {times[-1] / times[0]:.1f} |")


if __name__ == "__main__":
    main()
