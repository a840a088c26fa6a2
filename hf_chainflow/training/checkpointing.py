"""Complete-only checkpoints for every trainer of hf_chainflow: a checkpoint counts only once its marker
(`checkpoint_complete.json`, `hf_chainflow.fileio.mark_checkpoint_complete`) is written, after all its files; resuming
takes only such ones, and rotation (`save_total_limit`) deletes incomplete ones first.

- `CompleteCheckpointsMixin`: put it first in a `Trainer` subclass's bases (`ChainFlowTrainer`, `DFlashTrainer`).
- `resolve_resume_checkpoint(resume, output_dir)`: what `--resume last` / `resume_from_checkpoint=True` or a named
  folder resolves to; `check_resume_folder`, `missing_checkpoint_files`, `rotate_checkpoints`.

Stdlib only (no torch, no transformers), so the command line checks `--resume` before anything heavy loads.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from hf_chainflow.fileio import (CHECKPOINT_MARKER, fsync_dir, is_complete_checkpoint, last_complete_checkpoint,
                     mark_checkpoint_complete, read_json)

logger = logging.getLogger(__name__)
PREFIX_CHECKPOINT_DIR = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
_WARNED_UNMARKED: set[str] = set()


def _checkpoint_step(path: Path) -> int:
    tail = path.name[len(PREFIX_CHECKPOINT_DIR) + 1:]
    return int(tail) if path.name.startswith(PREFIX_CHECKPOINT_DIR + "-") and tail.isdigit() else -1


def missing_checkpoint_files(folder: str | Path) -> list[str]:
    """What a checkpoint folder without its marker lacks of the files a resumable Trainer checkpoint holds
    (`trainer_state.json` readable, weights, `optimizer.pt`, `scheduler.pt`); `[]`: all there."""
    folder = Path(folder)
    missing = []
    try:
        read_json(folder / "trainer_state.json", what="trainer state")
    except (OSError, ValueError):
        missing.append("a readable trainer_state.json")
    if not any(folder.rglob("*.safetensors")) and not any(folder.rglob("*model*.bin")):
        missing.append("the weights (*.safetensors)")
    missing += [name for name in ("optimizer.pt", "scheduler.pt") if not (folder / name).is_file()]
    return missing


def _names(paths) -> str:
    return ", ".join(p.name for p in paths)


def _given(flag: str, value) -> str:
    """How the user gives `flag` the value: `--resume last` on the command line, `resume_from_checkpoint='x'` in
    Python."""
    if flag.startswith("--"):
        return f"{flag} {value}"
    return f"`{flag}=True`" if value == "last" else f"`{flag}={str(value)!r}`"


def _no_complete_checkpoint(out: Path, skipped: list[Path], flags: tuple[str, str]) -> ValueError:
    resume, out_flag = flags
    whole = [p for p in skipped if not missing_checkpoint_files(p)]
    hint = (f" {whole[0]} holds every file of a checkpoint but no marker (an hf_chainflow before complete-only "
            f"checkpoints wrote it, or the run stopped just before the marker): to resume from it, name it: "
            f"{_given(resume, whole[0])}." if whole else "")
    return ValueError(f"{_given(resume, 'last')}: {out_flag} {str(out)!r} holds no complete checkpoint: "
                      f"{_names(skipped)} lack{'s' if len(skipped) == 1 else ''} {CHECKPOINT_MARKER}, which is "
                      f"written last (a run was stopped while writing {'it' if len(skipped) == 1 else 'them'}).{hint} "
                      f"Otherwise train afresh, without {_given(resume, 'last')}.")


def resolve_resume_checkpoint(resume, output_dir, *, flags: tuple[str, str] = ("resume_from_checkpoint", "output_dir")
                              ) -> str | None:
    """The checkpoint folder a run resumes from, or None: for `"last"` (or `True`, the Trainer's spelling) the newest
    complete `checkpoint-N` under `output_dir`, with a warning naming the incomplete newer ones it skips; a folder
    named is taken if complete, or if it lacks only the marker but holds every checkpoint file (a checkpoint of an
    earlier hf_chainflow; with a warning), and refused otherwise. `flags` name the options in messages."""
    if resume is None or resume is False:
        return None
    if resume is True or resume == "last":
        found, skipped = last_complete_checkpoint(output_dir)
        if found is None:
            if not skipped:
                raise ValueError(f"{_given(flags[0], 'last')}, but {flags[1]} {str(output_dir)!r} holds no "
                                 f"checkpoint-* directory.")
            raise _no_complete_checkpoint(Path(output_dir), skipped, flags)
        if skipped:
            logger.warning(f"Resuming from {found}, the newest complete checkpoint; skipped the incomplete "
                           f"{_names(skipped)} (no {CHECKPOINT_MARKER}: stopped while being written).")
        return str(found)
    return check_resume_folder(resume, flags)


def check_resume_folder(resume, flags: tuple[str, str] = ("resume_from_checkpoint", "output_dir")) -> str:
    """`resume` if it is a checkpoint to resume from (see `resolve_resume_checkpoint`), else a `ValueError` naming it,
    what it lacks and the complete checkpoint to take instead."""
    folder = Path(resume)
    if not folder.is_dir():
        raise ValueError(f"{flags[0]} must be `last` or a checkpoint directory (a checkpoint-* folder under "
                         f"{flags[1]}), got {str(resume)!r}, which is not a folder.")
    if is_complete_checkpoint(folder):
        return str(folder)
    missing = missing_checkpoint_files(folder)
    if missing:
        found, _ = last_complete_checkpoint(folder.parent)
        fix = (f"{_given(flags[0], found)} (the newest complete one there) or {_given(flags[0], 'last')}" if found
               else f"an earlier complete checkpoint, or train afresh without {flags[0]}")
        raise ValueError(f"{flags[0]} {str(folder)!r} is an incomplete checkpoint: it lacks {CHECKPOINT_MARKER} and "
                         f"{', '.join(missing)} (a run was stopped while writing it); resume from {fix}.")
    if str(folder) not in _WARNED_UNMARKED:
        _WARNED_UNMARKED.add(str(folder))
        logger.warning(f"{folder} has no {CHECKPOINT_MARKER} (written by an hf_chainflow before complete-only "
                       f"checkpoints, or stopped just before its marker) but holds every checkpoint file: resuming "
                       f"from it.")
    return str(folder)


def rotate_checkpoints(run_dir, save_total_limit: int | None, keep=()) -> list[Path]:
    """Delete checkpoints under `run_dir` beyond `save_total_limit`: incomplete ones first (by step), then the oldest
    complete ones, never those in `keep` (the one just marked, the best). So a complete checkpoint never goes while
    a half-written one stays. Returns the deleted folders."""
    if not save_total_limit or save_total_limit <= 0:
        return []
    found = sorted((p for p in Path(run_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir() and
                    _checkpoint_step(p) >= 0), key=_checkpoint_step)
    protected = {Path(k).resolve() for k in keep if k}
    order = [p for p in found if not is_complete_checkpoint(p)] + [p for p in found if is_complete_checkpoint(p)]
    remaining, deleted = len(found), []
    for path in order:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if path.resolve() in protected:
            continue
        logger.info(f"Deleting older checkpoint [{path}] due to args.save_total_limit")
        (path / CHECKPOINT_MARKER).unlink(missing_ok=True)  # a deletion cut short leaves no complete-looking folder
        shutil.rmtree(path, ignore_errors=True)
        remaining -= 1
        deleted.append(path)
    return deleted


class CompleteCheckpointsMixin:
    """Complete-only checkpoints for a `Trainer` subclass (`class MyTrainer(CompleteCheckpointsMixin, Trainer)`;
    `ChainFlowTrainer` and `DFlashTrainer` both are).

    - `_save_checkpoint` writes the Trainer's files (model, optimizer, scheduler, RNG states, `trainer_state.json`),
      waits for every process, then the main process (`args.should_save`) writes `checkpoint_complete.json`
      (`fileio.mark_checkpoint_complete`, after fsyncing the files). A folder being written again loses its marker
      first. Rotation (`save_total_limit`) runs after the marker (`rotate_checkpoints`): the Trainer's own rotation,
      which runs before any marker could be written and sorts by time, would delete the last complete checkpoint
      while the new one is still half-written.
    - `train(resume_from_checkpoint=...)` resolves `True` / `"last"` to the newest complete checkpoint and refuses
      an incomplete folder (`resolve_resume_checkpoint`).
    """

    def _save_checkpoint(self, model, trial) -> None:
        folder = Path(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and (folder / CHECKPOINT_MARKER).is_file():  # rewritten: not complete meanwhile
            (folder / CHECKPOINT_MARKER).unlink()
            fsync_dir(folder)
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # rotated below, once marked
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # every process's files (its RNG state) are written
        if self.args.should_save:
            mark_checkpoint_complete(folder, global_step=self.state.global_step)
            rotate_checkpoints(folder.parent, limit, keep=(folder, self.state.best_model_checkpoint))

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        resume = resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        return super().train(resume_from_checkpoint=resume, trial=trial, **kwargs)


__all__ = ["CompleteCheckpointsMixin", "check_resume_folder", "missing_checkpoint_files", "resolve_resume_checkpoint",
           "rotate_checkpoints"]
