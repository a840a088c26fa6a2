"""Prepared drafter training data: the directory `prepare(...)` (`hf_chainflow.training.prepare`) writes, the target's
own greedy responses (or text it did not write, labelled with its own next-token choices) with its cached hidden
states, and its readers: the checked manifest, the sequences, the shortlist and the state statistics.
`ChainFlowWindowDataset` (`hf_chainflow.training.windows`) reads training windows from it.

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

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors import safe_open

from hf_chainflow import fileio
from hf_chainflow.checks import check_positive_int, is_int

FORMAT = "hf_chainflow.data/1"  # the shards' format tag (on disk: unchanged by the module's moves)
LATER_SETTINGS = {"target_labels": False, "prompt_text": None, "hidden_dtype": "float32"}  # manifest settings, as absent ones read
MANIFEST, PLAN, INDEX, SHORTLIST = "manifest.json", "plan.json", "index.jsonl", "shortlist.json"
PROMPT_TAIL = 16

__all__ = ["FORMAT", "MANIFEST", "PLAN", "INDEX", "SHORTLIST", "PROMPT_TAIL", "TRAINING_KEYS", "WINDOW_KEYS",
           "check_prepared_data", "compute_shortlist", "iter_sequences", "layer_statistics", "read_manifest",
           "read_shortlist", "shard_path", "shard_records", "state_statistics"]


def shard_path(out_dir: str | os.PathLike, shard: int) -> Path:
    """The file of shard number `shard` of the prepared data directory `out_dir`."""
    return Path(out_dir) / "shards" / f"shard-{shard:05d}.safetensors"


def _list_of(kind):
    """A rule: a list whose items are all of `kind` (not bools)."""
    return lambda v: isinstance(v, list) and all(isinstance(x, kind) and not isinstance(x, bool) for x in v)


# The manifest keys that code reads, each with the rule its value must meet (`read_manifest`).
_MANIFEST_RULES = {
    "finished": ("a list of shard numbers (integers >= 0)", lambda v: _list_of(int)(v) and all(x >= 0 for x in v)),
    "num_shards": ("an integer >= 0", lambda v: is_int(v) and v >= 0),
    "num_sequences": ("an integer >= 0", lambda v: is_int(v) and v >= 0),
    "shard_size": ("an integer >= 1", lambda v: is_int(v) and v >= 1),
    "hidden_size": ("an integer >= 1", lambda v: is_int(v) and v >= 1),
    "vocab_size": ("an integer >= 1", lambda v: is_int(v) and v >= 1),
    "pad_token_id": ("an integer", is_int),
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


def shard_records(path: Path) -> list[dict]:
    """The per-sequence records of one shard file (its `sequences` metadata)."""
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
            records = shard_records(path)
        except Exception as err:  # safetensors raises its own error type for a damaged header
            raise ValueError(f"{path}: the shard file is damaged ({type(err).__name__}: {err}); {fix}.") from None
        if not isinstance(records, list):
            raise ValueError(f"{path}: the shard's `sequences` metadata is not a list; {fix}.")
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
    check_positive_int("max_states", max_states)
    finished = read_manifest(data_dir)["finished"]
    if shards is not None:
        if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence) or not shards or any(
                not is_int(s) for s in shards) or len(set(shards)) != len(shards):
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

