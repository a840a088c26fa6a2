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
(an unparsable last line is dropped, with a warning, and the file truncated before it).
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

from ..stats import SpeculativeStats
from .arms import Run
from .defaults import JOURNAL_NAME

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


class BenchJournal:
    """Appends a bench run's finished prompts to `path` and reads them back on resume.

    Args:
        path: the journal file (`runs.jsonl` in the bench's output directory).
        header: what identifies the run (`journal_header`); JSON types only.
        resume: continue the journal at `path`; its header must equal `header`. Without it a new journal replaces
            any file at `path` when the run starts its prompts (`start_part`, after every check has passed).
        accepted: other values the journal's header may hold for a setting, keyed by its path in the header, e.g.
            `{("settings", "drafter_config_sha256", "chainflow"): earlier_config_digests(drafter)}`: the same
            thing recorded under an earlier rule.
    """

    def __init__(self, path: str | os.PathLike, header: dict, resume: bool = False,
                 accepted: dict[tuple[str, ...], list] | None = None):
        self.path = Path(path)
        self.header = json.loads(json.dumps({"type": "header", **header}))  # JSON-normalised, for comparison
        self.done: dict[str, dict] = {}
        self.parts = 0
        self.part_machines: dict[int, dict] = {}  # part -> its machine (`machine_info`), as journaled
        self._started = False
        if not resume:
            return
        if not self.path.is_file():
            raise ValueError(f"`--resume` found no journal at {str(self.path)!r}: run the bench once without "
                             "`--resume` (with the same `--output-dir`) to start one.")
        raw = self.path.read_bytes().splitlines(keepends=True)
        lines, keep = [], 0  # the parsed lines, and the bytes they span
        for number, line in enumerate(raw, 1):
            try:
                if line.strip():
                    lines.append(json.loads(line))
            except ValueError as err:
                if any(rest.strip() for rest in raw[number:]):
                    raise ValueError(f"{str(self.path)!r} line {number} is not valid JSON ({err}); only the last "
                                     "line can be cut short by a killed run. Repair or delete that line, or start "
                                     "anew without `--resume`.") from None
                break
            keep += len(line)
        if not lines or lines[0].get("type") != "header":
            raise ValueError(f"{str(self.path)!r} is not a bench journal (its first line is not a header); "
                             "choose another `--output-dir` or start anew without `--resume`.")
        expected = self.header
        if "drafter_config_sha256" not in lines[0].get("settings", {}):
            # A journal from before drafter configs were recorded (the committed 320-prompt run among them): its
            # drafters are still checked by their weights; their configs cannot be, which is said, not hidden.
            expected = json.loads(json.dumps(self.header))
            expected["settings"].pop("drafter_config_sha256", None)
            logger.warning(f"{str(self.path)!r} predates `drafter_config_sha256`: the drafters are checked by their "
                           "weights only; make sure their config.json and generation_config.json are unchanged.")
        changed = _differences(lines[0], expected)
        for keys, values in (accepted or {}).items():
            held = lines[0]
            for key in keys:
                held = held.get(key) if isinstance(held, dict) else None
            if ".".join(keys) in changed and held in values:
                changed.remove(".".join(keys))
                logger.info(f"{str(self.path)!r}: {'.'.join(keys)} recorded under an earlier rule; accepted.")
        if changed:
            raise ValueError(f"`--resume`: this run's settings differ from the journal at {str(self.path)!r} in "
                             f"{changed}. A resumed run must repeat the same command; start anew without "
                             "`--resume` or choose another `--output-dir`.")
        if keep < sum(map(len, raw)):  # a last line cut short: drop it, so that the next append starts a line
            logger.warning(f"{str(self.path)!r}: dropping its last line, cut short by an interrupted write (a prompt "
                           "it held runs again).")
            with open(self.path, "r+b") as f:
                f.truncate(keep)
        elif not raw[-1].endswith(b"\n"):  # complete but for its newline
            with open(self.path, "ab") as f:
                f.write(b"\n")
        for line in lines[1:]:
            if line["type"] == "part":
                self.parts = max(self.parts, int(line["part"]) + 1)
                self.part_machines[int(line["part"])] = line.get("machine", {})
            elif line["type"] == "prompt":
                self.done[line["id"]] = line
        self._started = True

    def _write(self, obj: dict, mode: str = "a") -> None:
        with open(self.path, mode) as f:
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
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write(self.header, mode="w")
            self._started = True
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


__all__ = ["BenchJournal", "JOURNAL_NAME", "PATH_SETTINGS", "config_digest", "earlier_config_digests",
           "journal_header", "run_from_dict", "run_to_dict", "weights_digest"]
