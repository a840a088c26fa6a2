"""Exactness soak: many greedy speculative generations on tiny targets, each compared with plain `generate`.

    python scripts/soak.py --rows-per-family 10000 --out runs/soak            # resumable: rerun the same command
    python scripts/soak.py --rows-per-family 60 --out /tmp/soak --families llama

For each target family (tiny random Llama, Qwen3 and Qwen3.5-hybrid targets, `hf_chainflow.testing.tiny_target`) it
runs chunks of greedy generations. Each batch draws from the chunk's seed: a drafter (a random ChainFlow drafter, or
`OracleDrafter` at error rate 0, 0.3 or 1), a setting (chains of 1, 3 and 8; trees 4x3, 8x4 and 5x7; 8x4 cut to 12
nodes, alone and with a prompt-lookup branch; the shipped 8x4/12 + lookup with a trusted n-gram), a batch (one prompt,
or a ragged batch of 2-8), prompt lengths (1-60 tokens, a third of them with repeated spans so that prompt lookup
fires), `max_new_tokens` (1-32) and, in half the batches, an EOS token taken from a reference so that rows stop early.
Every row is compared with that row's own plain batch-1 greedy output (cut after its first EOS, then padded), the
mismatches counted and the first ones described. Each mismatch is classified as the bench classifies a difference
(`hf_chainflow.bench.numerics`): in float32 a row of a left-padded batch may differ from its batch-1 output only by
a `near_tie` (the two tokens' reference logits within 1e-3: padding changes the shapes of the products); any other
difference, and every batch-1 difference, is `unexplained`, and the command exits 1 if there is one.

The journal (`OUT/journal.jsonl`, one line per finished chunk) makes the run resumable after a kill: a rerun skips
the chunks it holds (the chunk's seed fixes its batches). `OUT/record.json` sums it up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

CHUNK_ROWS = 100
DRAFTERS = ("random", "oracle0", "oracle0.3", "oracle1")
SETTINGS = {  # name -> generation-config fields
    "chain1": {"draft_mode": "chain", "num_assistant_tokens": 1},
    "chain3": {"draft_mode": "chain", "num_assistant_tokens": 3},
    "chain8": {"draft_mode": "chain", "num_assistant_tokens": 8},
    "tree4x3": {"draft_mode": "tree", "tree_width": 4, "tree_depth": 3, "tree_budget": None},
    "tree8x4": {"draft_mode": "tree", "tree_width": 8, "tree_depth": 4, "tree_budget": None},
    "tree5x7": {"draft_mode": "tree", "tree_width": 5, "tree_depth": 7, "tree_budget": None},
    "tree8x4/12": {"draft_mode": "tree", "tree_width": 8, "tree_depth": 4, "tree_budget": 12},
    "tree8x4/12+lookup": {"draft_mode": "tree", "tree_width": 8, "tree_depth": 4, "tree_budget": 12,
                          "lookup_num_tokens": 3},
    "shipped": {"draft_mode": "tree", "tree_width": 8, "tree_depth": 4, "tree_budget": 12, "lookup_num_tokens": 10,
                "lookup_ngram": 3, "lookup_trust_ngram": 2, "lookup_max_tokens": 31},
}
LOOKUP_FIELDS = {"lookup_num_tokens": None, "lookup_ngram": 3, "lookup_trust_ngram": None, "lookup_max_tokens": None}
FAMILIES = ("llama", "qwen3", "qwen3_5")
PAD = 0
VOCAB = 256


def chunk_seed(seed: int, family: str, chunk: int) -> int:
    return (seed * 1_000_003 + FAMILIES.index(family) * 10_007 + chunk) % (2 ** 63)


def draw_prompt(gen, torch):
    """A prompt `(L,)` of 1-60 tokens; a third of them repeat a span so that prompt lookup finds matches."""
    n = int(torch.randint(1, 61, (), generator=gen))
    ids = torch.randint(3, VOCAB, (n,), generator=gen)
    if n >= 8 and float(torch.rand((), generator=gen)) < 1 / 3:
        span = ids[: int(torch.randint(3, min(n, 12) + 1, (), generator=gen))]
        ids = torch.cat([ids, span, ids[:2], span])[:60]
    return ids


class Soak:
    """One family's target, its drafters, and the check of one batch."""

    def __init__(self, family: str):
        import torch

        from hf_chainflow import ChainFlowConfig, ChainFlowDrafter
        from hf_chainflow.testing import OracleDrafter, tiny_target

        self.torch, self.family = torch, family
        self.target = tiny_target(family)
        cfg = ChainFlowConfig.for_target(self.target.config, num_blocks=1, num_heads=4, path_hidden_size=32,
                                         markov_rank=16)
        torch.manual_seed(0)
        self.drafters = {"random": ChainFlowDrafter(cfg).eval().bind_target(self.target)}
        for kind in DRAFTERS[1:]:
            self.drafters[kind] = OracleDrafter(self.target, error_rate=float(kind[len("oracle"):]), seed=7)

    def reference(self, prompt, max_new: int, eos: int | None):
        """The row's own plain batch-1 greedy continuation (cut after its first `eos`)."""
        out = self.target.generate(prompt[None], attention_mask=self.torch.ones_like(prompt[None]),
                                   max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
        return out[0, prompt.shape[0]:]

    def run_batch(self, drafter_kind: str, setting: str, prompts: list, max_new: int, eos: int | None,
                  refs: list) -> list[dict]:
        """One speculative call over `prompts` (left-padded); returns a description of each mismatching row."""
        torch = self.torch
        drafter = self.drafters[drafter_kind]
        g = drafter.generation_config
        for name, value in {**LOOKUP_FIELDS, **SETTINGS[setting]}.items():
            setattr(g, name, value)
        width = max(p.shape[0] for p in prompts)
        ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):
            ids[b, width - p.shape[0]:], mask[b, width - p.shape[0]:] = p, 1
        out = self.target.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                   eos_token_id=eos, pad_token_id=PAD, assistant_model=drafter)
        bad = []
        for b, want in enumerate(refs):
            got = out[b, width:]
            ok = (got.shape[0] >= want.shape[0] and torch.equal(got[: want.shape[0]], want)
                  and bool((got[want.shape[0]:] == PAD).all()) and torch.equal(out[b, :width], ids[b]))
            if not ok:
                mine = got[: want.shape[0]] if torch.equal(out[b, :width], ids[b]) else got[:0]
                bad.append({"row": b, "prompt": prompts[b].tolist(), "want": want.tolist(), "got": got.tolist(),
                            **self.explain(prompts[b], want.tolist(), mine.tolist(), padded=len(prompts) > 1)})
        return bad

    def explain(self, prompt, want: list[int], got: list[int], *, padded: bool) -> dict:
        """The bench's classification of a difference (`hf_chainflow.bench.numerics`): in float32 a row of a
        left-padded batch may differ from its batch-1 output only by a near-tie within the padded tolerance (the
        shapes of the products differ); anything else, and any batch-1 difference, is `unexplained`."""
        from hf_chainflow.bench.numerics import explain_mismatch

        with self.torch.no_grad():
            found = explain_mismatch(self.target, prompt[None], want, got, "float32", 0.0, padded=padded)
        return {"kind": found["kind"], "position": found["position"], "gap": found["gap"], "reason": found["reason"]}

    def chunk(self, seed: int, rows: int) -> dict:
        """`rows` rows in batches drawn from `seed`; counts and the first mismatches."""
        torch = self.torch
        gen = torch.Generator().manual_seed(seed)
        done, batches, mismatches, unexplained, first, cells = 0, 0, 0, 0, [], {}
        while done < rows:
            kind = DRAFTERS[int(torch.randint(len(DRAFTERS), (), generator=gen))]
            setting = list(SETTINGS)[int(torch.randint(len(SETTINGS), (), generator=gen))]
            size = 1 if float(torch.rand((), generator=gen)) < 0.5 else int(torch.randint(2, 9, (), generator=gen))
            size = min(size, rows - done)
            prompts = [draw_prompt(gen, torch) for _ in range(size)]
            max_new = int(torch.randint(1, 33, (), generator=gen))
            eos = None
            if float(torch.rand((), generator=gen)) < 0.5:
                free = self.reference(prompts[0], max_new, None)
                eos = int(free[int(torch.randint(free.shape[0], (), generator=gen))])
            refs = [self.reference(p, max_new, eos) for p in prompts]
            bad = self.run_batch(kind, setting, prompts, max_new, eos, refs)
            cell = f"{kind}|{setting}|{'batch1' if size == 1 else 'ragged'}"
            cells[cell] = cells.get(cell, 0) + size
            mismatches += len(bad)
            unexplained += sum(m["kind"] != "near_tie" for m in bad)
            first += [{"cell": cell, "max_new_tokens": max_new, "eos": eos, **m} for m in bad][: max(0, 5 - len(first))]
            done += size
            batches += 1
        return {"rows": done, "batches": batches, "mismatches": mismatches, "unexplained": unexplained,
                "first_mismatches": first, "cells": cells}


def read_journal(path: Path) -> list[dict]:
    """Finished chunks; a torn last line (a kill mid-write) is dropped, so its chunk runs again."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise ValueError(f"{path}:{n}: not valid JSON in the middle of the journal; it is damaged. Move it away "
                             f"and rerun to start over.") from None
    return out


def summarise(journal: list[dict], args) -> dict:
    import torch
    import transformers

    families = {}
    for fam in args.families:
        mine = [c for c in journal if c["family"] == fam]
        cells: dict[str, int] = {}
        for c in mine:
            for k, v in c["cells"].items():
                cells[k] = cells.get(k, 0) + v
        families[fam] = {"rows": sum(c["rows"] for c in mine), "batches": sum(c["batches"] for c in mine),
                         "mismatches": sum(c["mismatches"] for c in mine),
                         "unexplained": sum(c.get("unexplained", c["mismatches"]) for c in mine),
                         "seconds": round(sum(c["seconds"] for c in mine), 1),
                         "first_mismatches": [m for c in mine for m in c["first_mismatches"]][:5],
                         "rows_by_drafter": _by(cells, 0), "rows_by_setting": _by(cells, 1),
                         "rows_by_batch": _by(cells, 2)}
    return {"command": "python scripts/soak.py " + " ".join(sys.argv[1:]), "seed": args.seed,
            "rows_per_family": args.rows_per_family, "chunk_rows": CHUNK_ROWS, "dtype": "float32",
            "software": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                        f"python {platform.python_version()}",
            "machine": _machine(), "families": families,
            "total": {"rows": sum(f["rows"] for f in families.values()),
                      "mismatches": sum(f["mismatches"] for f in families.values()),
                      "unexplained": sum(f["unexplained"] for f in families.values())}}


def _by(cells: dict, part: int) -> dict:
    out: dict[str, int] = {}
    for k, v in cells.items():
        key = k.split("|")[part]
        out[key] = out.get(key, 0) + v
    return dict(sorted(out.items()))


def _machine() -> str:
    try:
        from hf_chainflow.machine import describe_machine

        return describe_machine()
    except Exception as err:  # the record still lands; say why the machine is missing
        return f"unknown ({type(err).__name__}: {err})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows-per-family", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=20261207)
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated: llama, qwen3, qwen3_5")
    p.add_argument("--out", required=True, help="folder for journal.jsonl and record.json (resumed if it exists)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown or not args.families:
        p.error(f"--families takes names from {list(FAMILIES)}, got {args.families!r}")
    if args.rows_per_family < 1:
        p.error(f"--rows-per-family must be a positive integer, got {args.rows_per_family}")

    import torch
    from tqdm.auto import tqdm

    import hf_chainflow  # noqa: F401  (installs the generate hook)

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    journal_path = out / "journal.jsonl"
    journal = read_journal(journal_path)
    if journal and (journal[0].get("seed") != args.seed):
        p.error(f"{journal_path} was written with --seed {journal[0].get('seed')}, not {args.seed}; use that seed "
                f"or another --out")
    with open(journal_path, "w", encoding="utf-8") as f:  # rewrite without a torn last line
        f.writelines(json.dumps(c) + "\n" for c in journal)
    done = {(c["family"], c["chunk"]) for c in journal}
    n_chunks = -(-args.rows_per_family // CHUNK_ROWS)
    for family in args.families:
        todo = [k for k in range(n_chunks) if (family, k) not in done]
        if not todo:
            continue
        soak = Soak(family)
        bar = tqdm(total=n_chunks, initial=n_chunks - len(todo), desc=f"soak {family}", unit="chunk")
        for k in todo:
            rows = min(CHUNK_ROWS, args.rows_per_family - k * CHUNK_ROWS)
            t0 = time.perf_counter()
            result = soak.chunk(chunk_seed(args.seed, family, k), rows)
            entry = {"family": family, "chunk": k, "seed": args.seed, **result,
                     "seconds": round(time.perf_counter() - t0, 2)}
            with open(journal_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
            journal.append(entry)
            bar.update(1)
            bar.set_postfix(mismatches=sum(c["mismatches"] for c in journal if c["family"] == family),
                            unexplained=sum(c.get("unexplained", c["mismatches"]) for c in journal
                                            if c["family"] == family))
        bar.close()
    record = summarise(journal, args)
    (out / "record.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    for fam, r in record["families"].items():
        print(f"{fam}: {r['rows']} rows, {r['mismatches']} mismatches ({r['unexplained']} unexplained), "
              f"{r['seconds']} s")
    return 1 if record["total"]["unexplained"] else 0


if __name__ == "__main__":
    sys.exit(main())
