"""The bench's prompts: the shipped evaluation prompts (or a JSONL file), a selection stratified by domain, and
their tokenisation through the chat template."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_chainflow.checks import check_positive_int


def default_prompts_path() -> Path:
    """The evaluation prompts shipped inside the package (a copy of the project's `eval.jsonl`)."""
    from hf_chainflow.training.prompts import shipped_prompts_path

    return shipped_prompts_path()


def load_prompts(path: str | os.PathLike | None = None) -> list[dict]:
    """Rows `{id, domain, language, prompt}` of a JSONL file (default: the shipped evaluation prompts).

    A row that does not parse, lacks `id`, `domain` or `prompt`, or repeats an earlier row's `id` is refused with a
    `ValueError` naming the file and line: the bench journals, resumes and reports each prompt by its id, so two rows
    of one id would be read back as one (the rule of every prompt loader,
    `hf_chainflow.training.prompts.check_unique_id`). An empty file is refused too."""
    from hf_chainflow.training.prompts import parse_jsonl_line

    path = Path(path) if path is not None else default_prompts_path()
    if not path.is_file():
        raise ValueError(f"`--prompts` must be a JSONL file, got {str(path)!r}, which does not exist.")
    rows, seen = [], {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                rows.append(_checked_row(parse_jsonl_line(line, path, n), path, n, seen))
    if not rows:
        raise ValueError(f"`--prompts` file {str(path)!r} holds no prompt rows (it is empty or blank); give a JSONL "
                         "file with one object `{\"id\", \"domain\", \"prompt\"}` per line.")
    return rows


def _checked_row(row: dict, path: Path, n: int, seen: dict[str, int]) -> dict:
    """`row` (line `n` of `path`) if it has a usable, unused `id`, a `domain` and a `prompt`; `seen` maps each id so
    far to its line and gains this one."""
    missing = [k for k in ("id", "domain", "prompt") if k not in row]
    if missing:
        raise ValueError(f"{path}:{n}: every prompt row needs `id`, `domain` and `prompt`; missing {missing}.")
    pid = row["id"]
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or not str(pid).strip():
        raise ValueError(f"{path}:{n}: `id` must be a non-empty string or an integer, got {pid!r}; give the row an "
                         "id of its own (the bench journals and reports each prompt by it).")
    from hf_chainflow.training.prompts import check_unique_id

    check_unique_id(seen, str(pid), n, path=path, lines=True)
    for key in ("domain", "prompt"):
        if not isinstance(row[key], str):
            raise ValueError(f"{path}:{n}: `{key}` must be a string, got {row[key]!r}.")
    return row


def stratified_selection(rows: list[dict], limit: int | None) -> list[dict]:
    """Up to `limit` rows taken round-robin over the domains (sorted; file order within a domain), so every domain
    appears once `limit >= number of domains`; all rows when `limit` is None."""
    if limit is None:
        return list(rows)
    check_positive_int("--limit", limit)
    by_domain: dict[str, list[dict]] = {}
    for row in rows:
        by_domain.setdefault(row["domain"], []).append(row)
    queues = [list(reversed(by_domain[d])) for d in sorted(by_domain)]
    picked: list[dict] = []
    while len(picked) < limit and any(queues):
        for q in queues:
            if q and len(picked) < limit:
                picked.append(q.pop())
    return picked


def choose_prompts(path: str | os.PathLike | None, limit: int | None) -> tuple[list[dict], dict]:
    """The rows a run times (`stratified_selection` of the prompts file, `None`: the shipped evaluation prompts) and
    a warm-up row outside them (the first row of the file not chosen; the first chosen one when every row is)."""
    all_rows = load_prompts(path)
    rows = stratified_selection(all_rows, limit)
    chosen = {r["id"] for r in rows}
    return rows, next((r for r in all_rows if r["id"] not in chosen), rows[0])


@dataclass
class BenchPrompt:
    """One tokenised prompt: `input_ids` `(1, L)`."""

    id: str
    domain: str
    input_ids: torch.LongTensor


def tokenize_prompts(tokenizer, rows: list[dict]) -> list[BenchPrompt]:
    """Rows -> `BenchPrompt`s through the tokenizer's chat template (`add_generation_prompt=True`)."""
    out = []
    for row in rows:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        out.append(BenchPrompt(str(row["id"]), str(row["domain"]), enc["input_ids"]))
    return out


__all__ = ["BenchPrompt", "choose_prompts", "default_prompts_path", "load_prompts", "stratified_selection",
           "tokenize_prompts"]
