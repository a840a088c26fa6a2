"""`hf-chainflow prepare`: generate (or take) a target's greedy responses and cache its hidden states
(`hf_chainflow.training.prepare.prepare`).

    hf-chainflow prepare --responses responses.jsonl --out DIR     # cache hidden states of given responses
    hf-chainflow prepare --prompts prompts.jsonl --out DIR         # generate greedy responses first
    hf-chainflow prepare --corpus corpus/smollm2-135m-instruct --out DIR   # the rows of a response corpus
    hf-chainflow prepare --prompts train.jsonl --prompt-text chat --target-labels \
        --exclude-heldout corpus/smollm2-135m-instruct --out DIR       # the prompts' own text, no generation
"""

from __future__ import annotations

import argparse
import os

from hf_chainflow.cli_args import check_writable_output, positive_int, usage_error

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # generation dtypes


def add_prepare_parser(sub) -> None:
    p = sub.add_parser("prepare", help="Generate/take the target's greedy responses and cache its hidden states.",
                       description="Resumable: rerun the same command to continue a killed run.")
    p.add_argument("--target", default="smollm2-135m-instruct", help="known target name or local model directory")
    p.add_argument("--prompts", help="JSONL of prompts (id, domain, language, prompt[, turns])")
    p.add_argument("--prompt-column", default="prompt", help="column of --prompts holding the prompt text")
    p.add_argument("--responses", help="JSONL of already-generated responses (id, prompt_ids, response_ids, ...); "
                                       "without --prompts, these rows are the data set")
    p.add_argument("--corpus", help="response corpus folder (hf_chainflow.training.corpus): its rows are the data set")
    p.add_argument("--split", choices=("train", "heldout"), default="train",
                   help="split of --corpus to prepare (the held-out split only when named)")
    p.add_argument("--domains", help="comma-separated domains of --corpus to prepare (default: all)")
    p.add_argument("--out", required=True, help="output directory (shards, manifest, shortlist)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="generation batch size")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="longest generated response, in tokens")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="bfloat16", help="generation dtype")
    p.add_argument("--hidden-dtype", choices=sorted(DTYPE_NAMES), default="float32",
                   help="dtype of the hidden-state (and label) pass (default float32; bfloat16 is faster on a CPU with "
                        "bfloat16 matrix instructions, rounded differently)")
    p.add_argument("--shard-size", type=positive_int, default=128, help="sequences per shard")
    p.add_argument("--max-batch-tokens", type=positive_int, default=4096, help="padded tokens per hidden-state forward")
    p.add_argument("--limit", type=positive_int, help="use only the first N rows")
    p.add_argument("--shuffle-seed", type=int, default=0, help="order of the sequences (shards mix domains)")
    p.add_argument("--keep-order", action="store_true", help="keep the input order instead of shuffling")
    p.add_argument("--max-shards", type=positive_int, help="stop after this many new shards")
    p.add_argument("--target-layers", help="comma-separated decoder layers (0-based) whose outputs are cached too "
                                           "(default: the final state only)")
    p.add_argument("--target-labels", action="store_true",
                   help="store the target's own next-token choice (its argmax) at every position; the windows predict "
                        "it instead of the stored tokens (for text the target did not write)")
    p.add_argument("--prompt-text", choices=("chat", "raw"),
                   help="make the data the --prompts' own text instead of responses to them, with no generation: "
                        "`chat`, the user turn through the chat template; `raw`, the text alone (needs --target-labels)")
    p.add_argument("--exclude-heldout", metavar="CORPUS",
                   help="leave out the rows whose ids are in this response corpus's held-out split (so nothing is "
                        "trained on the prompts the drafters are judged on)")
    p.add_argument("--threads", type=positive_int, help="torch.set_num_threads")
    p.add_argument("--device", help="device of the target's passes, e.g. `cuda` (default: `cuda` when available, "
                                    "else `cpu`)")
    p.set_defaults(func=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    import torch

    from hf_chainflow.training.prepared_data import MANIFEST, read_manifest
    from hf_chainflow.training.prompts import load_prompts, load_responses
    from hf_chainflow.training.prepare import prepare
    from hf_chainflow.targets import load_model_and_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.prompts and not args.responses and not args.corpus:
        raise usage_error("prepare", "give --prompts, --responses (or both), or --corpus.")
    if args.corpus and args.responses:
        raise usage_error("prepare", "give --responses or --corpus, not both: both supply the responses.")
    if args.domains and not args.corpus:
        raise usage_error("prepare", "--domains selects rows of --corpus; give --corpus too.")
    if args.prompt_text and (not args.prompts or args.responses or args.corpus):
        raise usage_error("prepare", "--prompt-text makes the data the text of --prompts: give --prompts, and neither "
                          "--responses nor --corpus.")
    if args.prompt_text and not args.target_labels:
        raise usage_error("prepare", "--prompt-text needs --target-labels: the prompts' text is not the target's, so "
                          "the windows must predict the target's own next tokens.")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise usage_error("prepare", f"--device must name a torch device such as `cpu` or `cuda`, got "
                          f"{args.device!r} ({err}).") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise usage_error("prepare", f"--device {args.device!r} needs a CUDA GPU, and torch sees none; use "
                          f"`--device cpu` or leave --device out.")
    for flag, path in (("--prompts", args.prompts), ("--responses", args.responses)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"`{flag}` must be a JSONL file, got {path!r}, which "
                             f"{'is a directory' if os.path.isdir(path) else 'does not exist'}.")
    check_writable_output("--out", args.out)  # before the target loads
    if args.prompts:  # the rows parse, have their text and unique ids
        load_prompts(args.prompts, prompt_column=args.prompt_column)
    if args.responses:
        load_responses(args.responses)
    if os.path.isfile(os.path.join(args.out, MANIFEST)):  # a run to resume: a damaged manifest is named now
        read_manifest(args.out, require=("finished", "num_shards"))
    try:
        layers = [int(i) for i in args.target_layers.split(",")] if args.target_layers else None
    except ValueError:
        raise usage_error("prepare", f"--target-layers must be comma-separated layer numbers such as `3,15,27`, "
                          f"got {args.target_layers!r}.") from None
    exclude = None
    if args.exclude_heldout:
        from hf_chainflow.training.corpus import ResponseCorpus

        exclude = ResponseCorpus(args.exclude_heldout).ids("heldout")
    responses = args.responses
    if args.corpus:
        from hf_chainflow.training.corpus import ResponseCorpus

        corpus = ResponseCorpus(args.corpus)
        responses = corpus.responses(args.split, domains=args.domains.split(",") if args.domains else None)
        if not responses:
            raise ValueError(f"`--corpus` {args.corpus!r} holds no {args.split} rows"
                             f"{' of the domains ' + args.domains if args.domains else ''}.")
    model, tokenizer = load_model_and_tokenizer(args.target, torch.float32)
    if args.corpus:
        corpus.check_tokenizer(tokenizer)
    model.to(device)
    manifest = prepare(model, tokenizer, args.out, prompts=args.prompts, responses=responses,
                       prompt_column=args.prompt_column, limit=args.limit, batch_size=args.batch_size,
                       max_new_tokens=args.max_new_tokens, generation_dtype=getattr(torch, args.dtype),
                       hidden_dtype=getattr(torch, args.hidden_dtype),
                       shard_size=args.shard_size, max_batch_tokens=args.max_batch_tokens,
                       shuffle_seed=None if args.keep_order else args.shuffle_seed, max_shards=args.max_shards,
                       target_layers=layers, target_labels=args.target_labels, prompt_text=args.prompt_text,
                       exclude_ids=exclude)
    print(f"{len(manifest['finished'])}/{manifest['num_shards']} shards finished in {args.out}")
    return 0


__all__ = ["add_prepare_parser", "run_prepare"]
