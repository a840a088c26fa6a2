"""`prepare(...)`: the target's greedy responses (or text it did not write, labelled with its own next-token choices)
and its cached hidden states, written as a directory of shards (the format: `hf_chainflow.training.prepared_data`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_chainflow import fileio
from hf_chainflow.checks import check_choice, check_positive_int, is_int
from hf_chainflow.training.hidden_states import target_argmax, target_hidden_states
from hf_chainflow.training.prepared_data import (FORMAT, INDEX, LATER_SETTINGS, MANIFEST, PLAN, PROMPT_TAIL, SHORTLIST,
                                                 compute_shortlist, read_manifest, shard_path, shard_records)
from hf_chainflow.training.prompts import PROMPT_TEXT_FORMATS, chat_prompt_ids, load_prompts, load_responses, text_ids
from hf_chainflow.training.responses import generate_responses, target_eos_ids, target_pad_id

__all__ = ["prepare"]


def _atomic_write_text(path: Path, text: str) -> None:
    fileio.atomic_write_text(path, text)  # temp file, fsync, rename, folder fsync; the temp file goes on any error


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
        for n, rec in enumerate(shard_records(shard_path(out_dir, shard))):
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
    # (ids are unique: the keys of `responses`, or checked by `load_prompts`)
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
        check_positive_int(name, value)
    out_dir = Path(out_dir)
    for name, value in (("limit", limit), ("max_shards", max_shards)):
        check_positive_int(name, value, optional=True)
    if shuffle_seed is not None and not is_int(shuffle_seed):
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
        check_choice("prompt_text", prompt_text, PROMPT_TEXT_FORMATS)
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
        if (not layers or any(not is_int(i) or not 0 <= i < num_layers - 1 for i in layers)
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
    eos = target_eos_ids(model, tokenizer)
    pad = target_pad_id(model, tokenizer, eos)
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

