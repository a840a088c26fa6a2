"""`hf-chainflow bench`: wall-clock speed and exactness of plain, prompt-lookup, ChainFlow and DFlash decoding.

One run, arms interleaved prompt by prompt (every arm runs on a prompt before the next prompt starts), so machine
noise hits all arms alike. Arms (each in every requested dtype, with its own target copy in that dtype):

    ar           plain greedy `generate`
    ar-compiled  the same, static cache and the target's forward compiled (only when --arms names it)
    pld          transformers' prompt lookup (`prompt_lookup_num_tokens=N`)
    chain, tree  the ChainFlow drafter (`generate(assistant_model=drafter)`), chain / tree drafting
    tree+lookup  the tree arm plus a prompt-lookup branch (`--lookup-tokens K`, see `hf_chainflow.generation.prompt_lookup`)
    pld-compiled, tree+lookup-compiled   prompt lookup in hf_chainflow's loop (`PromptLookupDrafter`) / tree+lookup,
                 with compiled verification (static cache, bucketed shapes; only when --arms names them)
    tree+lookup-auto   tree+lookup-compiled with the tree budget sized by the machine's cost curve
                 (`tree_budget="auto"`; only when --arms names it)
    NAME-chain, NAME-tree   any extra drafter (`--drafter NAME=PATH`, e.g. a FlashMap-style drafter)
    dflash       a DFlash drafter (`--dflash PATH`) run by stock transformers (`speculation_type="dflash"`)

Arm keys are `NAME@DTYPE` (`ar@float32`, `tree@bfloat16`). Each finished prompt is journaled (`runs.jsonl`, see
`hf_chainflow.bench.journal`), so a long run can stop and continue with `--resume`; a journal with finished prompts
is never replaced without `--overwrite`. Reported per arm and per domain:

- `tokens_per_second`: pooled new tokens / pooled wall time of the `generate` calls;
- `speedup`: tokens/s over the same-dtype `ar` arm of the same run (= the ratio of pooled times whenever the two
  arms emit the same number of tokens, which greedy decoding does unless outputs differ);
  `speedup_vs_fastest_ar`: the same against the fastest plain arm (`ar`, `ar-compiled`) over all dtypes;
- `same_length` (top level): the speedups again on the prompts where every arm of a dtype emitted as many tokens as
  `ar` (`hf_chainflow.bench.report`), so that bf16 texts of different lengths do not move a domain's figure;
- `tau`: tokens per target forward after the prefill, bonus included (`ar`: 1; `pld`: counted with a forward hook;
  `dflash` too; ChainFlow drafter arms: `drafter.last_stats`); acceptance per draft depth, drafting /
  verification seconds per round (ChainFlow arms);
- `mismatches`: prompts whose output differs from the same-dtype `ar` output, each classified at its first
  diverging position (see `hf_chainflow.bench.numerics`).
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

from hf_chainflow.bench.defaults import DEFAULT_OUTPUT_DIR, DEFAULT_TIE_TOLERANCE, DTYPE_NAMES, JOURNAL_NAME
from hf_chainflow.cli_args import check_model_source, check_output_dir, positive_int


def _parse_dtypes(text: str) -> list[str]:
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPE_NAMES]
    if not dtypes or bad or len(set(dtypes)) != len(dtypes):
        raise ValueError(f"`--dtypes` must be distinct names from {sorted(DTYPE_NAMES)}, comma-separated, got {text!r}.")
    return dtypes


def _parse_tree(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"`--tree` must be WIDTHxDEPTH with positive integers (e.g. 8x4), got {text!r}.")
    return int(parts[0]), int(parts[1])


def _parse_extra_drafters(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"`--drafter` must be NAME=PATH (NAME alphanumeric, '-' or '_'), got {item!r}.")
        if name in out or name in ("chainflow", "dflash"):
            raise ValueError(f"`--drafter` names must be unique and not 'chainflow' (the default drafter) or 'dflash' "
                             f"(`--dflash`), got {name!r}.")
        out[name] = path
    return out


def _parse_batch_sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts or not all(t.isdigit() and int(t) > 0 for t in parts):
        raise ValueError(f"`--batch-sizes` must be comma-separated positive integers (e.g. 1,2,4,8), got {text!r}.")
    return sorted({int(t) for t in parts})


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="Wall-clock speed and exactness of ar / prompt lookup / ChainFlow arms.",
                       description="\n\n".join(__doc__.split("\n\n")[1:5]),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct", help="known target name or local model directory")
    p.add_argument("--drafter-path", help="ChainFlow drafter directory (default: the drafter shipped in the package)")
    p.add_argument("--drafter", action="append", metavar="NAME=PATH",
                   help="an extra drafter, run as NAME-chain / NAME-tree arms (repeatable)")
    p.add_argument("--dflash", metavar="PATH",
                   help="a DFlash drafter folder (`hf-chainflow train --drafter-type dflash`), run as the `dflash` arm "
                        "by stock transformers, in each target dtype (batch 1; not with --batch-sizes)")
    p.add_argument("--no-default-drafter", action="store_true", help="run no `chain`/`tree` arms of the default drafter")
    p.add_argument("--arms", help="comma-separated arms to run: NAME in every dtype of --dtypes, NAME@DTYPE in one "
                                    "(default: all but the opt-in arms ar-compiled, pld-compiled, tree+lookup-compiled, "
                                    "tree+lookup-auto; e.g. ar,pld,tree or "
                                    "ar@bfloat16,ar-compiled@bfloat16,tree@float32)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated target dtypes")
    p.add_argument("--drafter-dtype", choices=sorted(DTYPE_NAMES), default="float32",
                   help="dtype of the drafters' weights (default float32)")
    p.add_argument("--compile-drafting", action=argparse.BooleanOptionalAction, default=None,
                   help="run the drafters' drafting rounds compiled (torch.compile, warmed up before timing) or eager "
                        "(default: each drafter's generation_config.compile_drafting)")
    p.add_argument("--compile-verification", action=argparse.BooleanOptionalAction, default=None,
                   help="run the chain/tree arms' verification forwards compiled (static cache, bucketed shapes, "
                        "warmed up before timing) or eager (default: each drafter's "
                        "generation_config.compile_verification)")
    p.add_argument("--pld-tokens", type=positive_int, default=10,
                   help="prompt_lookup_num_tokens of the pld and pld-compiled arms")
    p.add_argument("--chain", type=positive_int, help="chain length (default: the drafter's num_assistant_tokens)")
    p.add_argument("--tree", help="tree shape WIDTHxDEPTH (default: the drafter's tree_width x tree_depth)")
    p.add_argument("--tree-budget", type=positive_int,
                   help="keep this many nodes of each tree, highest path probability first (default: the drafter's "
                        "tree_budget; none = all WIDTHxDEPTH)")
    p.add_argument("--lookup-tokens", type=positive_int,
                   help="add a `tree+lookup` arm: the tree plus a prompt-lookup branch of this many tokens (default: "
                        "the drafter's `lookup_num_tokens`; the arm is added when either is set)")
    p.add_argument("--lookup-trust-ngram", type=positive_int,
                   help="in `tree+lookup`, a match this long is verified alone, without drafting (default: never)")
    p.add_argument("--lookup-max-tokens", type=positive_int,
                   help="in `tree+lookup`, let a branch verified alone and accepted whole grow up to this many tokens "
                        "(default: fixed length)")
    p.add_argument("--prompts", help="JSONL with id, domain, prompt (default: the shipped evaluation prompts)")
    p.add_argument("--limit", type=int, help="benchmark N prompts, stratified by domain")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt and arm (default 128)")
    p.add_argument("--tie-tolerance", type=float, default=DEFAULT_TIE_TOLERANCE,
                   help="logit gap below which a low-precision difference is a near-tie (default: measured, see docs)")
    p.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                   help=f"where results go; each finished prompt is also appended to {JOURNAL_NAME} there")
    p.add_argument("--resume", action="store_true",
                   help=f"continue the run journaled in --output-dir/{JOURNAL_NAME}: its finished prompts are read "
                        "back, the rest run (repeat the same command, with --resume added)")
    p.add_argument("--overwrite", action="store_true",
                   help=f"start a fresh journal in --output-dir even where its {JOURNAL_NAME} holds finished prompts "
                        "(they are discarded; without --resume or --overwrite such a journal is refused)")
    p.add_argument("--partial-report", action="store_true",
                   help="with --resume: run no prompt; summarise the prompts the journal holds so far into "
                        "--output-dir/partial/ (results.json marked `partial`, the table, the plots)")
    p.add_argument("--batch-sizes", metavar="B1,B2,...",
                   help="run the batched bench instead: plain batched generate vs each drafter arm at these batch "
                        "sizes (e.g. 1,2,4,8), every row checked against its own batch-1 plain output; writes "
                        "batched_results.json/.md and the measured max_speculative_batch_size (no journal)")
    p.add_argument("--threads", type=positive_int, help="torch.set_num_threads (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    """`hf-chainflow bench`: check the options, then load, run, write (`hf_chainflow.bench.benchmark`); print the
    table."""
    import torch

    from hf_chainflow.bench.arms import select_arms
    from hf_chainflow.bench.machine import bf16_hardware_note
    from hf_chainflow.bench.report import markdown_table
    from hf_chainflow.bench.run import benchmark
    from hf_chainflow.checkpoints import default_drafter_path
    from hf_chainflow.generation.prompt_lookup import lookup_settings

    batch_sizes = _parse_batch_sizes(args.batch_sizes)
    if args.dflash is not None and batch_sizes is not None:
        raise ValueError("`--dflash` with `--batch-sizes`: stock transformers' DFlash decoding runs one prompt at a "
                         "time (assisted decoding is batch 1); run the `dflash` arm without `--batch-sizes`.")
    if batch_sizes is not None and (args.resume or args.partial_report or args.overwrite):
        raise ValueError("`--batch-sizes` runs the batched bench, which keeps no journal: drop `--resume` / "
                         "`--partial-report` / `--overwrite`.")
    if args.partial_report and not args.resume:
        raise ValueError("`--partial-report` summarises a journaled run so far: add `--resume` (and repeat the run's "
                         "other options) so that the journal in `--output-dir` is read.")
    lookup = None
    if args.lookup_tokens is not None:
        lookup = {"lookup_num_tokens": args.lookup_tokens, "lookup_trust_ngram": args.lookup_trust_ngram,
                  "lookup_max_tokens": args.lookup_max_tokens}
        lookup_settings(SimpleNamespace(**lookup))  # the generation-config rules, checked before any model loads
    else:
        for name in ("lookup_trust_ngram", "lookup_max_tokens"):
            if getattr(args, name) is not None:
                raise ValueError(f"`--{name.replace('_', '-')}` needs `--lookup-tokens` (it tunes the `tree+lookup` "
                                 "arm).")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    dtypes = _parse_dtypes(args.dtypes)
    tree = _parse_tree(args.tree)
    note = bf16_hardware_note() if "bfloat16" in dtypes else None
    if note is not None:
        print(note)
    only = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    only_names = None if only is None else {a.partition("@")[0] for a in only}  # NAME or NAME@DTYPE
    default_arms = {"chain", "tree", "tree+lookup", "tree+lookup-compiled", "tree+lookup-auto"}
    wants_default = not args.no_default_drafter and (only is None or bool(default_arms & only_names))
    paths = {"chainflow": args.drafter_path or str(default_drafter_path())} if wants_default else {}
    paths.update(_parse_extra_drafters(args.drafter))
    if args.no_default_drafter and only is not None and default_arms & only_names:
        raise ValueError(f"`--arms` asks for {sorted(default_arms & only_names)}, arms of the default drafter, but "
                         f"`--no-default-drafter` leaves it out; drop one of the two.")
    if only is not None:  # checked here, before loading: the drafters not asked for are not loaded at all
        possible = ["ar", "ar-compiled", "pld", "pld-compiled"] + (
            [] if args.no_default_drafter else sorted(default_arms)) + [
            f"{n}-{kind}" for n in paths if n != "chainflow" for kind in ("chain", "tree")] + (
            ["dflash"] if args.dflash else [])
        select_arms(only, possible, dtypes)
    for name, path in paths.items():
        if name != "chainflow" or args.drafter_path:
            check_model_source("--drafter-path" if name == "chainflow" else f"--drafter {name}=PATH", path)
    if args.dflash is not None:
        check_model_source("--dflash", args.dflash)
    check_output_dir("--output-dir", args.output_dir)

    results, written = benchmark(
        args.target, paths, dtypes=dtypes, drafter_dtype=args.drafter_dtype, pld_tokens=args.pld_tokens,
        chain=args.chain, tree=tree, tree_budget=args.tree_budget, lookup=lookup, only=only, prompts=args.prompts,
        compile_drafting=args.compile_drafting, compile_verification=args.compile_verification,
        limit=args.limit, max_new_tokens=args.max_new_tokens, tie_tolerance=args.tie_tolerance,
        output_dir=args.output_dir, resume=args.resume, partial=args.partial_report, overwrite=args.overwrite,
        progress=not args.no_progress,
        batch_sizes=batch_sizes, dflash=args.dflash)
    if batch_sizes is not None:
        from hf_chainflow.bench.batched import batched_table

        print(batched_table(results))
        print("wrote " + ", ".join(str(p) for p in written.values()))
        return 0
    print(markdown_table(results).split("\n## Settings")[0])
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


__all__ = ["add_bench_parser", "run_bench_command"]
