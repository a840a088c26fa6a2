"""Safe file handling shared by every command: atomic writes, JSON read with the file and line named, one writer
per folder, complete-only checkpoints, and the local-folder-or-Hub-id rule.

- `atomic_write_bytes` / `atomic_write_text` / `atomic_path`: a file is written to a temporary name in its own folder
  (`.NAME.tmp-PID`), fsynced, renamed over `NAME`, and the folder fsynced; on any error the temporary file is
  removed, so a failure (a full disk, a kill between two writes) leaves the old file or none, never half of one.
- `read_json`: a JSON file, or a `ValueError` naming the file, the line and column and what is wrong.
- `FolderLock`: one writing job per folder (an OS file lock, `fcntl.flock`, released when the process ends, even by a
  kill); a second job is refused with the holder named. The ranks of one `torchrun` job share their job's lock.
- `mark_checkpoint_complete` / `is_complete_checkpoint` / `last_complete_checkpoint`: a checkpoint counts only when
  its marker, written last, is there.
- `check_local_or_hub`: a path that is neither a folder nor a Hub repo in the local cache fails within seconds when
  the Hub cannot be reached, naming both readings; `check_model_folder`: a folder given as a model holds a config
  and weights, and its JSON files parse.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

TEMP_GLOB = ".*.tmp-*"
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


# ----------------------------------------------------------------------------------------------------------------
# Atomic writes
# ----------------------------------------------------------------------------------------------------------------

def temp_path(path: str | os.PathLike) -> Path:
    """The temporary name `path` is written under before its rename: `.NAME.tmp-PID` in the same folder."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename or a new file in `folder` durable (POSIX: the folder's own entry list is fsynced)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a platform whose folders cannot be opened (Windows): the rename is what it offers
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, mode: int | None = 0o644) -> Iterator[Path]:
    """`with atomic_path(path) as tmp: writer(tmp)`: the writer fills `tmp`; on success it is fsynced, given `mode`
    (writers such as safetensors create files private), renamed to `path` and the folder fsynced; on any error or
    interrupt `tmp` is removed and `path` is left as it was."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        yield tmp
        if mode is not None:
            tmp.chmod(mode)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (see `atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically (see `atomic_path`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_writable(flag: str, path: str | os.PathLike, *, subfolders: tuple[str, ...] = ()) -> None:
    """An output folder must take a new file: a probe file is created and removed in it and in each existing
    `subfolders` entry (or, when it does not exist yet, in the nearest existing folder above it, where it will be
    made); permissions alone say nothing to root or on a read-only mount. Raises a `ValueError` naming `flag`, the
    folder and the OS's reason, so that a command refuses before its model loads, not after its first write."""
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"`{flag}` must name a folder, got {str(path)!r}, which is an existing file; choose another "
                         f"path.")
    folders = [path / sub for sub in ("", *subfolders) if (path / sub).is_dir()]
    if not folders:
        nearest = path
        while not nearest.exists():
            nearest = nearest.parent
        if not nearest.is_dir():
            raise ValueError(f"`{flag}` {str(path)!r} cannot be made: {str(nearest)!r} is a file, not a folder; "
                             f"choose another path.")
        folders = [nearest]
    for folder in folders:
        probe = temp_path(folder / ".write-probe")  # `.NAME.tmp-PID`: a rerun's `remove_stale_temps` clears a leftover
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as err:
            where = ("" if folder == path else f" (its folder {str(folder)!r})" if path.exists() else
                     f" (it does not exist yet; its parent {str(folder)!r} is where it would be made)")
            raise ValueError(f"`{flag}` {str(path)!r} cannot be written{where}: creating a file there failed "
                             f"({err.strerror or err}); choose a folder you can write to, or fix its permissions or "
                             f"free its disk.") from None
        with contextlib.suppress(OSError):
            os.unlink(probe)


def remove_stale_temps(folder: str | os.PathLike, *, recursive: bool = False) -> list[Path]:
    """Remove the temporary files (`.NAME.tmp-PID`) under `folder` whose process is gone (left by a kill or a full
    disk); returns them. Temporary files of live processes are kept."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = folder.rglob(TEMP_GLOB) if recursive else folder.glob(TEMP_GLOB)
    removed = []
    for tmp in sorted(found):
        m = _TEMP.match(tmp.name)
        if m and tmp.is_file() and not _pid_alive(int(m["pid"])):
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed.append(tmp)
    return removed


# ----------------------------------------------------------------------------------------------------------------
# JSON
# ----------------------------------------------------------------------------------------------------------------

_JSON_KIND = {dict: "a JSON object", list: "a JSON list", str: "a string", int: "an integer", float: "a number",
              bool: "true or false", type(None): "null"}


def read_json(path: str | os.PathLike, *, what: str = "JSON file", expect: type | tuple | None = dict,
              fix: str | None = None) -> Any:
    """The JSON value in `path`, or a `ValueError` naming the file, the line and column, what is wrong, and `fix`.

    `what` names the file's role ("corpus card", "manifest"); `expect` the type the top level must have (None: any).
    """
    path = Path(path)
    hint = f" {fix}" if fix else ""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: the {what} is not UTF-8 text (byte {err.start}); it is damaged.{hint}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        empty = " (the file is empty)" if not text.strip() else ""
        raise ValueError(f"{path}:{err.lineno}:{err.colno}: the {what} is not valid JSON: {err.msg}{empty}; it is "
                         f"damaged or was cut short.{hint}") from None
    if expect is not None and not isinstance(value, expect):
        kinds = (expect,) if isinstance(expect, type) else expect
        want = " or ".join(_JSON_KIND.get(t, t.__name__) for t in kinds)
        got = _JSON_KIND.get(type(value), type(value).__name__)
        raise ValueError(f"{path}: the {what} must hold {want}, got {got} ({json.dumps(value)[:60]}).{hint}")
    return value


# ----------------------------------------------------------------------------------------------------------------
# One writer per folder
# ----------------------------------------------------------------------------------------------------------------

LOCK_NAME = ".writer.lock"  # rank 0's (or the only process's); rank r > 0 of a job holds `.writer-p{r}.lock`
LOCK_GLOB = ".writer*.lock"


class FolderBusyError(RuntimeError):
    """Another job holds the folder's writer lock."""


def _job_id() -> str:
    """The identity shared by the processes of one launch: `torchrun`'s run id, else its rendezvous address, else
    this process."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun:{os.environ['TORCHELASTIC_RUN_ID']}"
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"rendezvous:{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return f"pid:{os.getpid()}"


def _read_record(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}


def _held_by_another(path: Path) -> bool:
    """Whether some other open file holds an exclusive `flock` on `path` (probed with a shared one)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's lock
    return False


class FolderLock:
    """`with FolderLock(folder, what="response corpus"):` — this job is the folder's only writer while the block runs.

    Each process of a job holds an exclusive `fcntl.flock` on its own lock file in the folder (rank 0 or the only
    process `.writer.lock`, rank r `.writer-p{r}.lock`) with its record (job, rank, pid, host, command, time), then
    checks the other lock files: one held by a process of another job refuses this one with a `FolderBusyError`
    naming it. So the ranks of one `torchrun` job write side by side, and another job of any size is refused until
    the last rank of the first has ended. The OS drops a lock when its process ends, a kill included, so a stale lock
    never blocks a rerun. A second `FolderLock` on the folder in the same process is refused like another job's (a
    caller that nests writes shares its one lock itself). `rank`: this process's rank in its launch.
    """

    def __init__(self, folder: str | os.PathLike, *, what: str = "folder", rank: int = 0):
        self.folder, self.what, self.rank = Path(folder), what, rank
        self.path = self.folder / (LOCK_NAME if rank == 0 else f".writer-p{rank}.lock")
        self._fd: int | None = None

    def _busy(self, holder: dict) -> FolderBusyError:
        job = str(holder.get("job", ""))
        rank = f" (rank {holder.get('rank', 0)} of job {job})" if job and not job.startswith("pid:") else ""
        who = (f"process {holder.get('pid')}{rank} on {holder.get('host')} since {holder.get('since')} "
               f"({holder.get('command')})") if holder.get("pid") else "another process"
        return FolderBusyError(f"The {self.what} {str(self.folder)!r} is being written by {who}; one job writes to it "
                               f"at a time. Wait for that job to end (or stop it), then rerun the same command.")

    def _other_job(self) -> dict | None:
        """The record of a lock file held by a process of another job, or None. A record still being written (a
        holder between its lock and its record) is read again for up to a second."""
        for _ in range(10):
            found = None
            for path in sorted(self.folder.glob(LOCK_GLOB)):
                if path != self.path and _held_by_another(path):
                    record = _read_record(path)
                    if record.get("job") != _job_id():
                        found = record
                        if record:
                            return record
            if found is None:
                return None
            time.sleep(0.1)
        return found

    def __enter__(self) -> "FolderLock":
        import fcntl

        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        for attempt in range(10):  # another job's probe holds it for an instant; a holder for good
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK) or attempt == 9:
                    os.close(fd)
                    if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        raise self._busy(_read_record(self.path)) from None
                    raise
                time.sleep(0.1)
        self._fd = fd
        record = {"job": _job_id(), "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                  "command": " ".join(sys.argv)[:200], "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        other = self._other_job()
        if other is not None:
            self._release()
            raise self._busy(other)
        return self

    def _release(self) -> None:
        import fcntl

        os.ftruncate(self._fd, 0)  # an unlocked file with a record would name a holder that is gone
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            self._release()


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------

CHECKPOINT_MARKER = "checkpoint_complete.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def mark_checkpoint_complete(folder: str | os.PathLike, **facts) -> None:
    """Write the marker that makes `folder` a complete checkpoint; call it after every other file is written."""
    folder = Path(folder)
    for entry in folder.rglob("*"):  # make the files durable before the marker says they are there
        if entry.is_file() and not entry.name.startswith("."):
            with open(entry, "rb") as f:
                os.fsync(f.fileno())
    atomic_write_text(folder / CHECKPOINT_MARKER, json.dumps({"complete": True, **facts}) + "\n")


def is_complete_checkpoint(folder: str | os.PathLike) -> bool:
    return (Path(folder) / CHECKPOINT_MARKER).is_file()


def last_complete_checkpoint(out: str | os.PathLike) -> tuple[Path | None, list[Path]]:
    """`(newest complete checkpoint-N under out, the incomplete ones newer than it)`; `(None, [...])` if none."""
    out = Path(out)
    if not out.is_dir():
        return None, []
    found = sorted(((int(m[1]), p) for p in out.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))),
                   reverse=True)
    skipped = []
    for _, path in found:
        if is_complete_checkpoint(path):
            return path, skipped
        skipped.append(path)
    return None, skipped


# ----------------------------------------------------------------------------------------------------------------
# A folder or a Hub id
# ----------------------------------------------------------------------------------------------------------------

# A Hub repo id: `namespace/name` (one slash, no leading `/`, `.` or `~`).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub endpoint opens within `timeout` seconds (False when offline mode is on)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    import urllib.request
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    proxy = urllib.request.getproxies().get(endpoint.scheme)  # HTTPS_PROXY & co., which the Hub client follows
    if proxy and not urllib.request.proxy_bypass(endpoint.hostname):
        endpoint = urlparse(proxy if "://" in proxy else f"http://{proxy}")  # then the proxy is what must answer
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return False
    try:
        snapshot_download(repo_id, local_files_only=True)
        return True
    except (LocalEntryNotFoundError, OSError, ValueError):
        return False


def check_local_or_hub(flag: str, value: str | os.PathLike) -> None:
    """`value` must be an existing folder, or a Hub repo id that is cached locally or reachable on the Hub.

    A path that is neither (a typo of a local folder, or a Hub id while offline) is refused within seconds with a
    `ValueError` naming both readings, instead of a minute of Hub retries and a traceback."""
    text = str(value)
    path = Path(text)
    if path.is_dir():
        return
    if path.exists():
        raise ValueError(f"`{flag}` must be a folder or a Hub repo id, got {text!r}, which is a file; give the folder "
                         f"that holds its config.json.")
    if not HUB_ID.match(text):
        raise ValueError(f"`{flag}` {text!r} is not an existing folder (nor a Hub repo id `namespace/name`); check "
                         f"the path.")
    if _in_hub_cache(text) or _hub_reachable():
        return
    raise ValueError(f"`{flag}` {text!r} is neither an existing local folder (no such folder) nor a Hub repo in the "
                     f"local cache, and the Hub cannot be reached (offline, or HF_HUB_OFFLINE is set); check the "
                     f"path, or download the repo where the Hub can be reached.")


# ----------------------------------------------------------------------------------------------------------------
# A saved model's folder
# ----------------------------------------------------------------------------------------------------------------

# The weight files transformers' `from_pretrained` reads from a folder (one of them).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_model_folder(flag: str, folder: str | Path, *, weights: bool = True) -> None:
    """A folder given as a model must be one: it holds config.json and, with `weights`, one of `WEIGHT_FILES`; its
    config.json and generation_config.json (if there) must be JSON objects (`check_model_json`). Raises a
    `ValueError` naming `flag`, the folder, what is missing or damaged and the fix."""
    folder = Path(folder)
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    if weights and not any((folder / name).is_file() for name in WEIGHT_FILES):
        missing.append(f"weights ({', '.join(WEIGHT_FILES)})")
    if missing:
        raise ValueError(f"`{flag}` {str(folder)!r} is a folder but not a saved model: it holds no "
                         f"{' and no '.join(missing)}{_checkpoint_hint(folder)}. Give the folder a model was saved "
                         f"to with `save_pretrained` (for a drafter: the `--out` folder of `hf-chainflow train`).")
    check_model_json(flag, folder)


def check_model_json(flag: str, folder: str | Path) -> None:
    """The config.json and generation_config.json of a model folder, where there, must parse as JSON objects (else a
    `ValueError` naming the file, line and column): transformers would take a damaged generation_config.json for a
    missing one, and a drafter would load with the default drafting settings without a word."""
    folder = Path(folder)
    fix = "Copy or download the model again, or save it again with `save_pretrained`."
    for name, what, more in (("config.json", "model config", ""),
                             ("generation_config.json", "generation config",
                              " Delete the file only to load the default generation settings instead.")):
        if (folder / name).is_file():
            read_json(folder / name, what=f"{what} of `{flag}`", fix=fix + more)


def _checkpoint_hint(folder: Path) -> str:
    """` (it holds training checkpoints: ...)` for a training output folder without its final save."""
    complete, incomplete = last_complete_checkpoint(folder)
    newest = complete or (incomplete[0] if incomplete else None)
    return "" if newest is None else (f" (it holds training checkpoints: give the newest, {str(newest)!r}, or let "
                                      f"the training finish)")


__all__ = ["CHECKPOINT_MARKER", "HUB_ID", "LOCK_GLOB", "LOCK_NAME", "WEIGHT_FILES", "FolderBusyError", "FolderLock", "atomic_path", "atomic_write_bytes",
           "atomic_write_text", "check_local_or_hub", "check_writable", "check_model_folder", "check_model_json", "fsync_dir",
           "is_complete_checkpoint",
           "last_complete_checkpoint", "mark_checkpoint_complete", "read_json", "remove_stale_temps", "temp_path"]
