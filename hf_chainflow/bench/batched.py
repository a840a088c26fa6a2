"""The batched bench (`hf-chainflow bench --batch-sizes 1,2,4,8`): plain batched `generate` against each speculative
arm on the same prompts and the same batches, per batch size.

For each batch size `B` the prompts are cut, in order, into batches of `B` (the last one may be smaller), left-padded
with the target's pad token. Every arm runs on a batch before the next batch starts (noise hits all arms alike), each
call timed alone. Reported per batch size and arm:

- `tokens_per_second`: new tokens of all rows (each row up to and including its EOS) / wall time of the calls;
- `speedup`: over plain batched `generate` (`ar`) of the same batch size; `speedup_vs_batch1_ar`: over `ar` at batch 1;
- `tau` pooled over rows and rounds, `tau_per_row` (one per prompt), the rounds' verify forwards;
- exactness per row: each row against that prompt's own batch-1 plain greedy output (the `ar` arm at batch size 1,
  always run), classified at its first difference (`hf_chainflow.bench.numerics`): in bfloat16 a `near_tie` or
  `unexplained`; in float32 every difference at batch 1 is `unexplained`, and a row of a larger (left-padded)
  batch may differ only by a float32 near-tie within `PADDED_FLOAT32_TIE_TOLERANCE` (padding changes the shapes of
  the products, so bit-identical rows are not promised there).

`measured_cutoff` per dtype is the largest batch size at which the fastest speculative arm is faster than `ar`
(`None` when none is): the value for `drafter.generation_config.max_speculative_batch_size`. The drafter's own
cutoff is switched off during the run so that every arm drafts at every batch size.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from hf_chainflow.checks import is_int
from hf_chainflow.fileio import atomic_write_text
from hf_chainflow.bench.arms import Arm, configure_drafter
from hf_chainflow.bench.numerics import explain_mismatch
from hf_chainflow.bench.prompts import BenchPrompt


def left_padded(prompts: list[BenchPrompt], pad_token_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The prompts' ids, left-padded with `pad_token_id`, and their attention mask, both `(B, max L)`."""
    width = max(p.input_ids.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        n = p.input_ids.shape[1]
        ids[b, width - n:], mask[b, width - n:] = p.input_ids[0], 1
    return ids, mask


def row_tokens(new: torch.LongTensor, eos_token_id) -> list[int]:
    """One row's generated tokens `(n,)`, up to and including its first EOS."""
    eos = set(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]) - {None}
    out = []
    for t in new.tolist():
        out.append(t)
        if t in eos:
            break
    return out


def run_batch(arm: Arm, model, prompts: list[BenchPrompt], max_new_tokens: int, drafter, eos_token_id,
              pad_token_id: int) -> dict:
    """One timed batched greedy `generate` of `arm` on `prompts`: each row's tokens, the seconds, the statistics."""
    ids, mask = left_padded(prompts, pad_token_id)
    kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id,
                  eos_token_id=eos_token_id)
    if arm.speculative:
        configure_drafter(drafter, arm)
        drafter.generation_config.max_speculative_batch_size = None  # measure drafting at every batch size
        kwargs["assistant_model"] = drafter
    elif arm.kind != "ar":
        raise ValueError(f"The batched bench runs `ar` and drafter arms; got {arm.kind!r} ({arm.key}).")
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        seconds = time.perf_counter() - start
    rows = [row_tokens(out[b, ids.shape[1]:], eos_token_id) for b in range(len(prompts))]
    stats = drafter.last_stats if arm.speculative else None
    return {"rows": rows, "seconds": seconds, "stats": stats}


def run_batched_bench(models: dict[str, object], prompts: list[BenchPrompt], arms: list[Arm],
                      drafters: dict[str, dict[str, object]], batch_sizes: list[int], *, max_new_tokens: int = 128,
                      tie_tolerance: float = 0.5, eos_token_id=None, pad_token_id: int | None = None,
                      progress: bool = True) -> dict:
    """Run `arms` (the `ar` arm and drafter arms; `pld` and `ar-compiled` are batch-1 only and skipped) at every
    batch size of `batch_sizes` on `prompts`; see the module docstring for the numbers. Returns the results dict."""
    if not batch_sizes or any(not is_int(b) or b < 1 for b in batch_sizes):
        raise ValueError(f"`--batch-sizes` must be positive integers, got {batch_sizes!r}.")
    if pad_token_id is None:
        pad_token_id = eos_token_id[0] if isinstance(eos_token_id, (list, tuple)) else eos_token_id
    if pad_token_id is None:
        raise ValueError("The batched bench left-pads prompts: the target needs a `pad_token_id` or `eos_token_id`.")
    arms = [a for a in arms if (a.kind == "ar" and not a.compiled_plain) or a.speculative]  # ar-compiled: batch 1
    for dtype in {a.dtype for a in arms}:
        if not any(a.kind == "ar" and a.dtype == dtype for a in arms):
            raise ValueError(f"The batched bench needs the `ar` arm in {dtype} (its baseline).")
    sizes = sorted(set(batch_sizes) | {1})  # batch 1 `ar` is every row's reference

    def go(arm, batch):
        drafter = drafters[arm.drafter][arm.dtype] if arm.speculative else None
        return run_batch(arm, models[arm.dtype], batch, max_new_tokens, drafter, eos_token_id, pad_token_id)

    out: dict = {}
    reference: dict[tuple[str, str], list[int]] = {}  # (dtype, prompt id) -> batch-1 ar tokens
    for size in sizes:
        batches = [prompts[i: i + size] for i in range(0, len(prompts), size)]
        found = {a.key: {"new_tokens": 0, "seconds": 0.0, "taus": [], "accepted": 0, "rounds": 0, "forwards": 0,
                         "drafted": True, "rows": []} for a in arms}
        for k, batch in enumerate(batches):
            if progress:
                print(f"batch size {size}: batch {k + 1}/{len(batches)}", flush=True)
            for arm in arms:
                run = go(arm, batch)
                f = found[arm.key]
                f["seconds"] += run["seconds"]
                f["new_tokens"] += sum(len(r) for r in run["rows"])
                stats = run["stats"]
                if stats is not None:
                    row_stats = stats.rows or [stats]
                    f["taus"] += [r.tau for r in row_stats]
                    f["accepted"] += sum(stats.accepted)
                    f["rounds"] += stats.rounds
                    f["forwards"] += stats.forwards or stats.rounds
                    f["drafted"] &= stats.speculative
                for p, tokens in zip(batch, run["rows"]):
                    if size == 1 and arm.kind == "ar":
                        reference[(arm.dtype, p.id)] = tokens
                    d = explain_mismatch(models[arm.dtype], p.input_ids, reference[(arm.dtype, p.id)], tokens,
                                         arm.dtype, tie_tolerance, padded=size > 1)
                    f["rows"].append({"id": p.id, "new_tokens": len(tokens),
                                      "kind": "same" if d is None else d["kind"], "mismatch": d})
        base = {a.dtype: found[a.key] for a in arms if a.kind == "ar"}
        summary = {}
        for arm in arms:
            f = found[arm.key]
            speed = f["new_tokens"] / f["seconds"] if f["seconds"] else 0.0
            ar = base[arm.dtype]
            ar_speed = ar["new_tokens"] / ar["seconds"] if ar["seconds"] else 0.0
            kinds = [r["kind"] for r in f["rows"]]
            summary[arm.key] = {
                "name": arm.name, "kind": arm.kind, "dtype": arm.dtype, "settings": arm.settings,
                "new_tokens": f["new_tokens"], "seconds": f["seconds"], "tokens_per_second": speed,
                "speedup": speed / ar_speed if ar_speed else None,
                "tau": (f["accepted"] + f["rounds"]) / f["rounds"] if f["rounds"] else (1.0 if arm.kind == "ar"
                                                                                       else None),
                "tau_per_row": f["taus"] or None, "verify_forwards": f["forwards"] or None,
                "drafted": f["drafted"] if arm.speculative else None,
                "rows_same": kinds.count("same"), "rows_near_tie": kinds.count("near_tie"),
                "rows_unexplained": kinds.count("unexplained"), "rows": f["rows"]}
        out[str(size)] = summary
    for size, summary in out.items():  # against batch-1 plain decoding
        for key, s in summary.items():
            one = out["1"][f"ar@{s['dtype']}"]["tokens_per_second"]
            s["speedup_vs_batch1_ar"] = s["tokens_per_second"] / one if one else None
    cutoff = {}
    for dtype in sorted({a.dtype for a in arms}):
        faster = [int(size) for size, summary in out.items() if any(
            s["speedup"] is not None and s["speedup"] > 1 for s in summary.values()
            if s["dtype"] == dtype and s["kind"] != "ar")]
        cutoff[dtype] = max(faster) if faster else None
    return {"batch_sizes": sizes, "max_new_tokens": max_new_tokens, "num_prompts": len(prompts),
            "by_batch_size": out, "measured_cutoff": cutoff}


def batched_table(results: dict) -> str:
    """The results as a markdown table: one line per batch size and arm."""
    lines = ["| batch | arm | tokens/s | speedup vs ar (same batch) | vs ar batch 1 | tau | rows same / near-tie / "
             "unexplained |", "|---|---|---|---|---|---|---|"]

    def num(x, fmt="{:.2f}"):
        return "n/a" if x is None else fmt.format(x)

    for size, summary in results["by_batch_size"].items():
        for key, s in summary.items():
            lines.append(f"| {size} | {key} | {num(s['tokens_per_second'], '{:.1f}')} | {num(s['speedup'])} | "
                         f"{num(s['speedup_vs_batch1_ar'])} | {num(s['tau'])} | {s['rows_same']} / "
                         f"{s['rows_near_tie']} / {s['rows_unexplained']} |")
    cut = ", ".join(f"{d}: {c}" for d, c in results["measured_cutoff"].items())
    return "\n".join(lines) + f"\n\nMeasured cutoff (largest batch where a drafter arm beats `ar`): {cut}\n"


def write_batched_results(results: dict, output_dir) -> dict[str, Path]:
    """`batched_results.json` and `batched_results.md` in `output_dir`."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "batched_results.json", "markdown": out / "batched_results.md"}
    atomic_write_text(paths["json"], json.dumps(results, indent=1, default=str) + "\n")
    atomic_write_text(paths["markdown"], batched_table(results))
    return paths


__all__ = ["batched_table", "left_padded", "row_tokens", "run_batch", "run_batched_bench", "write_batched_results"]
