"""Plot the training loss of one or more `hf-chainflow train` logs (the Trainer's printed log dicts).

    python docs/research/scripts/plot_training_log.py NAME=LOG [NAME=LOG ...] --out loss.png [--key loss]

A log line is a printed dict such as `{'loss': '1.396', ..., 'epoch': '0.1209'}`; lines without the key are
skipped (the final summary line has `train_loss`, not `loss`).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def read_log(path: str | Path, key: str = "loss") -> tuple[list[float], list[float]]:
    """(epochs, values) of `key` in the log dicts of `path`, in order."""
    epochs, values = [], []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = ast.literal_eval(line)
        except (ValueError, SyntaxError):
            continue
        if isinstance(record, dict) and key in record and "epoch" in record:
            epochs.append(float(record["epoch"]))
            values.append(float(record[key]))
    return epochs, values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", metavar="NAME=LOG")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--key", default="loss", help="logged value to plot (default: loss)")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for item in args.logs:
        name, sep, path = item.partition("=")
        if not sep:
            parser.error(f"expected NAME=LOG, got {item!r}")
        epochs, values = read_log(path, args.key)
        if not values:
            parser.error(f"{path} has no log line with {args.key!r} and 'epoch'")
        ax.plot(epochs, values, marker=".", label=name)
    ax.set_xlabel("epoch of this stage")
    ax.set_ylabel(args.key)
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
