"""The response corpus: the target's own responses, kept as a folder that `datasets` loads directly.

Generating the target's responses is the dearest thing the project makes (about one hour per 3,000 responses on a
2-core CPU), so they are kept, shareable and reloadable; the hidden-state cache that training reads is rebuilt from
them at any time (`hf_chainflow.training.data.prepare(..., responses=corpus.responses("train"))`).

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
import platform
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

from hf_chainflow.fileio import (HUB_ID, LOCK_GLOB, FolderBusyError, FolderLock, _hub_reachable, _job_id, atomic_write_bytes,
                                 read_json, remove_stale_temps)
from hf_chainflow.fileio import check_writable as _check_writable

FORMAT = "hf_chainflow.training.corpus/1"
INFO = "corpus.json"
PENDING = ".pending"
SPLITS = ("train", "heldout")
ID_FIELDS = ("id", "domain", "language", "source", "prompt_ids", "response_ids", "finish")
SETTING_FIELDS = ("do_sample", "temperature", "max_new_tokens", "dtype", "machine", "software")
COLUMNS = ID_FIELDS + SETTING_FIELDS
FINISHES = ("eos", "length")

__all__ = ["ResponseCorpus", "GenerationSettings", "tokenizer_fingerprint", "select_prompts", "describe_machine",
           "generate_into_corpus", "writer_lock", "check_writable", "FolderBusyError", "COLUMNS", "SPLITS"]


# ----------------------------------------------------------------------------------------------------------------
# Facts recorded with every row
# ----------------------------------------------------------------------------------------------------------------

def tokenizer_fingerprint(tokenizer) -> dict:
    """`{vocab_size, tokenizer_sha256}`: the vocabulary size and a hash of the vocabulary and the chat template.

    Two tokenizers with the same fingerprint give the same ids for the same chat, so their responses can share a
    corpus."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode())
    digest.update(b"\0" + str(getattr(tokenizer, "chat_template", None) or "").encode())
    return {"vocab_size": len(tokenizer), "tokenizer_sha256": digest.hexdigest()}


def describe_machine(device: str = "cpu") -> str:
    """One line naming the processor the responses were made on (its bfloat16 kernels decide near-ties)."""
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (cuda)"
    from hf_chainflow.bench import bf16_matrix_instructions, cpu_identity

    try:
        with open("/proc/cpuinfo") as f:
            cpu = cpu_identity(f.read())
    except OSError:
        cpu = {"name": platform.processor(), "family": None, "model": None}
    bf16 = [name for name, has in bf16_matrix_instructions().items() if has]
    return (f"{cpu['name'] or platform.machine()} (family {cpu['family']}, model {cpu['model']}; "
            f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}; bf16 matrix instructions: "
            f"{', '.join(bf16) or 'none'}; {os.cpu_count()} cores)")


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

        return cls(dtype=dtype, machine=describe_machine(device),
                   software=f"transformers {transformers.__version__}, torch {torch.__version__}", **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Checking rows
# ----------------------------------------------------------------------------------------------------------------

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
        if not isinstance(ids, (list, tuple)) or not ids or any(not _is_int(i) for i in ids):
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
        """`{id: row}` of one split, for `hf_chainflow.training.data.prepare(..., responses=...)`. Only the split named is read:
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
        if not _is_int(shard_size) or shard_size < 1:
            raise ValueError(f"`shard_size` must be a positive int, got {shard_size!r}.")
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


# ----------------------------------------------------------------------------------------------------------------
# Choosing prompts
# ----------------------------------------------------------------------------------------------------------------

def read_prompt_source(source, *, prompt_column: str = "prompt", split: str = "train") -> list[dict]:
    """Prompt rows `{id, domain, language, source, prompt}` from a JSONL file, a `datasets.Dataset`, a dataset folder
    (`save_to_disk` or a folder `datasets.load_dataset` reads) or a Hub dataset id (its `split`); see
    `hf_chainflow.training.data.load_prompts` for the fields. Each row needs an `id` here (a corpus is keyed by it), unique."""
    from hf_chainflow.training.data import _read_jsonl, load_prompts

    given = str(source) if isinstance(source, (str, os.PathLike)) else f"(a {type(source).__name__})"
    if isinstance(source, (str, os.PathLike)) and Path(source).is_file():
        source = _read_jsonl(source)
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


def evaluation_prompt_ids() -> set[str]:
    """Ids of the evaluation prompts shipped with the package (`hf_chainflow/data/eval_prompts.jsonl`): never
    answered into a corpus, so no drafter trains on what the bench measures."""
    path = Path(__file__).parent / "data" / "eval_prompts.jsonl"
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
# Generating into the corpus
# ----------------------------------------------------------------------------------------------------------------

def process_rank() -> tuple[int, int]:
    """`(rank, world_size)` of this process under `torchrun` / `accelerate launch` (`RANK`, `WORLD_SIZE`), else
    `(0, 1)`."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world}: the rank must lie in [0, WORLD_SIZE).")
    return rank, world


def generate_into_corpus(model, tokenizer, prompts: Sequence[dict], corpus: ResponseCorpus,
                         settings: GenerationSettings, *, batch_size: int = 32, shard_size: int = 512,
                         chunk_size: int = 1024, rank: int = 0, world_size: int = 1, max_prompts: int | None = None,
                         progress: bool = True) -> dict:
    """Answer `prompts` (rows with `id, domain, language, source` and `prompt` text or `prompt_ids`, in the order to
    answer them) with `model` and add the responses to `corpus`'s train split. Prompt text goes through the
    tokenizer's chat template (`hf_chainflow.training.data.chat_prompt_ids`).

    Prompts already in the corpus or pending are skipped; process `rank` of `world_size` answers every
    `world_size`-th of the rest. Inside a chunk of `chunk_size` prompts, batches of `batch_size` prompts of similar
    length are generated (left padding) and appended to the pending file after each batch; a shard is written
    whenever `shard_size` rows are pending, and the last pending rows when every prompt is answered. `max_prompts`
    stops after that many new responses (their rows stay pending unless they complete a shard). Returns counts.

    The whole run holds the corpus's writer lock (`writer_lock`): another job writing to the corpus is refused with a
    `FolderBusyError` naming it; the processes of one `torchrun` job share it. A corpus folder that is not writable is
    refused before the first batch.
    """
    check_writable(corpus.path)
    with corpus.writing():
        return _generate_locked(model, tokenizer, prompts, corpus, settings, batch_size=batch_size,
                                shard_size=shard_size, chunk_size=chunk_size, rank=rank, world_size=world_size,
                                max_prompts=max_prompts, progress=progress)


def _generate_locked(model, tokenizer, prompts, corpus, settings, *, batch_size, shard_size, chunk_size, rank,
                     world_size, max_prompts, progress) -> dict:
    from tqdm.auto import tqdm

    from hf_chainflow.training.data import _eos_ids, _pad_id, chat_prompt_ids, generate_responses

    corpus.check_tokenizer(tokenizer)
    for n, r in enumerate(prompts):
        bad = [i for i in r.get("prompt_ids", ()) if not _is_int(i) or not 0 <= i < corpus.vocab_size]
        if bad:
            raise ValueError(f"Prompt row {n} (id {r.get('id')!r}): `prompt_ids` holds {bad[:5]}, not ids of the "
                             f"tokenizer's vocabulary of {corpus.vocab_size}.")
    answered = corpus.ids() | {r["id"] for r in corpus.pending()}
    mine = [r for i, r in enumerate(prompts) if i % world_size == rank]
    todo = [r for r in mine if r["id"] not in answered][:max_prompts]
    eos = _eos_ids(model, tokenizer)
    pad = _pad_id(model, tokenizer, eos)
    fixed = {k: v for k, v in asdict(settings).items()}
    written, generated, tokens = [], 0, 0
    start = time.perf_counter()
    shard = corpus.flush_pending(rank=rank, min_rows=shard_size)  # a killed run's full shard
    if shard is not None:
        written.append(shard)
    bar = tqdm(total=len(mine), initial=len(mine) - len(todo), desc=f"responses (process {rank})", unit="resp",
               disable=not progress, dynamic_ncols=True)
    for c in range(0, len(todo), chunk_size):
        chunk = [r if "prompt_ids" in r else {**r, "prompt_ids": chat_prompt_ids(tokenizer, r["prompt"])}
                 for r in todo[c:c + chunk_size]]
        order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]["prompt_ids"]))
        for b in range(0, len(order), batch_size):
            batch = [chunk[i] for i in order[b:b + batch_size]]
            outs = generate_responses(model, [r["prompt_ids"] for r in batch], eos_token_ids=eos, pad_token_id=pad,
                                      batch_size=batch_size, max_new_tokens=settings.max_new_tokens)
            rows = [{"id": r["id"], "domain": r["domain"], "language": r["language"], "source": r.get("source", ""),
                     "prompt_ids": list(r["prompt_ids"]), "response_ids": resp, "finish": finish, **fixed}
                    for r, (resp, finish) in zip(batch, outs)]
            corpus.append_pending(rows, rank)
            generated += len(rows)
            tokens += sum(len(r["response_ids"]) for r in rows)
            bar.update(len(rows))
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tok/s")
            shard = corpus.flush_pending(rank=rank, min_rows=shard_size)
            if shard is not None:
                written.append(shard)
                corpus.write_card()
                bar.write(f"shard {shard.name}: {shard.stat().st_size / 1e6:.2f} MB")
    if len(todo) == len([r for r in mine if r["id"] not in answered]):  # every prompt of this process answered
        shard = corpus.flush_pending(rank=rank)
        if shard is not None:
            written.append(shard)
            corpus.write_card()
    bar.close()
    return {"generated": generated, "response_tokens": tokens, "seconds": time.perf_counter() - start,
            "shards": [str(p) for p in written], "pending": len(corpus.pending(rank))}
