"""Drafter training data: the target's own greedy responses (or text it did not write, labelled with its own
next-token choices) and its cached hidden states.

`prepare(...)` turns prompts into a directory of shards; `ChainFlowWindowDataset` reads training windows from it.

Output directory
----------------
- `plan.json`: the ordered sequence ids (sequence `i` goes to shard `i // shard_size`); fixed by the first run.
- `manifest.json`: settings, target facts (`hidden_size`, `vocab_size`, `eos_token_ids`, `pad_token_id`), the
  `domains`/`languages` of the whole plan (sorted; window `domain` fields index into `domains`), and `finished`
  (the finished shard numbers).
- `shards/shard-00000.safetensors`, one per `shard_size` sequences, written atomically (`hf_chainflow.fileio`: temp
  file, fsync, rename, folder fsync; a kill leaves the old file or none, and a rerun removes the dead temp files):
  `hidden (T, D) float16`, `tokens (T,) int64`, `offsets (N+1,) int64` (sequence `n` is rows
  `offsets[n]:offsets[n+1]`), `response_start (N,) int64` (index of the first response token inside the
  sequence's stored span), with `target_layers` also `layer_<i> (T, D) float16` (decoder layer `i`'s output), with
  `target_labels` also `labels (T,) int64` (the target's own next-token choice after each token, the argmax of its
  `lm_head` over `hidden`); the safetensors metadata key `sequences` holds a JSON list with one record per sequence
  (`id, domain, language, source, finish, prompt_len, response_len, length, response_start`).
- `responses/shard-00000.jsonl`: responses generated here (same schema as the shared responses file).
- `index.jsonl`: every finished sequence's record plus `shard` and `row` (its number inside the shard).
- `shortlist.json`: sorted unique token ids of all finished responses (with `target_labels`: of the labels the
  windows predict), plus the EOS id(s).

Stored span of a sequence (prompt `P` tokens, response `R` tokens): the last `prompt_tail` (16) prompt positions and
all response positions, `tokens[j]` = token j of the span and `hidden[j]` = the target's final hidden state after
consuming it (after the final norm, so `lm_head(hidden[j])` are the logits that predict `tokens[j+1]`).

Windows (SPEC "Alignment"), inside one stored span `x[0..L-1]`, `h[0..L-1]`, anchor `t` (last context state;
`x[t+1]` is the bonus token), `C` context states, `K` draft positions, `p` parents:
- `context_states (C, D)` = `h[t-C+1..t]`, zero-left-padded; `context_mask (C,)` True where a state exists;
- `target_states (K, D)` = `h[t+1..t+K]`; `target_tokens (K,)` = `x[t+2..t+K+1]` (with `target_labels`:
  `labels[t+1..t+K]`, what the target itself puts after `x[..t+1+i]`); `target_mask (K,)` True where
  `x[t+1+i]` exists (draft position `i`, 1-based); masked entries are zero states and `pad_token_id`;
- `prev_tokens (p-1+K,)` = `x[t+2-p..t+K]` (`pad_token_id` outside the span): the parents of draft position `i` are
  `prev_tokens[i-1 : i-1+p]` = `x[t+i-p+1..t+i]`;
- `domain` () int64: index into the manifest's `domains`.
Windows for a drafter with fused target layers (`target_layers=`) append each chosen layer's output to every
context state: `context_states (C, (1 + n) D)`.
Anchors run from `response_start - 1` (last prompt state; the bonus is the first response token) to `L - 3` (the
last anchor whose first draft position has a target token).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from hf_chainflow import fileio

FORMAT = "hf_chainflow.training.data/1"
LATER_SETTINGS = {"target_labels": False, "prompt_text": None, "hidden_dtype": "float32"}  # manifest settings, as absent ones read
MANIFEST, PLAN, INDEX, SHORTLIST = "manifest.json", "plan.json", "index.jsonl", "shortlist.json"
PROMPT_TAIL = 16

__all__ = [
    "prepare", "load_prompts", "load_responses", "chat_prompt_ids", "text_ids", "generate_responses",
    "final_hidden_states", "target_hidden_states", "target_argmax",
    "read_manifest", "read_shortlist", "check_prepared_data", "compute_shortlist", "iter_sequences",
    "state_statistics", "layer_statistics",
    "ChainFlowWindowDataset", "collate",
]


# ----------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------

def _read_jsonl(path: str | os.PathLike) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                rows.append(parse_jsonl_line(line, path, n))
    return rows


def parse_jsonl_line(line: str, path: str | os.PathLike, n: int) -> dict:
    """One JSONL row, or a `ValueError` naming the file and line (a JSON Lines file holds one object per line)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{n}: not valid JSON ({err.msg} at column {err.colno}); a JSONL file holds one "
                         f"JSON object per line.") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{n}: expected a JSON object per line, got a {type(row).__name__}.")
    return row


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive(name: str, value, *, optional: bool = False) -> None:
    """`value` must be a positive int (or None when `optional`); a `ValueError` naming `name` otherwise."""
    if (value is None and optional) or (_is_int(value) and value >= 1):
        return
    raise ValueError(f"`{name}` must be a positive int{' or None' if optional else ''}, got {value!r}.")


def load_prompts(source: str | os.PathLike | Iterable[dict], *, prompt_column: str = "prompt",
                 limit: int | None = None) -> list[dict]:
    """Prompt rows from a JSONL file, a `datasets.Dataset` or any iterable of dicts.

    Each row needs the prompt text in `prompt_column` (or a chat `turns` list of user strings, of which the first
    is used, as in the shared responses file); `id`, `domain`, `language`, `source` are optional
    (defaults: `row-<n>`, `"unknown"`, `"unknown"`, `""`). Ids must be unique (else a `ValueError` naming both rows).
    """
    if isinstance(source, dict):
        raise ValueError("`prompts` is one dict; pass a list of prompt rows, e.g. `[{'id': 'a', 'prompt': '...'}]`.")
    _check_positive("limit", limit, optional=True)
    rows = _read_jsonl(source) if isinstance(source, (str, os.PathLike)) else source
    out, seen = [], {}
    for n, row in enumerate(rows):
        if limit is not None and n >= limit:
            break
        if not isinstance(row, dict):
            raise ValueError(f"Prompt row {n} is a {type(row).__name__} ({row!r:.60}), not a dict; give rows such as "
                             f"`{{'id': 'a', '{prompt_column}': 'the prompt'}}`.")
        text = row.get(prompt_column)
        turns = row.get("turns")
        if text is None and isinstance(turns, list) and turns:
            text = turns[0]
        if not isinstance(text, str):
            raise ValueError(f"Prompt row {n} (id {row.get('id')!r}) has no text in column {prompt_column!r} nor a "
                             f"`turns` list; pass `prompt_column=` naming the column that holds the prompt.")
        out.append({"id": str(row.get("id", f"row-{n}")), "domain": row.get("domain") or "unknown",
                    "language": row.get("language") or "unknown", "source": row.get("source") or "",
                    "prompt": text})
        if out[-1]["id"] in seen:  # responses, shards and resumes go by id: a second row would be read as the first
            where = f"{source}: " if isinstance(source, (str, os.PathLike)) else ""
            raise ValueError(f"{where}prompt row {n}: id {out[-1]['id']!r} occurs twice (first at row "
                             f"{seen[out[-1]['id']]}); prompt ids must be unique: give the row another id, or delete "
                             f"it if it is a copy.")
        seen[out[-1]["id"]] = n
    return out


def load_responses(source: str | os.PathLike | Iterable[dict]) -> dict[str, dict]:
    """Already-generated responses by id (rows with `id, prompt_ids, response_ids` and optionally `domain,
    language, source, finish`), from a JSONL file or an iterable of dicts."""
    rows = _read_jsonl(source) if isinstance(source, (str, os.PathLike)) else source
    out = {}
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"Response row {n} is a {type(row).__name__}, not a dict with `id`, `prompt_ids` and "
                             f"`response_ids`.")
        missing = {"id", "prompt_ids", "response_ids"} - set(row)
        if missing:
            raise ValueError(f"Response row {row.get('id')!r} lacks {sorted(missing)}; every response row needs "
                             f"`id`, `prompt_ids` and `response_ids`.")
        for key in ("prompt_ids", "response_ids"):
            ids = row[key]
            if not isinstance(ids, (list, tuple)) or (key == "prompt_ids" and not ids) or any(
                    not _is_int(i) or i < 0 for i in ids):
                kind = "a non-empty list" if key == "prompt_ids" else "a list"
                raise ValueError(f"Response row {row['id']!r}: `{key}` must be {kind} of token ids (non-negative "
                                 f"ints), got {ids!r:.80}.")
        if str(row["id"]) in out:
            raise ValueError(f"Response id {row['id']!r} occurs twice; each response needs its own id.")
        out[str(row["id"])] = row
    return out


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of one user message through the tokenizer's chat template (default system prompt included),
    ending with the assistant generation prompt."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids)


PROMPT_TEXT_FORMATS = ("chat", "raw")


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str, fmt: str = "chat") -> tuple[list[int], list[int]]:
    """A text as a sequence for forward-only data: `(prefix_ids, text_part_ids)`.

    `fmt="chat"`: the text as a user turn through the chat template (`chat_prompt_ids`); the prefix is what the
    template puts before the text (system prompt, user header: the ids it shares with an empty user turn), the text
    part everything from the text on (the text, the end of the turn, the assistant header). `fmt="raw"`: the text
    tokenised without a template (with the tokenizer's special tokens, e.g. a BOS); the prefix is its first id.
    """
    _check_choice("prompt_text", fmt, PROMPT_TEXT_FORMATS)
    if fmt == "chat":
        full, empty = chat_prompt_ids(tokenizer, text), chat_prompt_ids(tokenizer, "")
        n = 0
        while n < min(len(full), len(empty)) - 1 and full[n] == empty[n]:
            n += 1
        n = max(n, 1)  # the last prefix position is the first anchor
        return full[:n], full[n:]
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    return ids[:1], ids[1:]


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {allowed}, got {value!r}.")


# ----------------------------------------------------------------------------------------------------------------
# Target passes
# ----------------------------------------------------------------------------------------------------------------

def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos:
        raise ValueError("Neither the model's generation_config nor the tokenizer names an EOS token id; set "
                         "`model.generation_config.eos_token_id`.")
    return eos


def _pad_id(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eos: list[int]) -> int:
    for pad in (tokenizer.pad_token_id, model.generation_config.pad_token_id, model.config.pad_token_id):
        if pad is not None:
            return int(pad)
    return eos[0]


def _batches_by_length(lengths: Sequence[int], max_batch: int, max_tokens: int | None = None) -> list[list[int]]:
    """Indices sorted by length, cut into batches of at most `max_batch` rows and `max_tokens` padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur = [], []
    for i in order:  # ascending, so row i is the longest of the batch it joins
        if cur and (len(cur) >= max_batch or (max_tokens is not None and lengths[i] * (len(cur) + 1) > max_tokens)):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def cut_response(new_tokens: Sequence[int], eos_ids: Sequence[int]) -> tuple[list[int], str]:
    """Cut generated ids after the first EOS (kept); `finish` is "eos" or "length"."""
    for k, tok in enumerate(new_tokens):
        if tok in eos_ids:
            return list(new_tokens[: k + 1]), "eos"
    return list(new_tokens), "length"


@torch.no_grad()
def generate_responses(model: PreTrainedModel, prompts: Sequence[Sequence[int]], *, eos_token_ids: Sequence[int],
                       pad_token_id: int, batch_size: int = 32, max_new_tokens: int = 256,
                       progress: tqdm | None = None) -> list[tuple[list[int], str]]:
    """Greedy responses `(response_ids, finish)` to tokenised prompts, in padded static batches bucketed by prompt
    length (left padding). The model runs in whatever dtype it has."""
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_ids),
                                  pad_token_id=pad_token_id)
    results: list[Any] = [None] * len(prompts)
    for batch in _batches_by_length([len(p) for p in prompts], batch_size):
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # (B, P)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=gen_config)  # (B, P + new)
        for r, i in enumerate(batch):
            results[i] = cut_response(out[r, width:].tolist(), eos_token_ids)
        if progress is not None:
            progress.update(len(batch))
    return results


@torch.no_grad()
def target_hidden_states(model: PreTrainedModel, sequences: Sequence[Sequence[int]], *, pad_token_id: int,
                         layers: Sequence[int] = (), max_batch_tokens: int = 4096,
                         max_batch: int = 32) -> list[torch.Tensor]:
    """The target's hidden states at every position of each sequence, each `(1 + len(layers), L, D)`: first the last
    hidden state (after the final norm), then the output of each decoder layer in `layers` (0-based; layer `i`'s
    output is transformers' `hidden_states[i + 1]`).

    Sequences of similar length share a right-padded batch (right padding leaves a causal model's real positions
    unchanged); the model runs in whatever dtype and on whatever device it has, without computing full-vocabulary
    logits. The states come back on the CPU.
    """
    results: list[Any] = [None] * len(sequences)
    picks = [-1] + [i + 1 for i in layers]
    for batch in _batches_by_length([len(s) for s in sequences], max_batch, max_batch_tokens):
        width = max(len(sequences[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # (B, L)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, : len(sequences[i])] = torch.tensor(sequences[i])
            mask[r, : len(sequences[i])] = 1
        out = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), output_hidden_states=True,
                    logits_to_keep=1, use_cache=False)
        hidden = torch.stack([out.hidden_states[k] for k in picks], 1).cpu()  # (B, 1 + len(layers), L, D)
        for r, i in enumerate(batch):
            results[i] = hidden[r, :, : len(sequences[i])].clone()
    return results


def final_hidden_states(model: PreTrainedModel, sequences: Sequence[Sequence[int]], *, pad_token_id: int,
                        max_batch_tokens: int = 4096, max_batch: int = 32) -> list[torch.Tensor]:
    """The target's last hidden state (after the final norm) at every position of each sequence, each `(L, D)`
    (`target_hidden_states` without extra layers)."""
    return [h[0] for h in target_hidden_states(model, sequences, pad_token_id=pad_token_id,
                                               max_batch_tokens=max_batch_tokens, max_batch=max_batch)]


@torch.no_grad()
def target_argmax(model: PreTrainedModel, states: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The target's own next-token choice at each of its final states `states` `(L, D)` (after the final norm): the
    argmax of its `lm_head`, `(L,)` int64 on the CPU, `chunk` rows at a time (never all `(L, V)` logits at once).
    What greedy decoding picks (a monotone logit transform such as soft-capping does not move the argmax)."""
    head = model.get_output_embeddings()
    weight = head.weight
    parts = [head(part.to(device=weight.device, dtype=weight.dtype)).argmax(-1).cpu() for part in states.split(chunk)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


# ----------------------------------------------------------------------------------------------------------------
# prepare
# ----------------------------------------------------------------------------------------------------------------

def _atomic_write_text(path: Path, text: str) -> None:
    fileio.atomic_write_text(path, text)  # temp file, fsync, rename, folder fsync; the temp file goes on any error


def shard_path(out_dir: str | os.PathLike, shard: int) -> Path:
    return Path(out_dir) / "shards" / f"shard-{shard:05d}.safetensors"


def _list_of(kind):
    return lambda v: isinstance(v, list) and all(isinstance(x, kind) and not isinstance(x, bool) for x in v)


# The manifest keys that code reads, each with the rule its value must meet (`read_manifest`).
_MANIFEST_RULES = {
    "finished": ("a list of shard numbers (integers >= 0)", lambda v: _list_of(int)(v) and all(x >= 0 for x in v)),
    "num_shards": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "num_sequences": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "shard_size": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "hidden_size": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "vocab_size": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "pad_token_id": ("an integer", _is_int),
    "eos_token_ids": ("a list of token ids (integers)", _list_of(int)),
    "domains": ("a list of domain names (strings)", _list_of(str)),
    "languages": ("a list of language names (strings)", _list_of(str)),
    "target_layers": ("null or a list of layer numbers (integers)", lambda v: v is None or _list_of(int)(v)),
    "target_labels": ("true or false", lambda v: isinstance(v, bool)),
    "prompt_text": ("null or a string", lambda v: v is None or isinstance(v, str)),
}
# What the training windows read: `ChainFlowWindowDataset`, `compute_shortlist`.
WINDOW_KEYS = ("finished", "hidden_size", "pad_token_id", "domains")
TRAINING_KEYS = (*WINDOW_KEYS, "eos_token_ids")


def _manifest_fix(out_dir) -> str:
    return (f"Move it aside and rerun the `hf-chainflow prepare ... --out {out_dir}` command that made it: it "
            f"rebuilds the manifest and keeps the finished shards.")


def read_manifest(out_dir: str | os.PathLike, *, require: Sequence[str] = ("finished",)) -> dict:
    """The manifest of a prepared data directory, checked: valid JSON holding an object, the `require`d keys there,
    and every key that code reads of the type it must have (`_MANIFEST_RULES`); else a `ValueError` naming the file,
    the key, the rule and the fix."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise ValueError(f"`{out_dir}` holds no {MANIFEST}; run `hf-chainflow prepare --out {out_dir}` first.")
    manifest = fileio.read_json(path, what="data manifest", expect=dict, fix=_manifest_fix(out_dir))
    absent = [key for key in require if key not in manifest]
    if absent:
        raise ValueError(f"{path}: the data manifest has no {', '.join(f'`{k}`' for k in absent)}; it is damaged or "
                         f"was not written by `hf-chainflow prepare`. {_manifest_fix(out_dir)}")
    for key, (rule, ok) in _MANIFEST_RULES.items():
        if key in manifest and not ok(manifest[key]):
            raise ValueError(f"{path}: `{key}` must be {rule}, got {json.dumps(manifest[key])[:60]}; the manifest is "
                             f"damaged. {_manifest_fix(out_dir)}")
    beyond = [s for s in manifest.get("finished", ()) if s >= manifest.get("num_shards", s + 1)]
    if beyond:
        raise ValueError(f"{path}: `finished` lists shards {beyond[:5]} beyond `num_shards` {manifest['num_shards']}; "
                         f"the manifest is damaged. {_manifest_fix(out_dir)}")
    return manifest


def _shard_records(path: Path) -> list[dict]:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["sequences"])


def iter_sequences(out_dir: str | os.PathLike) -> Iterable[dict]:
    """Yield each finished sequence as a dict: its record plus `tokens (L,)`, `hidden (L, D) float16` and, for data
    prepared with `target_layers`, `layers` (`{layer: (L, D) float16}`), with `target_labels`, `labels (L,)`."""
    manifest = read_manifest(out_dir)
    for shard in manifest["finished"]:
        path = shard_path(out_dir, shard)
        with safe_open(str(path), framework="pt") as f:
            records = json.loads(f.metadata()["sequences"])
            offsets, tokens, hidden = f.get_tensor("offsets"), f.get_tensor("tokens"), f.get_slice("hidden")
            layers = {i: f.get_slice(f"layer_{i}") for i in manifest.get("target_layers") or ()}
            labels = f.get_tensor("labels") if manifest.get("target_labels") else None
            for n, rec in enumerate(records):
                a, b = int(offsets[n]), int(offsets[n + 1])
                extra = {"layers": {i: t[a:b] for i, t in layers.items()}} if layers else {}
                if labels is not None:
                    extra["labels"] = labels[a:b]
                yield {**rec, "shard": shard, "row": n, "tokens": tokens[a:b], "hidden": hidden[a:b], **extra}


def compute_shortlist(out_dir: str | os.PathLike, manifest: dict | None = None) -> list[int]:
    """Sorted unique token ids of all finished responses plus the EOS id(s) (finished per `manifest`, by default
    the one on disk). For data with `target_labels`: the labels the windows predict (those after the first
    response position up to the second-to-last), not the text's tokens."""
    manifest = read_manifest(out_dir, require=("finished", "eos_token_ids")) if manifest is None else manifest
    labelled = bool(manifest.get("target_labels"))
    seen = set(manifest["eos_token_ids"])
    for shard in manifest["finished"]:
        with safe_open(str(shard_path(out_dir, shard)), framework="pt") as f:
            tokens = f.get_tensor("labels" if labelled else "tokens")
            offsets, starts = f.get_tensor("offsets"), f.get_tensor("response_start")
        for n in range(len(starts)):
            a, b = int(offsets[n]) + int(starts[n]), int(offsets[n + 1])
            seen.update(tokens[a: b - 1 if labelled else b].tolist())
    return sorted(seen)


def read_shortlist(out_dir: str | os.PathLike) -> list[int]:
    """The vocabulary shortlist saved by `prepare` (for `ChainFlowConfig.shortlist`), checked: a JSON object whose
    `shortlist` is a list of token ids; else a `ValueError` naming the file and the fix."""
    path = Path(out_dir) / SHORTLIST
    if not path.is_file():
        raise ValueError(f"`{out_dir}` holds no {SHORTLIST}; run `hf-chainflow prepare --out {out_dir}` first.")
    fix = (f"Rerun the `hf-chainflow prepare ... --out {out_dir}` command that made it: it writes {SHORTLIST} again "
           f"from the finished shards.")
    value = fileio.read_json(path, what="vocabulary shortlist", expect=dict, fix=fix).get("shortlist")
    if not _list_of(int)(value) or any(i < 0 for i in value):
        raise ValueError(f"{path}: `shortlist` must be a list of token ids (integers >= 0), got "
                         f"{json.dumps(value)[:60]}; the file is damaged. {fix}")
    return value


def check_prepared_data(data_dir: str | os.PathLike, shards: Sequence[int] | None = None) -> dict:
    """Check what training reads of a prepared data directory, before any model loads: the manifest (`TRAINING_KEYS`
    of their types), the shortlist, and each finished shard (or each of `shards`) a readable shard file. Returns the
    manifest; raises a `ValueError` naming the file and the fix."""
    manifest = read_manifest(data_dir, require=TRAINING_KEYS)
    read_shortlist(data_dir)
    fix = (f"delete it and rerun the `hf-chainflow prepare ... --out {data_dir}` command that made it: it redoes the "
           f"missing shards")
    unfinished = sorted(set(shards or ()) - set(manifest["finished"]))
    if unfinished:
        raise ValueError(f"`shards` {unfinished} are not finished in `{data_dir}` (finished: {manifest['finished']}); "
                         f"choose finished shards, or finish them with the same `hf-chainflow prepare` command.")
    for shard in manifest["finished"] if shards is None else shards:
        path = shard_path(data_dir, shard)
        if not path.is_file():
            raise ValueError(f"Shard {shard} is listed as finished in `{data_dir}` but {path} is missing; rerun the "
                             f"`hf-chainflow prepare ... --out {data_dir}` command that made it to redo it.")
        try:
            records = _shard_records(path)
        except Exception as err:  # safetensors raises its own error type for a damaged header
            raise ValueError(f"{path}: the shard file is damaged ({type(err).__name__}: {err}); {fix}.") from None
        if not isinstance(records, list):
            raise ValueError(f"{path}: the shard's `sequences` metadata is not a list; {fix}.")
    return manifest


def _write_shard(out_dir: Path, shard: int, rows: list[dict], hidden: list[torch.Tensor], prompt_tail: int,
                 layers: Sequence[int] = (), labels: list[torch.Tensor] | None = None) -> None:
    """Keep the last `prompt_tail` prompt positions and all response positions of each sequence; write one shard.
    `hidden[n]` is `(1 + len(layers), L, D)` (`target_hidden_states`); `labels[n]`, if given, the target's argmax
    at the kept positions `(keep + R,)`."""
    spans, toks, offsets, starts, records = [], [], [0], [], []
    for row, h in zip(rows, hidden):
        p_len, r_len = len(row["prompt_ids"]), len(row["response_ids"])
        keep = min(prompt_tail, p_len)
        span = h[:, p_len - keep:].to(torch.float16)  # (1 + len(layers), keep + R, D)
        if not torch.isfinite(span).all():
            raise ValueError(f"Sequence {row['id']!r}: hidden states overflow float16 (max |h| = "
                             f"{h.abs().max().item():.3g}); this target cannot be cached in float16.")
        spans.append(span)
        toks.append(torch.tensor(row["prompt_ids"][p_len - keep:] + row["response_ids"], dtype=torch.long))
        offsets.append(offsets[-1] + keep + r_len)
        starts.append(keep)
        records.append({"id": row["id"], "domain": row["domain"], "language": row["language"],
                        "source": row.get("source", ""), "finish": row["finish"], "prompt_len": p_len,
                        "response_len": r_len, "length": keep + r_len, "response_start": keep})
    states = torch.cat(spans, 1)  # (1 + len(layers), T, D)
    tensors = {"hidden": states[0].contiguous(), **{f"layer_{i}": states[k + 1].contiguous() for k, i in enumerate(layers)},
               "tokens": torch.cat(toks),
               "offsets": torch.tensor(offsets, dtype=torch.long),
               "response_start": torch.tensor(starts, dtype=torch.long)}
    if labels is not None:
        tensors["labels"] = torch.cat(labels)
    # temp file, fsync, readable by all (safetensors creates it private; the data is meant to be shared), rename,
    # folder fsync; on any error the temp file is removed
    with fileio.atomic_path(shard_path(out_dir, shard), mode=0o644) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "sequences": json.dumps(records)})


def _write_index_and_shortlist(out_dir: Path, manifest: dict) -> None:
    lines = []
    for shard in manifest["finished"]:
        for n, rec in enumerate(_shard_records(shard_path(out_dir, shard))):
            lines.append(json.dumps({**rec, "shard": shard, "row": n}))
    _atomic_write_text(out_dir / INDEX, "".join(line + "\n" for line in lines))
    _atomic_write_text(out_dir / SHORTLIST, json.dumps({"shortlist": compute_shortlist(out_dir, manifest)}))


def _text_rows(tokenizer, prompts, prompt_column: str, fmt: str) -> list[dict]:
    """Rows whose "response" is the prompt's own text (`text_ids`), `finish` = "text"."""
    rows = load_prompts(prompts, prompt_column=prompt_column)
    for row in rows:
        row["prompt_ids"], row["response_ids"] = text_ids(tokenizer, row.pop("prompt"), fmt)
        row["finish"] = "text"
    return rows


def _build_rows(tokenizer, prompts, responses, prompt_column: str) -> list[dict]:
    """Rows with `prompt_ids`, and `response_ids`/`finish` where a supplied response covers them."""
    responses = load_responses(responses) if responses is not None and not isinstance(responses, dict) else responses
    responses = responses or {}
    if prompts is None:
        if not responses:
            raise ValueError("`prompts` is None and no `responses` were given; pass prompts to generate from, or "
                             "already-generated responses.")
        rows = [{"id": k, "domain": r.get("domain") or "unknown", "language": r.get("language") or "unknown",
                 "source": r.get("source", ""), "prompt_ids": list(r["prompt_ids"])} for k, r in responses.items()]
    else:
        rows = load_prompts(prompts, prompt_column=prompt_column)
        for row in rows:
            row["prompt_ids"] = chat_prompt_ids(tokenizer, row.pop("prompt"))
            given = responses.get(row["id"])
            if given is not None and list(given["prompt_ids"]) != row["prompt_ids"]:
                raise ValueError(f"Supplied response {row['id']!r} was generated from different prompt ids than "
                                 f"this tokenizer's chat template gives; the responses belong to another "
                                 f"tokenizer or template: regenerate them or drop `responses`.")
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError("Prompt ids must be unique; found duplicates, e.g. "
                         f"{next(i for i in ids if ids.count(i) > 1)!r}.")
    for row in rows:
        given = responses.get(row["id"])
        if given is not None:
            row["response_ids"] = list(given["response_ids"])
            row["finish"] = given.get("finish") or "given"
    return rows


def prepare(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | os.PathLike, *,
            prompts: str | os.PathLike | Iterable[dict] | None = None,
            responses: str | os.PathLike | dict | None = None, prompt_column: str = "prompt",
            limit: int | None = None, batch_size: int = 32, max_new_tokens: int = 256,
            generation_dtype: torch.dtype = torch.bfloat16, shard_size: int = 128, prompt_tail: int = PROMPT_TAIL,
            max_batch_tokens: int = 4096, shuffle_seed: int | None = 0, max_shards: int | None = None,
            target_layers: Sequence[int] | None = None, target_labels: bool = False,
            hidden_dtype: torch.dtype = torch.float32,
            prompt_text: str | None = None, exclude_ids: Iterable[str] | None = None,
            on_shard_done: Callable[[int], None] | None = None, progress: bool = True) -> dict:
    """Generate (or take) the target's greedy responses and cache its hidden states in shards under `out_dir`.

    Resumable: the first run fixes the plan (`plan.json`); a later run with the same inputs skips finished shards
    (each shard is written atomically and then recorded in the manifest). "The same inputs": the same settings,
    ids and order (`plan_sha256`) and the same prompt and supplied-response token ids (`inputs_sha256`, so another
    chat template or prompt column is refused too); anything else raises before any work. `max_shards` stops
    after that many new shards (e.g. to process part of the data now). Returns the manifest.

    - `prompts`: JSONL path / `datasets.Dataset` / dicts (see `load_prompts`); `None` uses the `responses` rows.
    - `responses`: already-generated responses (see `load_responses`); rows they cover are not generated.
    - Generation runs greedy in `generation_dtype` (a copy of the model if its dtype differs); the hidden-state
      pass (and the labels of `target_labels`) in `hidden_dtype`, float32 unless asked otherwise (bfloat16 is about
      3x faster on a CPU with bfloat16 matrix instructions, but its states and labels are rounded differently from
      float32 data).
    - `limit`: keep only the first `limit` rows (before shuffling).
    - `shuffle_seed`: order the sequences randomly (so any prefix of the shards mixes domains); `None` keeps the
      input order.
    - `target_layers`: decoder layers (0-based, before the last) whose outputs are stored too, as
      `layer_<i> (T, D)` beside `hidden` (e.g. for drafters that fuse low, middle and high layers); `None` stores
      the final state only.
    - `target_labels`: also store the target's own next-token choice at every stored position (`labels`, the
      argmax of its `lm_head` over the final state, `target_argmax`); the windows then predict these labels instead
      of the stored tokens. For text the target did not write: labelled by a forward pass alone, no generation.
    - `prompt_text`: `"chat"` or `"raw"`: the sequences are the prompts' own text (`text_ids`: the user turn through
      the chat template, or the text alone) instead of responses to them; needs `target_labels=True` and `prompts`,
      and takes no `responses`.
    - `exclude_ids`: leave out the rows with these ids (before `limit`), e.g. a held-out split's
      (`ResponseCorpus(path).ids("heldout")`), so that nothing is trained on the prompts a drafter is judged on.
    """
    for name, value in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens), ("shard_size", shard_size),
                        ("prompt_tail", prompt_tail), ("max_batch_tokens", max_batch_tokens)):
        _check_positive(name, value)
    out_dir = Path(out_dir)
    for name, value in (("limit", limit), ("max_shards", max_shards)):
        _check_positive(name, value, optional=True)
    if shuffle_seed is not None and not _is_int(shuffle_seed):
        raise ValueError(f"`shuffle_seed` must be an int (or None to keep the input order), got {shuffle_seed!r}.")
    for name, dtype in (("generation_dtype", generation_dtype), ("hidden_dtype", hidden_dtype)):
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"`{name}` must be a floating torch dtype such as `torch.bfloat16` or `torch.float32`, "
                             f"got {dtype!r}.")
    if on_shard_done is not None and not callable(on_shard_done):
        raise ValueError(f"`on_shard_done` must be a callable taking the shard number, or None; got "
                         f"{on_shard_done!r}.")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"`out_dir` {str(out_dir)!r} is a file; give a folder for the prepared data.")
    if not isinstance(target_labels, bool):
        raise ValueError(f"`target_labels` must be True or False, got {target_labels!r}.")
    if prompt_text is not None:
        _check_choice("prompt_text", prompt_text, PROMPT_TEXT_FORMATS)
        if not target_labels:
            raise ValueError(f"`prompt_text={prompt_text!r}` makes the prompts' own text the data; its tokens are "
                             f"not the target's, so the windows must predict the target's own choices: pass "
                             f"`target_labels=True`.")
        if prompts is None or responses is not None:
            raise ValueError(f"`prompt_text={prompt_text!r}` reads the text of `prompts` and takes no `responses`; "
                             f"got prompts={'None' if prompts is None else 'given'}, responses="
                             f"{'None' if responses is None else 'given'}.")
    if isinstance(exclude_ids, (str, bytes)):
        raise ValueError(f"`exclude_ids` must be a collection of row ids (e.g. a set), got the string "
                         f"{exclude_ids!r:.60}.")
    if target_layers is not None:
        num_layers = model.config.get_text_config().num_hidden_layers
        layers = list(target_layers) if isinstance(target_layers, (list, tuple)) else None
        if (not layers or any(not _is_int(i) or not 0 <= i < num_layers - 1 for i in layers)
                or len(set(layers)) != len(layers)):
            raise ValueError(f"`target_layers` must be a non-empty list of distinct decoder-layer indices in "
                             f"[0, {num_layers - 1}) (this target has {num_layers} layers; the last one's output is "
                             f"the final state, always stored), or None for the final state only; got "
                             f"{target_layers!r}.")
        target_layers = sorted(layers)
    if prompt_text is not None:
        rows = _text_rows(tokenizer, prompts, prompt_column, prompt_text)
    else:
        rows = _build_rows(tokenizer, prompts, responses, prompt_column)
    if exclude_ids is not None:
        excluded = {str(i) for i in exclude_ids}
        rows = [r for r in rows if r["id"] not in excluded]
    rows = rows[:limit]
    if not rows:
        raise ValueError("There are no rows to prepare: the given `prompts` / `responses` are empty"
                         f"{' once `exclude_ids` are left out' if exclude_ids is not None else ''}.")
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(rows)
    vocab = model.config.get_text_config().vocab_size
    for r in rows:  # supplied token ids must be the target's (the hidden-state pass embeds them)
        bad = [i for i in (*r["prompt_ids"], *r.get("response_ids", ())) if i >= vocab]
        if bad:
            raise ValueError(f"Row {r['id']!r} holds token ids {bad[:5]} outside the target's vocabulary of {vocab}; "
                             f"the prompts or responses belong to another tokenizer.")
    ids = [r["id"] for r in rows]
    eos = _eos_ids(model, tokenizer)
    pad = _pad_id(model, tokenizer, eos)
    settings = {"shard_size": shard_size, "prompt_tail": prompt_tail, "max_new_tokens": max_new_tokens,
                "generation_dtype": str(generation_dtype).removeprefix("torch."),
                "hidden_size": model.config.get_text_config().hidden_size,
                "vocab_size": model.config.get_text_config().vocab_size, "target_layers": target_layers,
                "target_labels": target_labels, "prompt_text": prompt_text,
                "hidden_dtype": str(hidden_dtype).removeprefix("torch.")}
    fingerprint = hashlib.sha256("\n".join(ids).encode()).hexdigest()
    # What the rows hold, not only their ids: a changed chat template, prompt column or supplied response resumed
    # into the same directory would mix two data sets. (Manifests written before it existed are checked by ids.)
    content = hashlib.sha256()
    for r in rows:
        content.update(f"{r['id']}\0{r['prompt_ids']}\0{r.get('response_ids')}\n".encode())
    inputs_sha256 = content.hexdigest()

    (out_dir / "shards").mkdir(parents=True, exist_ok=True)
    for folder in (out_dir, out_dir / "shards", out_dir / "responses"):  # left by a killed run (its process is gone)
        fileio.remove_stale_temps(folder)
    if (out_dir / MANIFEST).is_file():
        manifest = read_manifest(out_dir, require=("finished", "num_shards"))
        # (settings added later read as their defaults in manifests written before them)
        old = {k: manifest.get(k, LATER_SETTINGS.get(k)) for k in settings} | {"plan_sha256": manifest.get("plan_sha256")}
        new = settings | {"plan_sha256": fingerprint}
        if "inputs_sha256" in manifest:
            old["inputs_sha256"], new["inputs_sha256"] = manifest["inputs_sha256"], inputs_sha256
        if old != new:
            diff = {k: (old[k], new[k]) for k in new if old[k] != new[k]}
            raise ValueError(f"`{out_dir}` was prepared from other inputs or settings ({diff}, as (old, new)); "
                             f"resume with the same inputs, or choose a new `out_dir`.")
    else:
        _atomic_write_text(out_dir / PLAN, json.dumps(ids))
        manifest = {"format": FORMAT, **settings, "plan_sha256": fingerprint, "inputs_sha256": inputs_sha256,
                    "num_sequences": len(rows),
                    "num_shards": (len(rows) + shard_size - 1) // shard_size, "eos_token_ids": eos,
                    "pad_token_id": pad, "target": str(model.config.name_or_path),
                    "model_type": model.config.model_type, "domains": sorted({r["domain"] for r in rows}),
                    "languages": sorted({r["language"] for r in rows}), "finished": []}
    # The shard files are the truth: one renamed into place just before a kill is finished; one the manifest
    # lists but that has since been deleted is redone.
    finished = {s for s in range(manifest["num_shards"]) if shard_path(out_dir, s).is_file()}
    lost = sorted(set(manifest["finished"]) - finished)
    if lost:
        warnings.warn(f"{out_dir}: the manifest lists finished shards {lost} whose files are missing; redoing them.")
    manifest["finished"] = sorted(finished)
    _write_index_and_shortlist(out_dir, manifest)  # heals a run killed between a shard and its bookkeeping
    _atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=1))

    todo = [s for s in range(manifest["num_shards"]) if s not in finished][:max_shards]
    hidden_model = model if model.dtype == hidden_dtype else copy.deepcopy(model).to(hidden_dtype)
    gen_model = None
    done = sum(len(rows[s * shard_size:(s + 1) * shard_size]) for s in finished)
    bar = tqdm(total=len(rows), initial=done, desc="prepare (sequences)", unit="seq", disable=not progress,
               dynamic_ncols=True)
    was_training = model.training  # the passes below run in eval mode; the caller's flag comes back
    try:
        for shard in todo:
            start = time.perf_counter()
            part = rows[shard * shard_size:(shard + 1) * shard_size]
            need = [r for r in part if "response_ids" not in r]
            generated_file = out_dir / "responses" / f"shard-{shard:05d}.jsonl"
            if need and generated_file.is_file():  # generated before a kill, shard not yet written: reuse
                earlier = load_responses(generated_file)
                if all(r["id"] in earlier for r in need):
                    for r in need:
                        r["response_ids"] = list(earlier[r["id"]]["response_ids"])
                        r["finish"] = earlier[r["id"]]["finish"]
                    need = []
            if need:
                if gen_model is None:
                    gen_model = model if model.dtype == generation_dtype else copy.deepcopy(model).to(generation_dtype)
                bar.set_postfix_str(f"shard {shard}: generating {len(need)}")
                outs = generate_responses(gen_model.eval(), [r["prompt_ids"] for r in need], eos_token_ids=eos,
                                          pad_token_id=pad, batch_size=batch_size, max_new_tokens=max_new_tokens)
                for r, (resp, finish) in zip(need, outs):
                    r["response_ids"], r["finish"] = resp, finish
                generated_file.parent.mkdir(exist_ok=True)
                _atomic_write_text(generated_file, "".join(
                    json.dumps({k: r[k] for k in ("id", "domain", "language", "source", "prompt_ids", "response_ids",
                                                  "finish")}) + "\n" for r in need))
            bar.set_postfix_str(f"shard {shard}: hidden states")
            hidden = target_hidden_states(hidden_model.eval(), [r["prompt_ids"] + r["response_ids"] for r in part],
                                          layers=target_layers or (),
                                         pad_token_id=pad, max_batch_tokens=max_batch_tokens)
            labels = None
            if target_labels:  # the target's own argmax at the stored positions (the last `prompt_tail` + response)
                cut = [len(r["prompt_ids"]) - min(prompt_tail, len(r["prompt_ids"])) for r in part]
                labels = [target_argmax(hidden_model, h[0, c:]) for c, h in zip(cut, hidden)]
            _write_shard(out_dir, shard, part, hidden, prompt_tail, target_layers or (), labels)
            manifest["finished"] = sorted(set(manifest["finished"]) | {shard})
            _write_index_and_shortlist(out_dir, manifest)
            _atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=1))
            elapsed = time.perf_counter() - start
            states = sum(min(prompt_tail, len(r["prompt_ids"])) + len(r["response_ids"]) for r in part)
            forwarded = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in part)
            bar.update(len(part))
            bar.write(f"shard {shard} done: {len(part)} seqs, {len(need)} generated, {states} stored states, "
                      f"{forwarded} tokens forwarded, {elapsed:.1f} s, {states / elapsed:.1f} stored states/s, "
                      f"{forwarded / elapsed:.1f} tokens/s; "
                      f"{len(manifest['finished'])}/{manifest['num_shards']} shards")
            if on_shard_done is not None:
                on_shard_done(shard)
    finally:
        model.train(was_training)
    bar.close()
    return manifest


def state_statistics(data_dir, max_states: int = 200_000, shards: list[int] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std `(D,)` of the cached target states (the first `max_states` of `shards`, in order;
    default: the finished shards), for `ChainFlowDrafter.set_state_statistics`. `hf-chainflow train` passes its
    `--shards`, so a drafter trained on some shards takes its statistics from those alone."""
    mean, std = _statistics(data_dir, ["hidden"], max_states, shards)
    return mean[0], std[0]


def layer_statistics(data_dir, layers: Sequence[int], max_states: int = 200_000, shards: list[int] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std `(len(layers), D)` of the cached outputs of decoder `layers` (data prepared with
    `target_layers` holding them), over the states `state_statistics` reads, for
    `ChainFlowDrafter.set_layer_statistics`."""
    stored = read_manifest(data_dir).get("target_layers") or []
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers or any(
            i not in stored for i in layers):
        raise ValueError(f"`layers` must be a non-empty list of the layers `{data_dir}` stores ({stored}), got "
                         f"{layers!r}; prepare the data with `--target-layers` naming them.")
    return _statistics(data_dir, [f"layer_{i}" for i in layers], max_states, shards)


def _statistics(data_dir, names: list[str], max_states: int, shards) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std `(len(names), D)` of the shard tensors `names` (float64 sums, returned in float32)."""
    _check_positive("max_states", max_states)
    finished = read_manifest(data_dir)["finished"]
    if shards is not None:
        if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence) or not shards or any(
                not _is_int(s) for s in shards) or len(set(shards)) != len(shards):
            raise ValueError(f"`shards` must be None (all finished shards) or a non-empty list of distinct shard "
                             f"numbers, got {shards!r}.")
        missing = sorted(set(shards) - set(finished))
        if missing:
            raise ValueError(f"`shards` {missing} are not finished in `{data_dir}` (finished: {finished}).")
    total, sq, count = [None] * len(names), [None] * len(names), 0
    for shard in finished if shards is None else shards:
        with safe_open(str(shard_path(data_dir, shard)), framework="pt") as f:
            for k, name in enumerate(names):
                h = f.get_tensor(name).double()  # (T, D)
                total[k] = h.sum(0) if total[k] is None else total[k] + h.sum(0)
                sq[k] = h.pow(2).sum(0) if sq[k] is None else sq[k] + h.pow(2).sum(0)
        count += h.shape[0]
        if count >= max_states:
            break
    if not count:
        raise ValueError(f"`{data_dir}` holds no finished shard to take state statistics from; run "
                         f"`hf-chainflow prepare` first.")
    mean = [t / count for t in total]
    std = [(q / count - m.pow(2)).clamp(min=1e-6).sqrt() for q, m in zip(sq, mean)]
    return torch.stack(mean).float(), torch.stack(std).float()


# ----------------------------------------------------------------------------------------------------------------
# Training windows
# ----------------------------------------------------------------------------------------------------------------

def check_windows_fit(config, dataset) -> None:
    """Raise a `ValueError` unless the windows of `dataset` (a `ChainFlowWindowDataset`, or a `torch` `Subset` /
    `ReplayMixDataset` of them) are cut for a drafter of `config`: the same context size `C`, draft positions `K`,
    path order `p` and fused target layers, from a target of its hidden size. Datasets of other kinds are not
    checked."""
    for part in _window_datasets(dataset):
        got = {"context_size": part.C, "num_draft_positions": part.K, "path_order": part.p,
               "target_hidden_size": part.hidden_size, "target_layer_ids": part.target_layers}
        wrong = {k: v for k, v in got.items() if getattr(config, k, v) != v}  # fields the config lacks: not checked
        if wrong:
            want = {k: getattr(config, k) for k in wrong}
            raise ValueError(
                f"The windows of `{part.data_dir}` do not fit this drafter: they have {wrong}, the drafter's config "
                f"{want}. Build them with `ChainFlowWindowDataset.for_drafter(data_dir, drafter.config)`"
                + (" from data prepared with the drafter's target." if "target_hidden_size" in wrong else ".")
            )


def _window_datasets(dataset) -> list:
    if isinstance(dataset, ChainFlowWindowDataset):
        return [dataset]
    inner = [getattr(dataset, name, None) for name in ("dataset", "new", "old")]  # Subset; ReplayMixDataset
    return [part for d in inner if d is not None for part in _window_datasets(d)]


class ChainFlowWindowDataset(torch.utils.data.Dataset):
    """Training windows (see the module docstring for the exact fields) over the finished shards of `data_dir`.

    Hidden states stay on disk: each item reads its `C + K` rows through safetensors slices (memory-mapped), with
    at most `max_open_shards` shard files open per process; token ids (small) are held in memory.

    - `shards`: restrict to these shard numbers (e.g. a held-out split); `domains`: to these domain names.
    - `max_windows`: keep a random subset of this many anchors (seeded by `seed`); `shuffle`: put the anchors in a
      random (seeded) order, for readers without a shuffling sampler.
    - `target_layers`: decoder layers (stored by `prepare(target_layers=...)`) whose outputs follow the final state
      in every context state, `(C, (1 + n) D)`, for a drafter with `target_layer_ids`; `None`: the final states.
    - Data prepared with `target_labels` gives the target's own labels as `target_tokens` (the module docstring).
    """

    def __init__(self, data_dir: str | os.PathLike, *, context_len: int = 8, num_draft: int = 8,
                 num_parents: int = 8, shards: Sequence[int] | None = None, domains: Sequence[str] | None = None,
                 max_windows: int | None = None, shuffle: bool = False, seed: int = 0,
                 max_open_shards: int = 8, target_layers: Sequence[int] | None = None):
        for name, value in (("context_len", context_len), ("num_draft", num_draft), ("num_parents", num_parents),
                            ("max_open_shards", max_open_shards)):
            _check_positive(name, value)
        _check_positive("max_windows", max_windows, optional=True)
        for name, value, kind in (("shards", shards, int), ("domains", domains, str)):
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value or any(
                    not isinstance(v, kind) or isinstance(v, bool) for v in value):
                raise ValueError(f"`{name}` must be None (all) or a non-empty list of {kind.__name__}s, got "
                                 f"{value!r}; e.g. `{name}=[{'0, 1' if kind is int else repr('math')}]`.")
        self.data_dir = Path(data_dir)
        manifest = read_manifest(data_dir, require=WINDOW_KEYS)
        self.C, self.K, self.p = context_len, num_draft, num_parents
        self.hidden_size = manifest["hidden_size"]
        self.pad_token_id = manifest["pad_token_id"]
        self.domains = manifest["domains"]
        stored = manifest.get("target_layers") or []
        if target_layers is not None and (isinstance(target_layers, (str, bytes)) or not isinstance(
                target_layers, Sequence) or not target_layers or any(i not in stored for i in target_layers)):
            raise ValueError(f"`target_layers` must be None (the final states) or a non-empty list of the layers "
                             f"`{data_dir}` stores ({stored or 'none'}), got {target_layers!r}; prepare the data with "
                             f"`--target-layers` naming them (`prepare(..., target_layers=...)`).")
        self.target_layers = None if target_layers is None else list(target_layers)
        self.labelled = bool(manifest.get("target_labels"))
        finished = manifest["finished"]
        if shards is not None:
            missing = sorted(set(shards) - set(finished))
            if missing:
                raise ValueError(f"`shards` {missing} are not finished in `{data_dir}` (finished: {finished}).")
            finished = sorted(set(shards))
        if domains is not None and set(domains) - set(self.domains):
            raise ValueError(f"`domains` {sorted(set(domains) - set(self.domains))} do not occur in `{data_dir}`; "
                             f"known: {self.domains}.")
        self.max_open_shards = max_open_shards
        self._open: OrderedDict[int, Any] = OrderedDict()
        self.sequences: list[dict] = []  # record + shard + global start row + tokens
        seq_ids, anchors = [], []
        for shard in finished:
            path = shard_path(data_dir, shard)
            if not path.is_file():
                raise ValueError(f"Shard {shard} is listed as finished in `{data_dir}` but {path} is missing; rerun "
                                 f"the same `hf-chainflow prepare` command to redo it.")
            with safe_open(str(path), framework="pt") as f:
                records = json.loads(f.metadata()["sequences"])
                tokens, offsets = f.get_tensor("tokens"), f.get_tensor("offsets")
                labels = f.get_tensor("labels") if self.labelled else None
            for n, rec in enumerate(records):
                if domains is not None and rec["domain"] not in domains:
                    continue
                a, length, rs = int(offsets[n]), rec["length"], rec["response_start"]
                first, last = rs - 1, length - 3
                if last >= first:
                    anchors.append(np.arange(first, last + 1, dtype=np.int32))
                    seq_ids.append(np.full(last - first + 1, len(self.sequences), dtype=np.int32))
                self.sequences.append({**rec, "shard": shard, "start": a, "tokens": tokens[a:a + length].clone(),
                                       "domain_index": self.domains.index(rec["domain"])})
                if labels is not None:
                    self.sequences[-1]["labels"] = labels[a:a + length].clone()
        self.seq_of = np.concatenate(seq_ids) if seq_ids else np.zeros(0, np.int32)  # (W,)
        self.anchor = np.concatenate(anchors) if anchors else np.zeros(0, np.int32)  # (W,)
        rng = np.random.default_rng(seed)
        if max_windows is not None and max_windows < len(self.anchor):
            keep = np.sort(rng.choice(len(self.anchor), size=max_windows, replace=False))
            self.seq_of, self.anchor = self.seq_of[keep], self.anchor[keep]
        if shuffle:
            perm = rng.permutation(len(self.anchor))
            self.seq_of, self.anchor = self.seq_of[perm], self.anchor[perm]

    @classmethod
    def for_drafter(cls, data_dir: str | os.PathLike, config, **kwargs) -> "ChainFlowWindowDataset":
        """The windows a drafter of `config` (a `ChainFlowConfig`, or the drafter itself) trains and is evaluated
        on: its context size, draft positions, path order and fused layers (`target_layer_ids`); `kwargs` as for
        the constructor (`shards`, `max_windows`, ...). Data prepared with a target of another hidden size is
        refused."""
        config = getattr(config, "config", config)  # a drafter: its config
        dataset = cls(data_dir, context_len=config.context_size, num_draft=config.num_draft_positions,
                      num_parents=config.path_order, target_layers=getattr(config, "target_layer_ids", None),
                      **kwargs)
        check_windows_fit(config, dataset)
        return dataset

    def __len__(self) -> int:
        return len(self.anchor)

    def __getstate__(self):  # open file handles stay in their process
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state

    def _shard(self, shard: int):
        handle = self._open.pop(shard, None)
        if handle is None:
            handle = safe_open(str(shard_path(self.data_dir, shard)), framework="pt")
            if len(self._open) >= self.max_open_shards:
                self._open.popitem(last=False)
        self._open[shard] = handle
        return handle

    def _rows(self, shard: int, a: int, b: int) -> torch.Tensor:
        """Stored rows `a..b-1` of `shard`, float32: the final states `(b - a, D)`, followed along the features by
        the outputs of `target_layers` (`(b - a, (1 + n) D)`)."""
        handle = self._shard(shard)
        rows = handle.get_slice("hidden")[a:b].float()
        if not self.target_layers:
            return rows
        return torch.cat([rows, *(handle.get_slice(f"layer_{i}")[a:b].float() for i in self.target_layers)], -1)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        seq = self.sequences[int(self.seq_of[k])]
        t, length, C, K, p = int(self.anchor[k]), seq["length"], self.C, self.K, self.p
        lo, hi = max(0, t - C + 1), min(length - 1, t + K)  # stored states needed: h[lo..hi]
        rows = self._rows(seq["shard"], seq["start"] + lo, seq["start"] + hi + 1)  # (hi - lo + 1, (1 + n) D)
        D, W = self.hidden_size, rows.shape[-1]

        context = torch.zeros(C, W)  # (C, (1 + n) D)
        n_ctx = t - lo + 1
        context[C - n_ctx:] = rows[: n_ctx]
        context_mask = torch.zeros(C, dtype=torch.bool)
        context_mask[C - n_ctx:] = True

        n_tgt = max(0, min(K, length - 2 - t))  # draft position i is valid iff x[t+1+i] exists
        target_states = torch.zeros(K, D)  # (K, D)
        target_states[:n_tgt] = rows[n_ctx: n_ctx + n_tgt, :D]
        target_tokens = torch.full((K,), self.pad_token_id, dtype=torch.long)
        if self.labelled:  # the target's own choice after x[..t+1+i], where the text holds x[t+2+i]
            target_tokens[:n_tgt] = seq["labels"][t + 1: t + 1 + n_tgt]
        else:
            target_tokens[:n_tgt] = seq["tokens"][t + 2: t + 2 + n_tgt]
        target_mask = torch.zeros(K, dtype=torch.bool)
        target_mask[:n_tgt] = True

        prev = torch.full((p - 1 + K,), self.pad_token_id, dtype=torch.long)  # x[t+2-p .. t+K]
        a, b = max(0, t + 2 - p), min(length - 1, t + K)
        prev[a - (t + 2 - p): b - (t + 2 - p) + 1] = seq["tokens"][a: b + 1]
        return {"context_states": context, "context_mask": context_mask, "target_states": target_states,
                "target_tokens": target_tokens, "target_mask": target_mask, "prev_tokens": prev,
                "domain": torch.tensor(seq["domain_index"], dtype=torch.long)}


def collate(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack window dicts into a batch: `context_states (B, C, D)`, `context_mask (B, C)`, `target_states
    (B, K, D)`, `target_tokens (B, K)`, `target_mask (B, K)`, `prev_tokens (B, p-1+K)`, `domain (B,)`."""
    if not items:
        raise ValueError("`collate` got an empty list of windows.")
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}
