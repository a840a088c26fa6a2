"""`hf-chainflow generate-responses`: the target's own responses into a response corpus (`hf_chainflow.training.corpus`).

    hf-chainflow generate-responses --prompts ../shared/data/prompts/train.jsonl \\
        --corpus corpus/smollm2-135m-instruct --domains code,math,qa,mt,rag,summ,tool,transl --seed 20261204

Rerun the same command to continue a killed run (or one stopped by a full disk); under `torchrun --nproc_per_node N`
each process answers every N-th prompt and writes its own shards. One job writes to a corpus at a time (its writer
lock); another is refused, naming the holder, before its model loads.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

from hf_chainflow.cli_args import check_model_source, positive_int, usage_error

DTYPE_NAMES = ("bfloat16", "float16", "float32")


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of names, got {text!r}")
    return items


def add_generate_responses_parser(sub) -> None:
    p = sub.add_parser("generate-responses", help="The target's greedy responses into a response corpus (resumable).",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct", help="known target name or local model directory")
    p.add_argument("--prompts", help="JSONL file, dataset folder or Hub dataset id of prompt rows (id, domain, "
                                     "language, source, prompt)")
    p.add_argument("--prompt-column", default="prompt", help="column holding the prompt text")
    p.add_argument("--prompts-split", default="train", help="split of a dataset folder or Hub dataset")
    p.add_argument("--corpus", required=True, help="corpus folder (made if new)")
    p.add_argument("--domains", type=_csv, help="comma-separated domains to answer (default: all)")
    p.add_argument("--per-domain", type=positive_int, help="at most this many prompts per domain (default: all)")
    p.add_argument("--seed", type=int, default=0, help="order of the prompts (any prefix mixes domains)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="prompts per generation batch")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="longest response, in tokens")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16",
                   help="generation dtype (bfloat16 on a CPU with AVX-512 BF16 or AMX; float32 is faster on AVX2-only)")
    p.add_argument("--device", help="e.g. `cuda` (default: `cuda` when available, else `cpu`)")
    p.add_argument("--threads", type=positive_int, help="torch.set_num_threads")
    p.add_argument("--shard-size", type=positive_int, default=512, help="responses per shard")
    p.add_argument("--max-prompts", type=positive_int, help="stop after this many new responses")
    p.add_argument("--flush", action="store_true",
                   help="only write the pending responses of this process as a shard (e.g. before a commit), and exit")
    p.set_defaults(func=run_generate_responses)


def _file_sha256(path: str) -> str | None:
    if not Path(path).is_file():
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_generate_responses(args: argparse.Namespace) -> int:
    """Every check that needs no model (options, the corpus folder, the prompts) runs before the model loads; the
    corpus's writer lock is held from then on (a second job writing to it is refused, naming the holder)."""
    from hf_chainflow.training import corpus as corpora
    rank, world = corpora.process_rank()
    if args.flush:
        return _flush(args, rank)
    if not args.prompts:
        raise usage_error("generate-responses", "give --prompts (or --flush).")
    check_model_source("--target", args.target, ("smollm2-135m-instruct",))
    _check_corpus_folder(args.corpus)
    from hf_chainflow.training.prompts import evaluation_prompt_ids, read_prompt_source, select_prompts

    rows = read_prompt_source(args.prompts, prompt_column=args.prompt_column, split=args.prompts_split)
    selection = select_prompts(rows, domains=args.domains, per_domain=args.per_domain, seed=args.seed,
                               exclude=evaluation_prompt_ids())
    if not selection:
        raise ValueError(_nothing_selected(args, rows))
    with corpora.writer_lock(args.corpus):
        result = _generate(args, selection, rank, world)
    print(f"process {rank}/{world}: {result['generated']} responses, {result['response_tokens']} tokens in "
          f"{result['seconds']:.0f} s; {len(result['shards'])} new shards; {result['pending']} responses pending")
    return 0


def _check_corpus_folder(path: str) -> None:
    """`--corpus` is an existing corpus whose corpus.json reads, or a new / empty / half-made folder; writable."""
    from hf_chainflow.training import corpus as corpora
    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"`--corpus` must be a folder, got {path!r}, which is a file.")
    if (Path(path) / corpora.INFO).is_file():
        corpora.ResponseCorpus(path)
    else:
        corpora.check_new_corpus_folder(path)
    corpora.check_writable(path)


def _nothing_selected(args: argparse.Namespace, rows: list[dict]) -> str:
    domains = sorted({r["domain"] for r in rows})
    if args.domains and not set(args.domains) & set(domains):
        return (f"`--domains` {','.join(args.domains)} names none of the domains of `--prompts` {args.prompts!r} "
                f"({', '.join(domains)}); check the domain names.")
    return (f"Every prompt of `--prompts` {args.prompts!r}"
            f"{' in --domains ' + ','.join(args.domains) if args.domains else ''} is an evaluation prompt "
            f"(hf_chainflow/data/eval_prompts.jsonl), which is never answered into a corpus; give other prompts.")


def _flush(args: argparse.Namespace, rank: int) -> int:
    from hf_chainflow.training import corpus as corpora
    corpus = corpora.ResponseCorpus(args.corpus)
    corpora.check_writable(args.corpus)
    with corpora.writer_lock(args.corpus):
        shard = corpus.flush_pending(rank=rank)
        if shard is not None:
            corpus.write_card()
    print(f"wrote {shard}" if shard else f"no pending responses of process {rank} in {args.corpus}")
    return 0


def _generate(args: argparse.Namespace, selection: list[dict], rank: int, world: int) -> dict:
    import torch

    from hf_chainflow.targets import load_model_and_tokenizer
    from hf_chainflow.training import corpus as corpora
    from hf_chainflow.training.responses import generate_into_corpus

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model_and_tokenizer(args.target, getattr(torch, args.dtype))
    model.to(device).eval()
    corpus = corpora.ResponseCorpus.create(args.corpus, target=args.target, tokenizer=tokenizer)
    corpus.record_selection({"prompts": os.path.basename(str(args.prompts)), "prompts_sha256": _file_sha256(
        args.prompts), "domains": args.domains, "per_domain": args.per_domain, "seed": args.seed,
        "excluded": "the evaluation prompts (hf_chainflow/data/eval_prompts.jsonl)",
        "prompts_selected": len(selection)})
    settings = corpora.GenerationSettings.here(args.dtype, device, max_new_tokens=args.max_new_tokens)
    return generate_into_corpus(model, tokenizer, selection, corpus, settings, batch_size=args.batch_size,
                                shard_size=args.shard_size, rank=rank, world_size=world, max_prompts=args.max_prompts)
