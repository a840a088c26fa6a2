"""The journal of a bench run: one JSON line per finished prompt, so that a long run can stop and resume.

The bench's defaults (every evaluation prompt, two dtypes) take hours on a CPU. `run_bench(journal=...)` appends
each prompt's results to `runs.jsonl` in the output directory as soon as every arm has run on it; `--resume` reads
them back, skips those prompts and runs the rest. Arms stay interleaved prompt by prompt, so every ratio still
compares arms that ran side by side; only the machine state between parts may differ, and each part's machine is
recorded.

Lines (`"type"` tells them apart):

    {"type": "header", "settings": {...}, "prompt_ids": [...], "prompt_tokens_sha256": ...}   what must not change
    {"type": "part", "part": k, "machine": {...}, "started": t}     each invocation that ran prompts
    {"type": "prompt", "part": k, "id": ..., "wall": s, "record": {...}, "runs": {ARM: run}, "details": {ARM: d}}

A prompt interrupted half-way leaves no line and runs again on resume; so does one whose line a kill cut short
(an unparsable last line is dropped, with a warning, and the file truncated before it). Any other bad line is
refused with its line number. A new run does not replace a journal holding finished prompts unless told to
(`overwrite`); its header replaces the old file atomically (`hf_chainflow.fileio.atomic_write_text`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from hf_chainflow.fileio import atomic_write_text
from hf_chainflow.generation.stats import SpeculativeStats
from hf_chainflow.bench.arms import Run
from hf_chainflow.bench.defaults import JOURNAL_NAME

logger = logging.getLogger(__name__)


def run_to_dict(run: Run) -> dict:
    """A `Run` as plain JSON types."""
    return {"tokens": list(run.tokens), "seconds": run.seconds,
            "stats": asdict(run.stats) if run.stats is not None else None, "forwards": run.forwards}


def run_from_dict(d: dict) -> Run:
    """The inverse of `run_to_dict`."""
    stats = SpeculativeStats(**d["stats"]) if d["stats"] is not None else None
    return Run(list(d["tokens"]), float(d["seconds"]), stats, d["forwards"])


def weights_digest(model) -> str:
    """SHA-256 of a model's state dict (names, dtypes, shapes, bytes), so a resumed run cannot mix weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


_DIGEST_SKIP = ("_name_or_path", "transformers_version", "_from_model_config")  # paths and library versions

# Fields added after journals began to record config digests, each with a default that drafts as before. The rule
# before 2026-12-07 counted every field a config held, so the digest of a journal written then lacks them
# (`earlier_config_digests`); today's rule leaves out every field at its default, so this list does not grow.
_FIELDS_ADDED_AFTER_EARLIER_DIGESTS = {
    "config": ("continuation_table_size", "continuation_min_ngram", "continuation_max_ngram"),
    "generation_config": ("corpus_lookup_num_tokens",)}


def _digest(dicts: dict) -> str:
    return hashlib.sha256(json.dumps(dicts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def _class_defaults(config) -> dict:
    """A config's class defaults (a field the class does not define, such as a drafting field of a generation
    config, reads as `None` through `.get`)."""
    return _jsonable(type(config)().to_dict())


def config_digest(model) -> str:
    """Short SHA-256 of a model's `config` and `generation_config`, so a resumed run cannot mix drafters with the same
    weights that draft differently (`candidate_budget`, `serving_head_dtype`, `num_flow_steps`...).

    Each counts by its fields whose value differs from its class's default (`None` for a field the class does not
    define, such as a drafting field of a generation config; paths and library version aside): a release of
    transformers or of this package that adds a field with a default does not change it, and a changed default does
    wherever a config relies on it.
    """
    dicts = {}
    for name in ("config", "generation_config"):
        config = getattr(model, name, None)
        if config is not None:
            values, defaults = _jsonable(config.to_dict()), _class_defaults(config)
            dicts[name] = {k: v for k, v in values.items() if k not in _DIGEST_SKIP and defaults.get(k) != v}
    return _digest(dicts)


def earlier_config_digests(model) -> list[str]:
    """The digests `config_digest` gave before 2026-12-07, when it counted every field of the config class
    (`to_diff_dict`): with today's fields, and without the fields added since at their defaults. A journal written
    then holds one of them; `run_bench` accepts it on resume (`BenchJournal(accepted=...)`)."""
    dicts = {name: {k: v for k, v in getattr(model, name).to_diff_dict().items() if k not in _DIGEST_SKIP}
             for name in ("config", "generation_config") if getattr(model, name, None) is not None}
    before = {}
    for name, fields in dicts.items():  # the added fields left out where they hold their defaults
        defaults = _class_defaults(getattr(model, name))
        before[name] = {k: v for k, v in fields.items()
                        if k not in _FIELDS_ADDED_AFTER_EARLIER_DIGESTS[name] or defaults.get(k) != v}
    return list(dict.fromkeys([_digest(dicts), _digest(before)]))


# Settings that are paths: they may differ between parts (another checkout, another cache directory), so the journal
# checks what they point to instead, the drafters by `drafter_weights_sha256` and `drafter_config_sha256` and the
# prompts by their token ids.
PATH_SETTINGS = ("drafters", "prompts")


def journal_header(settings: dict, prompts) -> dict:
    """What a resumed run must repeat: the settings (paths aside), the prompt ids and a digest of their token ids."""
    h = hashlib.sha256()
    for prompt in prompts:
        h.update(f"{prompt.id}\0{prompt.input_ids.reshape(-1).tolist()}\n".encode())
    kept = {k: v for k, v in settings.items() if k not in PATH_SETTINGS}
    if isinstance(kept.get("drafting"), dict):  # the warm-up's compile seconds are a measurement of each part
        kept["drafting"] = {name: {k: v for k, v in d.items() if k != "compile_seconds"}
                            for name, d in kept["drafting"].items()}
    return {"settings": kept,
            "prompt_ids": [prompt.id for prompt in prompts], "prompt_tokens_sha256": h.hexdigest()}


def _differences(old, new, prefix: str = "") -> list[str]:
    """Dotted names of the fields where two JSON values differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += _differences(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    return [] if old == new else [prefix or "(value)"]


# The fields of `machine_info` that make two parts' machines one kind of CPU: a prompt's arms always ran side by
# side, but the pooled figures (time per token summed over prompts) of parts on different kinds mix machines.
CPU_KIND_FIELDS = ("cpu_vendor", "cpu_family", "cpu_model", "cpu_count", "cpu_capability", "bf16_matrix_instructions")


def cpu_kind_differences(earlier: dict, machine: dict) -> list[str]:
    """The `CPU_KIND_FIELDS` both machines record with different values (a field one of them lacks, as in a
    journal written before the field existed, makes no difference)."""
    return [k for k in CPU_KIND_FIELDS if k in earlier and k in machine and earlier[k] != machine[k]]


# The keys each kind of journal line needs (a header is checked against this run's own, field by field).
_LINE_KEYS = {"header": (), "part": ("part",), "prompt": ("part", "id", "wall", "record", "runs", "details")}


def _bad_line(path: Path, number: int, what: str) -> ValueError:
    return ValueError(f"{str(path)!r} line {number} {what}; only the last line can be cut short by a killed run. "
                      "Repair or delete that line (then rerun with `--resume`), or start over with `--overwrite` "
                      "(the journal's finished prompts are then discarded), or choose another `--output-dir`.")


def _check_line(path: Path, number: int, obj, first: bool) -> None:
    """A parsed journal line: the header first, then part and prompt lines with their keys; else refused."""
    kind = obj.get("type") if isinstance(obj, dict) else None
    if first and kind != "header":
        raise ValueError(f"{str(path)!r} is not a bench journal (its line {number} is not a header line); choose "
                         "another `--output-dir`, or start over there with `--overwrite`.")
    if kind not in ("part", "prompt") and not first:
        raise _bad_line(path, number, "is not a journal line (a JSON object of type part or prompt)")
    missing = [k for k in _LINE_KEYS[kind] if k not in obj]
    if missing:
        raise _bad_line(path, number, f"(a {kind} line) lacks {missing}")


def read_journal(path: str | os.PathLike) -> tuple[list[dict], int]:
    """The lines of the journal at `path` (header first) and the bytes they span. An unparsable last line (a kill
    mid-append) is left out of both; any other bad line, a first line that is not a header and a prompt journaled
    twice are refused with a `ValueError` naming the file and the line. An empty file (or one whose only line was cut
    short) gives `[]`."""
    path = Path(path)
    raw = path.read_bytes().splitlines(keepends=True)
    lines, keep, seen = [], 0, {}  # seen: prompt id -> its line
    for number, line in enumerate(raw, 1):
        if line.strip():
            try:
                obj = json.loads(line)
            except ValueError as err:
                if any(rest.strip() for rest in raw[number:]):
                    raise _bad_line(path, number, f"is not valid JSON ({err})") from None
                break
            _check_line(path, number, obj, first=not lines)
            if obj["type"] == "prompt":
                if obj["id"] in seen:
                    raise _bad_line(path, number, f"journals prompt {obj['id']!r} again (first on line "
                                                  f"{seen[obj['id']]})")
                seen[obj["id"]] = number
            lines.append(obj)
        keep += len(line)
    return lines, keep


def finished_prompts(lines: list[dict]) -> dict[str, dict]:
    """The prompt lines of a journal (`read_journal`), by id."""
    return {line["id"]: line for line in lines if line["type"] == "prompt"}


def check_journal(path: str | os.PathLike, *, resume: bool, overwrite: bool = False) -> int:
    """What a run may do with the journal at `path`, checked before anything loads; returns how many finished
    prompts it holds (`-1`: unreadable, with `overwrite`).

    - `resume`: the journal must exist and be readable (its header is compared later, once the run's is known).
    - neither: a journal holding finished prompts is refused (a new journal would discard them), naming the folder,
      the count and the two ways on; one with none (a run stopped before its first prompt finished) is replaced.
    - `overwrite`: any journal is replaced when the run starts its prompts.
    """
    path = Path(path)
    if resume and overwrite:
        raise ValueError("`--resume` and `--overwrite` contradict each other: `--resume` continues the journal in "
                         "`--output-dir`, `--overwrite` discards it and starts a fresh one; give one of them.")
    if not path.is_file():
        if resume:
            raise ValueError(f"`--resume` found no journal at {str(path)!r}: run the bench once without `--resume` "
                             "(with the same `--output-dir`) to start one.")
        return 0
    if overwrite:
        try:
            return len(finished_prompts(read_journal(path)[0]))
        except ValueError:
            return -1
    lines, _ = read_journal(path)
    done = finished_prompts(lines)
    if done and not resume:
        total = len(lines[0].get("prompt_ids") or [])
        them = "them" if len(done) > 1 else "it"
        raise ValueError(f"`--output-dir` {str(path.parent)!r} already holds a bench journal ({path.name}) with "
                         f"{_finished(len(done))}" + (f" of {total}" if total else "") + f"; a new run would discard "
                         f"{them}. Add `--resume` to continue that run (repeat its command), or `--overwrite` to "
                         f"discard {them} and start a fresh journal, or choose another `--output-dir`.")
    return len(done)


def _finished(n: int) -> str:
    return f"{n} finished prompt{'s' if n != 1 else ''}"


class BenchJournal:
    """Appends a bench run's finished prompts to `path` and reads them back on resume.

    Args:
        path: the journal file (`runs.jsonl` in the bench's output directory).
        header: what identifies the run (`journal_header`); JSON types only.
        resume: continue the journal at `path`; its header must equal `header`. Without it a journal at `path` that
            holds finished prompts is refused unless `overwrite` (`check_journal`); the new journal replaces the
            file atomically when the run starts its prompts (`start_part`, after every check has passed).
        overwrite: start a fresh journal even where `path` holds finished prompts (they are discarded, with a
            warning, when the run starts its prompts).
        accepted: other values the journal's header may hold for a setting, keyed by its path in the header, e.g.
            `{("settings", "drafter_config_sha256", "chainflow"): earlier_config_digests(drafter)}`: the same
            thing recorded under an earlier rule.
    """

    def __init__(self, path: str | os.PathLike, header: dict, resume: bool = False,
                 accepted: dict[tuple[str, ...], list] | None = None, overwrite: bool = False):
        self.path = Path(path)
        self.header = json.loads(json.dumps({"type": "header", **header}))  # JSON-normalised, for comparison
        self.done: dict[str, dict] = {}
        self.parts = 0
        self.part_machines: dict[int, dict] = {}  # part -> its machine (`machine_info`), as journaled
        self._started = False
        self._replaces = check_journal(self.path, resume=resume, overwrite=overwrite)
        if resume:
            self._resume(accepted or {})

    def _resume(self, accepted: dict[tuple[str, ...], list]) -> None:
        """Read the journal back: its header must equal this run's; a last line cut short is dropped."""
        lines, keep = read_journal(self.path)
        if not lines:
            raise ValueError(f"{str(self.path)!r} holds no journal header (the file is empty, or its only line was "
                             "cut short): no prompt of it finished. Start anew without `--resume`.")
        self._check_header(lines[0], accepted)
        with open(self.path, "r+b") as f:
            if keep < os.fstat(f.fileno()).st_size:  # a last line cut short: drop it, so the next append starts a line
                logger.warning(f"{str(self.path)!r}: dropping its last line, cut short by an interrupted write (a "
                               "prompt it held runs again).")
                f.truncate(keep)
            else:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # complete but for its newline
                    f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
        self.done = finished_prompts(lines)
        for line in lines[1:]:
            if line["type"] == "part":
                self.parts = max(self.parts, int(line["part"]) + 1)
                self.part_machines[int(line["part"])] = line.get("machine", {})
        self._started = True

    def _check_header(self, held: dict, accepted: dict[tuple[str, ...], list]) -> None:
        """Refuse a journal whose header differs from this run's (`accepted`: earlier rules' values), naming the
        fields; the journal is left as it was."""
        expected = self.header
        if "drafter_config_sha256" not in held.get("settings", {}):
            # A journal from before drafter configs were recorded (the committed 320-prompt run among them): its
            # drafters are still checked by their weights; their configs cannot be, which is said, not hidden.
            expected = json.loads(json.dumps(self.header))
            expected["settings"].pop("drafter_config_sha256", None)
            logger.warning(f"{str(self.path)!r} predates `drafter_config_sha256`: the drafters are checked by their "
                           "weights only; make sure their config.json and generation_config.json are unchanged.")
        changed = _differences(held, expected)
        for keys, values in accepted.items():
            value = held
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            if ".".join(keys) in changed and value in values:
                changed.remove(".".join(keys))
                logger.info(f"{str(self.path)!r}: {'.'.join(keys)} recorded under an earlier rule; accepted.")
        if changed:
            raise ValueError(f"`--resume`: this run's settings differ from the journal at {str(self.path)!r} in "
                             f"{changed}. A resumed run must repeat the same command; start over with `--overwrite` "
                             "instead of `--resume` (its finished prompts are discarded), or choose another "
                             "`--output-dir`.")

    def _start_fresh(self) -> None:
        """Replace any file at `path` by this run's header, atomically (a kill leaves the old journal or the new)."""
        if self._replaces:
            held = f"its {_finished(self._replaces)}" if self._replaces > 0 else "its unreadable lines"
            logger.warning(f"`--overwrite`: starting a fresh journal at {str(self.path)!r}, discarding {held}.")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.header) + "\n")
        self._started = True

    def _write(self, obj: dict) -> None:
        """Append one line, flushed to disk (a kill mid-append cuts only this line short)."""
        with open(self.path, "a") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def start_part(self, machine: dict) -> int:
        """Record that this invocation runs prompts; returns its part number. Warns where `machine` is another kind
        of CPU than an earlier part's (`CPU_KIND_FIELDS`): the run goes on, and `mixed_cpu_kinds` says so."""
        for earlier, held in sorted(self.part_machines.items()):
            differ = cpu_kind_differences(held, machine)
            if differ:
                logger.warning(f"{str(self.path)!r}: this part runs on another kind of CPU than part {earlier} ("
                               + ", ".join(f"{k} {machine[k]!r} against {held[k]!r}" for k in differ)
                               + "). Each prompt still compares its arms side by side, but the pooled figures will "
                               "mix machines; resume on part " + str(earlier) + "'s kind of CPU to keep one.")
                break
        if not self._started:
            self._start_fresh()
        part = self.parts
        self._write({"type": "part", "part": part, "machine": machine, "started": time.time()})
        self.part_machines[part] = machine
        self.parts += 1
        return part

    def mixed_cpu_kinds(self) -> list[dict]:
        """Each part's kind of CPU (`{"part", **CPU_KIND_FIELDS}`) where two parts ran on different kinds (the rule
        `start_part` warns by), else `[]`."""
        parts = sorted(self.part_machines.items())
        if not any(cpu_kind_differences(a, b) for i, (_, a) in enumerate(parts) for _, b in parts[i + 1:]):
            return []
        return [{"part": k, **{f: m.get(f) for f in CPU_KIND_FIELDS}} for k, m in parts]

    def add(self, part: int, prompt_id: str, wall: float, record: dict, runs: dict, details: dict) -> None:
        """Append one finished prompt: `runs` maps an arm key to its `Run`, `details` to its mismatch (or None)."""
        line = {"type": "prompt", "part": part, "id": prompt_id, "wall": wall, "record": record,
                "runs": {k: run_to_dict(r) for k, r in runs.items()}, "details": details}
        self._write(line)
        self.done[prompt_id] = json.loads(json.dumps(line))


__all__ = ["BenchJournal", "JOURNAL_NAME", "PATH_SETTINGS", "check_journal", "config_digest", "earlier_config_digests",
           "finished_prompts", "journal_header", "read_journal", "run_from_dict", "run_to_dict", "weights_digest"]
