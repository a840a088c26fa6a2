"""The response corpus: the target's own responses, kept as a folder that `datasets` loads directly.

Generating the target's responses is the dearest thing the project makes (about one hour per 3,000 responses on a
2-core CPU), so they are kept, shareable and reloadable; the hidden-state cache that training reads is rebuilt from
them at any time (`hf_chainflow.training.prepare.prepare(..., responses=corpus.responses("train"))`).
Answering prompts into a corpus: `hf_chainflow.training.responses.generate_into_corpus`; reading and choosing the
prompts: `hf_chainflow.training.prompts` (`read_prompt_source`, `select_prompts`).

Folder layout
-------------
- `README.md`: the dataset card (YAML header with `configs`, so `datasets.load_dataset(folder)` finds the splits).
- `corpus.json`: what the corpus belongs to (`target`, the tokenizer's `vocab_size` and `tokenizer_sha256`, a hash
  of its vocabulary and chat template; responses of another tokenizer are refused) and every prompt `selections`
  made for it (source, domains, per-domain quota, seed), so a selection can be rerun.
- `data/{split}-{UTC time}-p{rank}-{n}.parquet`: the shards (zstd, a few MB at most). A shard is written once, atomically
  (temporary file + rename), and never rewritten: the corpus grows by adding shards.
- `.pending/p{rank}.jsonl`: responses generated since the last shard (appended and fsynced after every batch; not
  committed). A run that is killed loses at most the batch in flight; the next run reads the pending rows back, so no
  prompt is answered twice.
- `.writer.lock` (and `.writer-p{rank}.lock` for the other ranks of a `torchrun` job): one writing job at a time
  (`writer_lock`); a second job is refused with the holder named. Every file is written to a temporary name and
  renamed (`hf_chainflow.fileio`), and a writing job starts by removing the temporary files of dead processes, so a
  kill or a full disk leaves the corpus as it was before the write; a corpus whose creation was cut short (an empty
  `data/`, temporary files, lock files, no `corpus.json`) is created again by the same command.

Rows (one per response; columns `COLUMNS`): `id, domain, language, source, prompt_ids, response_ids, finish` as in
the shared responses files, plus how the response was made: `do_sample`, `temperature` (0.0 for greedy; sampled
responses are kept apart by these columns), `max_new_tokens`, `dtype`, `machine`, `software`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

from hf_chainflow.checks import check_positive_int, is_int
from hf_chainflow.fileio import (LOCK_GLOB, FolderBusyError, FolderLock, _job_id, atomic_write_bytes, read_json,
                                 remove_stale_temps)
from hf_chainflow.fileio import check_writable as _check_writable

FORMAT = "hf_chainflow.corpus/1"  # the corpus format tag (on disk: unchanged by the module's moves)
INFO = "corpus.json"
PENDING = ".pending"
SPLITS = ("train", "heldout")
ID_FIELDS = ("id", "domain", "language", "source", "prompt_ids", "response_ids", "finish")
SETTING_FIELDS = ("do_sample", "temperature", "max_new_tokens", "dtype", "machine", "software")
COLUMNS = ID_FIELDS + SETTING_FIELDS
FINISHES = ("eos", "length")

__all__ = ["ResponseCorpus", "GenerationSettings", "tokenizer_fingerprint", "process_rank", "writer_lock",
           "check_writable", "check_new_corpus_folder", "check_response_row", "FolderBusyError", "COLUMNS", "SPLITS"]


# ----------------------------------------------------------------------------------------------------------------
# Facts recorded with every row (the machine's description: `hf_chainflow.machine.describe_machine`)
# ----------------------------------------------------------------------------------------------------------------

def tokenizer_fingerprint(tokenizer) -> dict:
    """`{vocab_size, tokenizer_sha256}`: the vocabulary size and a hash of the vocabulary and the chat template.

    Two tokenizers with the same fingerprint give the same ids for the same chat, so their responses can share a
    corpus."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode())
    digest.update(b"\0" + str(getattr(tokenizer, "chat_template", None) or "").encode())
    return {"vocab_size": len(tokenizer), "tokenizer_sha256": digest.hexdigest()}


@dataclass(frozen=True)
class GenerationSettings:
    """How a response was made; stored in every row (the `SETTING_FIELDS` columns)."""

    dtype: str
    machine: str
    software: str
    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 0.0

    def __post_init__(self):
        if self.do_sample != (self.temperature > 0):
            raise ValueError(f"`temperature` {self.temperature!r} with `do_sample={self.do_sample}`: greedy responses "
                             f"have temperature 0.0 and sampled ones a temperature > 0.")

    @classmethod
    def here(cls, dtype: str, device: str = "cpu", **kwargs) -> "GenerationSettings":
        import torch
        import transformers

        from hf_chainflow.machine import describe_machine

        return cls(dtype=dtype, machine=describe_machine(device),
                   software=f"transformers {transformers.__version__}, torch {torch.__version__}", **kwargs)



# ----------------------------------------------------------------------------------------------------------------
# Checking rows
# ----------------------------------------------------------------------------------------------------------------

def check_response_row(row: dict, where: str, vocab_size: int) -> None:
    """A `ValueError` naming `where` (the row) and the field, unless `row` is a valid response row."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a response row is a dict with {list(ID_FIELDS)}, got a {type(row).__name__}.")
    missing = [k for k in ID_FIELDS if k not in row]
    if missing:
        raise ValueError(f"{where} (id {row.get('id')!r}) lacks {missing}; every response row needs {list(ID_FIELDS)}.")
    for key in ("id", "domain", "language", "source"):
        if not isinstance(row[key], str) or (key == "id" and not row[key]):
            raise ValueError(f"{where}: `{key}` must be a {'non-empty ' if key == 'id' else ''}string, got "
                             f"{row[key]!r:.60}.")
    for key in ("prompt_ids", "response_ids"):
        ids = row[key]
        if not isinstance(ids, (list, tuple)) or not ids or any(not is_int(i) for i in ids):
            raise ValueError(f"{where} (id {row['id']!r}): `{key}` must be a non-empty list of token ids, got "
                             f"{ids!r:.80}.")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"{where} (id {row['id']!r}): `{key}` holds ids {bad[:5]} outside the tokenizer's "
                             f"vocabulary of {vocab_size}; the row belongs to another tokenizer.")
    if row["finish"] not in FINISHES:
        raise ValueError(f"{where} (id {row['id']!r}): `finish` must be one of {list(FINISHES)}, got "
                         f"{row['finish']!r}.")


# ----------------------------------------------------------------------------------------------------------------
# The corpus folder
# ----------------------------------------------------------------------------------------------------------------

INFO_KEYS = ("format", "target", "vocab_size", "tokenizer_sha256", "selections")
INFO_FIX = ("Restore it from version control or a backup (it holds the format, the target, the tokenizer's fingerprint "
            "and the prompt selections; the shards in data/ are not touched by it).")
_HELD: dict[str, int] = {}  # corpus folders whose writer lock this process holds -> nesting depth


@contextlib.contextmanager
def writer_lock(path: str | os.PathLike, *, rank: int | None = None):
    """`with writer_lock(folder):` this job is the corpus's only writer while the block runs.

    Each process holds `fileio.FolderLock` on the folder (the ranks of one `torchrun` job side by side; another job,
    of any size, is refused with a `FolderBusyError` naming the holder until the last rank of the first has ended).
    Taking the lock removes the temporary files of dead processes (a kill, a full disk). Nested uses in one process
    share the lock (`generate_into_corpus` inside the command's lock). `rank`: this process's rank in its launch
    (default: `RANK`)."""
    key = os.path.realpath(path)
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    rank = process_rank()[0] if rank is None else rank
    if rank != 0 and _job_id().startswith("pid:"):
        raise ValueError(f"RANK={rank}, but nothing tells which job this process belongs to (torchrun's "
                         f"TORCHELASTIC_RUN_ID, or MASTER_ADDR and MASTER_PORT with WORLD_SIZE > 1), so it cannot "
                         f"share its job's writer lock on {str(path)!r}; launch the processes with `torchrun "
                         f"--nproc_per_node N`, or give them all the same TORCHELASTIC_RUN_ID.")
    with FolderLock(path, what="response corpus", rank=rank):
        _HELD[key] = 1
        try:
            remove_stale_temps(path, recursive=True)
            yield
        finally:
            del _HELD[key]


def check_writable(path: str | os.PathLike) -> None:
    """A `ValueError` naming the folder unless the corpus folder, its `data/` and `.pending/` (for a new corpus: the
    folder it will be made in) take a new file (`fileio.check_writable`): a read-only corpus is refused before a
    model loads, not after a batch."""
    _check_writable("corpus", path, subfolders=("data", PENDING))


def _not_half_made(path: Path) -> list[str]:
    """The entries of a folder without `corpus.json` that a creation cut short (a kill, a full disk) does not leave:
    it leaves an empty `data/`, lock files, temporary files and nothing else."""
    def leftover(entry: Path) -> bool:
        if entry.name == INFO or entry.match(LOCK_GLOB) or (entry.name.startswith(".") and ".tmp-" in entry.name):
            return True
        if entry.is_dir() and entry.name in ("data", PENDING):
            return all(leftover(e) for e in entry.iterdir())
        return False

    return sorted(e.name for e in path.iterdir() if not leftover(e)) if path.is_dir() else []


def check_new_corpus_folder(path: str | os.PathLike) -> None:
    """A `ValueError` unless `path` is a corpus, a new or empty folder, or a corpus whose creation was cut short."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"`corpus` {str(path)!r} is a file; give a folder.")
    if (path / INFO).is_file():
        return
    foreign = _not_half_made(path)
    if foreign:
        raise ValueError(f"`corpus` {str(path)!r} is a folder without {INFO} that holds other things "
                         f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}), so it is not a response "
                         f"corpus; give a new or empty folder, or an existing corpus.")


def _read_info(path: Path) -> dict:
    """`corpus.json` of the corpus folder `path`, or a `ValueError` naming the file, the line and the fix."""
    info = read_json(path / INFO, what="corpus description", fix=INFO_FIX)
    if info.get("format") != FORMAT:
        raise ValueError(f"{path / INFO}: format {info.get('format')!r}, expected {FORMAT!r}; it is not the "
                         f"description of a response corpus of this version. {INFO_FIX}")
    missing = [k for k in INFO_KEYS if k not in info]
    if missing:
        raise ValueError(f"{path / INFO}: lacks {missing}; a corpus description holds {list(INFO_KEYS)}. {INFO_FIX}")
    return info


class ResponseCorpus:
    """A corpus folder (see the module docstring). `ResponseCorpus.create(...)` makes a new one; `ResponseCorpus(path)`
    opens an existing one."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not (self.path / INFO).is_file():
            raise ValueError(f"`corpus` {str(self.path)!r} holds no {INFO}; it is not a response corpus. Make one with "
                             f"`ResponseCorpus.create(path, target=..., tokenizer=...)` (or `hf-chainflow "
                             f"generate-responses --corpus {self.path} --target ...`).")
        self.info = _read_info(self.path)

    @classmethod
    def create(cls, path: str | os.PathLike, *, target: str, tokenizer) -> "ResponseCorpus":
        """A new, empty corpus for `target`'s responses through `tokenizer`; an existing corpus is opened instead, and
        refused if it was made for another tokenizer."""
        path = Path(path)
        check_new_corpus_folder(path)
        check_writable(path)
        with writer_lock(path):
            check_new_corpus_folder(path)
            if not (path / INFO).is_file():  # new, or a creation cut short: the same command makes it again
                (path / "data").mkdir(parents=True, exist_ok=True)
                info = {"format": FORMAT, "target": target, **tokenizer_fingerprint(tokenizer), "selections": []}
                atomic_write_bytes(path / INFO, (json.dumps(info, indent=1) + "\n").encode())
        corpus = cls(path)
        corpus.check_tokenizer(tokenizer)
        return corpus

    def writing(self):
        """`with corpus.writing():` this job is the corpus's only writer (`writer_lock`). The lock goes by the
        process's rank in its launch (`RANK`), not by the `rank` that names a shard or a pending file."""
        return writer_lock(self.path)

    # -- what it holds ----------------------------------------------------------------------------------------

    def check_tokenizer(self, tokenizer) -> None:
        mine = tokenizer_fingerprint(tokenizer)
        theirs = {k: self.info.get(k) for k in mine}
        if mine != theirs:
            raise ValueError(f"The corpus {str(self.path)!r} was made for another tokenizer ({theirs['vocab_size']} "
                             f"tokens, sha256 {str(theirs['tokenizer_sha256'])[:12]}) than the given one "
                             f"({mine['vocab_size']} tokens, sha256 {mine['tokenizer_sha256'][:12]}); use that "
                             f"target's tokenizer, or a new corpus folder.")

    @property
    def vocab_size(self) -> int:
        return int(self.info["vocab_size"])

    def shards(self, split: str | None = None) -> list[Path]:
        """The shard files of `split` (all splits for None), in the order they were written."""
        if split is not None:
            _check_split(split)
        pattern = f"{split}-*.parquet" if split else "*.parquet"
        return sorted((self.path / "data").glob(pattern), key=lambda p: p.name.split("-", 1)[1])  # by time

    def table(self, split: str | None = None, columns: Sequence[str] | None = None):
        """The rows of `split` (None: every split) as one `pyarrow.Table`, shard by shard."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        parts = [pq.read_table(p, columns=list(columns) if columns else None) for p in self.shards(split)]
        if not parts:
            return pa.table({c: [] for c in (columns or ("id",))})
        return pa.concat_tables(parts)

    def ids(self, split: str | None = None) -> set[str]:
        return set(self.table(split, ["id"]).column("id").to_pylist())

    def responses(self, split: str = "train", *, domains: Iterable[str] | None = None,
                  greedy_only: bool = True) -> dict[str, dict]:
        """`{id: row}` of one split, for `hf_chainflow.training.prepare.prepare(..., responses=...)`. Only the split named is read:
        training reads `"train"`, and the held-out rows only when `"heldout"` is asked for by name."""
        _check_split(split)
        keep = set(domains) if domains is not None else None
        out = {}
        for row in self.table(split).to_pylist():
            if (keep is None or row["domain"] in keep) and (not greedy_only or not row["do_sample"]):
                out[row["id"]] = row
        return out

    def dataset(self):
        """Every split as a `datasets.DatasetDict` (what `datasets.load_dataset(folder)` returns; see the card)."""
        import datasets

        files = {s: [str(p) for p in self.shards(s)] for s in SPLITS if self.shards(s)}
        return datasets.load_dataset("parquet", data_files=files)

    # -- adding rows --------------------------------------------------------------------------------------------

    def _check_new_rows(self, rows: Sequence[dict]) -> None:
        """Every row valid, with its generation settings, and its id neither in the corpus nor twice in `rows`."""
        have, seen = self.ids(), set()
        for n, row in enumerate(rows):
            check_response_row(row, f"row {n}", self.vocab_size)
            missing = [k for k in SETTING_FIELDS if k not in row]
            if missing:
                raise ValueError(f"row {n} (id {row['id']!r}) lacks the generation settings {missing}; pass "
                                 f"`settings` for rows that do not carry them.")
            if row["id"] in have or row["id"] in seen:
                raise ValueError(f"row {n}: id {row['id']!r} is "
                                 f"{'already in the corpus' if row['id'] in have else 'in these rows twice'}; each "
                                 f"prompt is answered once.")
            seen.add(row["id"])

    def _write_shard(self, rows: Sequence[dict], split: str, rank: int) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist([{k: r[k] for k in COLUMNS} for r in rows], schema=_schema())
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        prefix = f"{split}-{stamp}-p{rank}-"
        path = self.path / "data" / f"{prefix}{len(list((self.path / 'data').glob(prefix + '*'))):04d}.parquet"
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd", compression_level=9)
        atomic_write_bytes(path, sink.getvalue().to_pybytes())
        return path

    def add_responses(self, rows: Sequence[dict], split: str, settings: GenerationSettings | None = None, *,
                      shard_size: int = 512, rank: int = 0) -> list[Path]:
        """Add response rows to `split`, in new shards of at most `shard_size` rows. `settings` fills the
        generation-setting columns of rows that lack them. Every row is checked (fields, vocabulary, ids unique and
        not yet in the corpus) before the first shard is written; nothing is written if any fails."""
        _check_split(split)
        check_positive_int("shard_size", shard_size)
        if not rows:
            raise ValueError("`rows` is empty; give at least one response row.")
        fixed = asdict(settings) if settings is not None else {}
        full = [{**fixed, **row} if isinstance(row, dict) else row for row in rows]
        with self.writing():
            self._check_new_rows(full)
            return [self._write_shard(full[i:i + shard_size], split, rank) for i in range(0, len(full), shard_size)]

    def record_selection(self, selection: dict) -> None:
        """Append a prompt selection to `corpus.json` (unless the last one recorded is the same)."""
        with self.writing():
            self.info = _read_info(self.path)  # as it is now: another job may have added one since it was read
            if self.info["selections"] and self.info["selections"][-1] == selection:
                return
            self.info["selections"].append(selection)
            atomic_write_bytes(self.path / INFO, (json.dumps(self.info, indent=1) + "\n").encode())

    # -- pending rows -----------------------------------------------------------------------------------------

    def pending_path(self, rank: int = 0) -> Path:
        return self.path / PENDING / f"p{rank}.jsonl"

    def pending(self, rank: int | None = None) -> list[dict]:
        """Rows generated since the last shard (of `rank`, or every rank for None), minus those already in a shard
        (a run killed between writing a shard and emptying its pending file). A torn last line is dropped."""
        files = [self.pending_path(rank)] if rank is not None else sorted((self.path / PENDING).glob("p*.jsonl"))
        have, rows, seen = self.ids(), [], set()
        for path in files:
            if not path.is_file():
                continue
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the line a kill cut short
                if row["id"] not in have and row["id"] not in seen:
                    seen.add(row["id"])
                    rows.append(row)
        return rows

    def append_pending(self, rows: Sequence[dict], rank: int = 0) -> None:
        with self.writing():
            self._append_pending(rows, rank)

    def _append_pending(self, rows: Sequence[dict], rank: int) -> None:
        path = self.pending_path(rank)
        path.parent.mkdir(exist_ok=True)
        torn = False
        if path.is_file() and path.stat().st_size > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        with open(path, "a", encoding="utf-8") as f:  # after a torn last line (a kill mid-write), a new line first
            f.write(("\n" if torn else "") + "".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())

    def flush_pending(self, split: str = "train", *, rank: int = 0, min_rows: int = 1) -> Path | None:
        """Write `rank`'s pending rows as one shard of `split` if there are at least `min_rows`, then empty the pending
        file. Returns the shard's path (None when nothing was written)."""
        with self.writing():
            rows = self.pending(rank)
            if len(rows) < max(min_rows, 1):
                return None
            (path,) = self.add_responses(rows, split, shard_size=len(rows), rank=rank)
            atomic_write_bytes(self.pending_path(rank), b"")
            return path

    # -- the card ---------------------------------------------------------------------------------------------

    def write_card(self) -> Path:
        """Write the dataset card's YAML header (splits, target, tokenizer, generation settings, counts) and its
        counts tables afresh from the shards; the hand-written text between them is kept."""
        with self.writing():
            return self._write_card()

    def _write_card(self) -> Path:
        counts = self.counts()
        path = self.path / CARD
        body = (f"\n# Responses of {self.info['target']}\n\nThe target's own responses, for training speculative "
                f"drafters with hf_chainflow (`hf_chainflow.training.corpus`).\n\n")
        if path.is_file():
            text = re.sub(r"\A---\n(.*?\n)?---\n", "", path.read_text(encoding="utf-8"), flags=re.S)
            body = text.split(COUNTS_MARK)[0]
        atomic_write_bytes(path, (_card_header(self, counts) + body + _counts_section(counts)).encode())
        return path

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | None = None,
                    commit_message: str | None = None):
        """Upload the corpus folder (card, `corpus.json`, shards; not the pending rows) to the Hub as a dataset repo,
        so that `datasets.load_dataset(repo_id)` returns its splits. The card is written afresh first."""
        from huggingface_hub import HfApi

        self.write_card()
        api = HfApi(token=token)
        api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
        return api.upload_folder(repo_id=repo_id, repo_type="dataset", folder_path=str(self.path),
                                 ignore_patterns=[f"{PENDING}/*", ".*.tmp-*", LOCK_GLOB],
                                 commit_message=commit_message or f"{self.counts()['train']['rows']} train responses")

    # -- counts -----------------------------------------------------------------------------------------------

    def counts(self) -> dict:
        """Rows and response tokens per split, domain and language; EOS/length finishes."""
        out = {}
        for split in SPLITS:
            t = self.table(split, ["domain", "language", "response_ids", "finish", "do_sample"])
            rows = t.to_pylist()
            out[split] = {"rows": len(rows), "response_tokens": sum(len(r["response_ids"]) for r in rows),
                          "eos": sum(r["finish"] == "eos" for r in rows),
                          "sampled": sum(bool(r["do_sample"]) for r in rows),
                          "domains": _count(r["domain"] for r in rows),
                          "languages": _count(r["language"] for r in rows)}
        return out


CARD = "README.md"
COUNTS_MARK = "<!-- Everything below is written by `ResponseCorpus.write_card()` from the shards. -->"


def _card_header(corpus: "ResponseCorpus", counts: dict) -> str:
    import yaml

    languages = sorted({lang.split("-")[0] for c in counts.values() for lang in c["languages"]} |
                       {lang.split("-")[-1] for c in counts.values() for lang in c["languages"]})
    settings = corpus.table(None, ["dtype", "do_sample", "temperature", "max_new_tokens", "machine"]).to_pylist()
    header = {
        "configs": [{"config_name": "default", "data_files": [
            {"split": s, "path": f"data/{s}-*.parquet"} for s in SPLITS if counts[s]["rows"]]}],
        "license": "other",
        "language": [lang for lang in languages if lang != "unknown"],
        "task_categories": ["text-generation"],
        "tags": ["speculative-decoding", "hf-chainflow", "self-distillation"],
        "hf_chainflow": {
            "format": FORMAT, "target": corpus.info["target"], "vocab_size": corpus.vocab_size,
            "tokenizer_sha256": corpus.info["tokenizer_sha256"],
            "decoding": sorted({"sampled" if r["do_sample"] else "greedy" for r in settings}),
            "max_new_tokens": sorted({r["max_new_tokens"] for r in settings}),
            "dtypes": sorted({r["dtype"] for r in settings}),
            "machines": sorted({r["machine"] for r in settings}),
            "rows": {s: counts[s]["rows"] for s in SPLITS}},
    }
    return "---\n" + yaml.safe_dump(header, sort_keys=False, allow_unicode=True, width=120) + "---\n"


def _counts_section(counts: dict) -> str:
    lines = [COUNTS_MARK, "", "## Counts", "", "| split | rows | response tokens | ended with EOS | sampled |",
             "|---|---|---|---|---|"]
    for s in SPLITS:
        c = counts[s]
        lines.append(f"| {s} | {c['rows']:,} | {c['response_tokens']:,} | {c['eos']:,} | {c['sampled']:,} |")
    domains = sorted({d for c in counts.values() for d in c["domains"]})
    lines += ["", "| domain | " + " | ".join(SPLITS) + " |", "|---|" + "---|" * len(SPLITS)]
    lines += [f"| {d} | " + " | ".join(f"{counts[s]['domains'].get(d, 0):,}" for s in SPLITS) + " |" for d in domains]
    languages = sorted({lang for c in counts.values() for lang in c["languages"]})
    lines += ["", "| language | " + " | ".join(SPLITS) + " |", "|---|" + "---|" * len(SPLITS)]
    lines += [f"| {lang} | " + " | ".join(f"{counts[s]['languages'].get(lang, 0):,}" for s in SPLITS) + " |"
              for lang in languages]
    return "\n".join(lines) + "\n"


def _schema():
    import pyarrow as pa

    ids = pa.list_(pa.int32())
    return pa.schema([("id", pa.string()), ("domain", pa.string()), ("language", pa.string()), ("source", pa.string()),
                      ("prompt_ids", ids), ("response_ids", ids), ("finish", pa.string()), ("do_sample", pa.bool_()),
                      ("temperature", pa.float32()), ("max_new_tokens", pa.int32()), ("dtype", pa.string()),
                      ("machine", pa.string()), ("software", pa.string())])


def _count(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


def _check_split(split) -> None:
    if split not in SPLITS:
        raise ValueError(f"`split` must be one of {list(SPLITS)}, got {split!r}.")


def process_rank() -> tuple[int, int]:
    """`(rank, world_size)` of this process under `torchrun` / `accelerate launch` (`RANK`, `WORLD_SIZE`), else
    `(0, 1)`."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world}: the rank must lie in [0, WORLD_SIZE).")
    return rank, world

