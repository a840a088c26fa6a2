"""The prompts (and supplied responses) that training data is made from: read from a JSONL file, a `datasets.Dataset`,
a dataset folder or a Hub dataset, checked (every loader goes through `load_prompts`, which holds the rule that
prompt ids are unique), chosen (`select_prompts`), and tokenised through the target's chat template
(`chat_prompt_ids`, `text_ids`).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from hf_chainflow.checks import check_choice, check_positive_int, is_int
from hf_chainflow.fileio import HUB_ID, _hub_reachable

if TYPE_CHECKING:  # (annotations only: reading prompts imports neither torch nor transformers)
    from transformers import PreTrainedTokenizerBase

__all__ = ["PROMPT_TEXT_FORMATS", "chat_prompt_ids", "check_unique_id", "evaluation_prompt_ids", "load_prompts",
           "load_responses", "parse_jsonl_line", "read_jsonl", "read_prompt_source", "select_prompts",
           "shipped_prompts_path", "text_ids"]


# ----------------------------------------------------------------------------------------------------------------
# JSON Lines
# ----------------------------------------------------------------------------------------------------------------

def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSONL file (blank lines skipped), each checked by `parse_jsonl_line`."""
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


# ----------------------------------------------------------------------------------------------------------------
# Prompt rows
# ----------------------------------------------------------------------------------------------------------------

def load_prompts(source: str | os.PathLike | Iterable[dict], *, prompt_column: str = "prompt",
                 limit: int | None = None) -> list[dict]:
    """Prompt rows from a JSONL file, a `datasets.Dataset` or any iterable of dicts.

    Each row needs the prompt text in `prompt_column` (or a chat `turns` list of user strings, of which the first
    is used, as in the shared responses file); `id`, `domain`, `language`, `source` are optional
    (defaults: `row-<n>`, `"unknown"`, `"unknown"`, `""`). Ids must be unique (else a `ValueError` naming both rows).
    """
    if isinstance(source, dict):
        raise ValueError("`prompts` is one dict; pass a list of prompt rows, e.g. `[{'id': 'a', 'prompt': '...'}]`.")
    check_positive_int("limit", limit, optional=True)
    rows = read_jsonl(source) if isinstance(source, (str, os.PathLike)) else source
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
        check_unique_id(seen, out[-1]["id"], n, path=source if isinstance(source, (str, os.PathLike)) else None)
    return out


def check_unique_id(seen: dict[str, int], prompt_id: str, at: int, *, path: str | os.PathLike | None = None,
                    lines: bool = False) -> None:
    """The rule of every prompt loader (`load_prompts`, `read_prompt_source`, the bench's
    `hf_chainflow.bench.prompts.load_prompts`): prompt ids are unique. Responses, shards, corpora, bench journals
    and resumes all go by id, so a second row of one id would be read back as the first.

    `seen` maps the ids so far to where they were (row numbers, or with `lines` line numbers of the file `path`) and
    gains `prompt_id` at `at`; a repeated id is a `ValueError` naming both places and the fix."""
    first = seen.get(prompt_id)
    if first is None:
        seen[prompt_id] = at
        return
    if lines:
        raise ValueError(f"{path}:{at}: prompt id {prompt_id!r} is already the id of line {first}; every row needs an "
                         "id of its own (prompts are answered, journaled, resumed and reported by id, so this row "
                         "would be read back as a copy of that one). Give it another id, or delete it if it is a "
                         "copy.")
    where = f"{path}: " if path is not None else ""
    raise ValueError(f"{where}prompt row {at}: id {prompt_id!r} occurs twice (first at row {first}); prompt ids must "
                     f"be unique: give the row another id, or delete it if it is a copy.")


def load_responses(source: str | os.PathLike | Iterable[dict]) -> dict[str, dict]:
    """Already-generated responses by id (rows with `id, prompt_ids, response_ids` and optionally `domain,
    language, source, finish`), from a JSONL file or an iterable of dicts."""
    rows = read_jsonl(source) if isinstance(source, (str, os.PathLike)) else source
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
                    not is_int(i) or i < 0 for i in ids):
                kind = "a non-empty list" if key == "prompt_ids" else "a list"
                raise ValueError(f"Response row {row['id']!r}: `{key}` must be {kind} of token ids (non-negative "
                                 f"ints), got {ids!r:.80}.")
        if str(row["id"]) in out:
            raise ValueError(f"Response id {row['id']!r} occurs twice; each response needs its own id.")
        out[str(row["id"])] = row
    return out


def read_prompt_source(source, *, prompt_column: str = "prompt", split: str = "train") -> list[dict]:
    """Prompt rows `{id, domain, language, source, prompt}` from a JSONL file, a `datasets.Dataset`, a dataset folder
    (`save_to_disk` or a folder `datasets.load_dataset` reads) or a Hub dataset id (its `split`); see
    `load_prompts` for the fields. Each row needs an `id` here (a corpus is keyed by it), unique."""
    given = str(source) if isinstance(source, (str, os.PathLike)) else f"(a {type(source).__name__})"
    if isinstance(source, (str, os.PathLike)) and Path(source).is_file():
        source = read_jsonl(source)
    elif isinstance(source, (str, os.PathLike)):
        source = _read_dataset(str(source), split)
    raw = list(source)
    if not raw:
        raise ValueError(f"`prompts` {given!r} holds no prompt rows; give a "
                         f"JSONL file with one JSON object (id, domain, prompt, ...) per line, or a dataset with rows.")
    for n, row in enumerate(raw):
        if isinstance(row, dict) and not row.get("id"):
            raise ValueError(f"Prompt row {n} has no `id`; a corpus is keyed by prompt id, so give every row one.")
    return load_prompts(raw, prompt_column=prompt_column)  # unique ids checked there


def _read_dataset(source: str, split: str):
    """The `split` of a dataset folder (`save_to_disk`, or one `load_dataset` reads) or of a Hub dataset id."""
    import datasets

    path = Path(source)
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"`prompts` folder {str(path)!r} has the splits {list(data)}, not {split!r}; "
                                 f"name one of them.")
            data = data[split]
        return data
    if path.is_dir():
        return datasets.load_dataset(source, split=split)
    if not HUB_ID.match(source) or path.exists():
        raise ValueError(f"`prompts` must be a JSONL file, a dataset folder or a Hub dataset id, got {source!r}, which "
                         f"does not exist.")
    if not _dataset_in_cache(source) and not _hub_reachable():
        raise ValueError(f"`prompts` {source!r} is neither a local file or folder (there is no such path) nor a Hub "
                         f"dataset in the local cache, and the Hub cannot be reached (offline, or HF_HUB_OFFLINE is "
                         f"set); check the path, or load the dataset once where the Hub can be reached.")
    try:
        return datasets.load_dataset(source, split=split)
    except datasets.exceptions.DatasetNotFoundError as err:
        raise ValueError(f"`prompts` {source!r} is neither a local file or folder (there is no such path) nor a Hub "
                         f"dataset the Hub knows ({err}); check the path or the dataset id.") from None


def _dataset_in_cache(repo_id: str) -> bool:
    """Whether `datasets` has the Hub dataset `repo_id` in its local caches (so it loads offline)."""
    import datasets
    from datasets.naming import camelcase_to_snakecase
    from huggingface_hub import constants

    namespace, name = repo_id.split("/")
    built = Path(datasets.config.HF_DATASETS_CACHE) / f"{namespace}___{camelcase_to_snakecase(name)}"
    downloaded = Path(constants.HF_HUB_CACHE) / f"datasets--{namespace}--{name}"
    return built.is_dir() or (downloaded / "snapshots").is_dir()


def shipped_prompts_path() -> Path:
    """The evaluation prompts shipped inside the package (`hf_chainflow/data/eval_prompts.jsonl`, a copy of the
    project's `eval.jsonl`): the bench's default prompts."""
    return Path(__file__).parents[1] / "data" / "eval_prompts.jsonl"


def evaluation_prompt_ids() -> set[str]:
    """Ids of the evaluation prompts shipped with the package (`hf_chainflow/data/eval_prompts.jsonl`): never
    answered into a corpus, so no drafter trains on what the bench measures."""
    path = shipped_prompts_path()
    return {json.loads(line)["id"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}


def select_prompts(rows: Sequence[dict], *, domains: Sequence[str] | None = None, per_domain: int | None = None,
                   seed: int = 0, exclude: Iterable[str] = ()) -> list[dict]:
    """The prompts to answer, in the order to answer them: rows of `domains` (all for None) not in `exclude`, at most
    `per_domain` of each domain (all for None), shuffled with `seed` so any prefix mixes domains. The same arguments
    give the same list."""
    exclude = set(exclude)
    wanted = set(domains) if domains is not None else None
    pool = [r for r in rows if (wanted is None or r["domain"] in wanted) and r["id"] not in exclude]
    random.Random(seed).shuffle(pool)
    if per_domain is not None:
        taken: dict[str, int] = {}
        keep = []
        for r in pool:
            if taken.get(r["domain"], 0) < per_domain:
                taken[r["domain"]] = taken.get(r["domain"], 0) + 1
                keep.append(r)
        pool = keep
    return pool


# ----------------------------------------------------------------------------------------------------------------
# Tokenising
# ----------------------------------------------------------------------------------------------------------------

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
    check_choice("prompt_text", fmt, PROMPT_TEXT_FORMATS)
    if fmt == "chat":
        full, empty = chat_prompt_ids(tokenizer, text), chat_prompt_ids(tokenizer, "")
        n = 0
        while n < min(len(full), len(empty)) - 1 and full[n] == empty[n]:
            n += 1
        n = max(n, 1)  # the last prefix position is the first anchor
        return full[:n], full[n:]
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    return ids[:1], ids[1:]

