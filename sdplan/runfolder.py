"""The run folder's two guards: a manifest of what sdplan wrote there, and a lock while a run uses it.

Manifest (``.sdplan-manifest.json``): the top-level entries of the folder that sdplan (``recommend --out``,
``train`` and the trainer it launched) created. ``--force`` may delete only names listed here; anything else in
the folder is the user's and is never deleted or written over. An entry is recorded only when sdplan creates it
(it did not exist before), so a name in the manifest is proof that sdplan wrote it. With the run files it writes
at the top (sdplan.yaml, accelerate.yaml, ...: :func:`write_files`) it keeps the sha256 of what it wrote: one
the user edited since is copied aside (``sdplan.edited-<time>.yaml``, listed as ``kept``: the user's, never
deleted, not counted among the folder's entries) before sdplan writes it again.

Lock (``.sdplan.lock``): JSON with the pid, host and start time of the sdplan process using the folder (and the
trainer's pid once it runs). A second run into the same folder says who holds it and stops; a lock whose
processes are gone (a crash, a reboot) is taken over with a message.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sdplan.errors import OutputExistsError, SdplanError

MANIFEST_FILE = ".sdplan-manifest.json"
LOCK_FILE = ".sdplan.lock"
# sdplan's bookkeeping: never user files, never listed as the folder's contents.
BOOKKEEPING = (MANIFEST_FILE, LOCK_FILE)


class FolderInUse(SdplanError):
    """Another sdplan run (alive) holds the run folder's lock."""

    exit_code = 3


class CannotWrite(SdplanError):
    """The output folder cannot be written (read-only, no permission, disk full)."""

    exit_code = 2


def cannot_write(path: Path, e: OSError, *, fix: str | None = None) -> CannotWrite:
    """One line for an OSError while writing under ``path``. ``fix``: what to do instead, for a command whose
    output is not ``--out DIR``."""
    import errno

    why = e.strerror or type(e).__name__
    if e.errno == errno.ENOSPC:
        return CannotWrite(
            f"disk full: cannot write to {path}", fix=f"free some space or {fix or 'choose another --out'}"
        )
    return CannotWrite(
        f"cannot write to {path}: {why}", fix=fix or "choose a folder you can write to (--out DIR)"
    )


# -- the manifest ------------------------------------------------------------------------------------------


def _manifest(out: Path) -> dict[str, Any]:
    try:
        data = json.loads((out / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def written_at(out: Path) -> str | None:
    """The folder ``out``'s manifest was last written in (None: a manifest from before it was recorded)."""
    folder = _manifest(out).get("folder")
    return folder if isinstance(folder, str) else None


def _names(value: Any) -> set[str]:
    return {e for e in value if isinstance(e, str) and "/" not in e} if isinstance(value, list) else set()


def run_file(path: Path) -> Path | None:
    """The sdplan run ``path`` is a file of (by its name or where a link leads): the nearest folder above it
    with a manifest that lists its top-level entry, or whose bookkeeping or checkpoints/ it is in, or (a run from
    before the manifest) one with a trainer checkpoint's state, for its sdplan.yaml and checkpoints; None for
    any other path (the user's own files beside a run are theirs)."""
    for where in dict.fromkeys((Path(os.path.abspath(path)), Path(path).resolve())):
        for folder in where.parents:
            legacy = any((folder / "checkpoints").glob("*/train_state.json"))
            if not ((folder / MANIFEST_FILE).exists() or legacy):
                continue
            top = where.relative_to(folder).parts[0]
            ours = owned(folder) | {MANIFEST_FILE, LOCK_FILE, "checkpoints"}
            if top in ours or (legacy and top == "sdplan.yaml"):
                return folder
            break  # the nearest run decides
    return None


def owned(out: Path) -> set[str]:
    """Top-level names in ``out`` that sdplan recorded as its own (empty without a readable manifest)."""
    return _names(_manifest(out).get("entries"))


def kept(out: Path) -> set[str]:
    """Copies of run files the user edited, set aside before sdplan wrote those again (:func:`write_files`)."""
    return _names(_manifest(out).get("kept"))


def record(
    out: Path, names: Iterable[str], *, sha256: dict[str, str] | None = None, keep: Iterable[str] = ()
) -> None:
    """Add ``names`` (top-level entries sdplan just created in ``out``) to the manifest, with the sha256 of
    files it wrote and the names of copies it kept of the user's edits; atomic rewrite."""
    names = {n for n in names if n and "/" not in n and n not in BOOKKEEPING}
    data = _manifest(out)
    current, had = _names(data.get("entries")), _names(data.get("kept"))
    hashes = {**(data.get("sha256") or {}), **(sha256 or {})}
    keep = had | set(keep)
    folder = str(out.resolve())
    if (
        names <= current
        and hashes == (data.get("sha256") or {})
        and keep == had
        and data.get("folder") == folder
    ):
        return
    data = {
        "written_by": "sdplan",
        "about": "files and folders sdplan created here; `--force` deletes only these",
        "folder": folder,  # where it was written: a copied or moved folder's manifest names the original
        "entries": sorted(current | names),
        "sha256": dict(sorted(hashes.items())),
        "kept": sorted(keep),
    }
    tmp = out / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(out / MANIFEST_FILE)


def write_files(
    out: Path, files: dict[str, str | bytes], *, retire: Iterable[str] = ()
) -> tuple[list[Path], list[Path]]:
    """Write the run files at the top of ``out`` (name -> text or bytes), each atomically, and record them.
    A file sdplan wrote there before that no longer holds what it wrote (the user edited it: its sha256 is not
    the manifest's, or the manifest predates the hashes) and would change is first copied to
    ``<name>.edited-<time><suffix>``. ``retire``: run files an earlier write may have left that this one does
    not write (deepspeed.json after a plan without DeepSpeed): deleted where they still hold what sdplan wrote,
    kept where the user edited them. Returns (written, kept copies). The caller checked that no file of the
    user's is among them (:func:`check_not_ours`)."""
    import hashlib
    import shutil

    manifest = _manifest(out)
    mine, hashes = _names(manifest.get("entries")), manifest.get("sha256") or {}

    def edited(name: str) -> bool | None:
        """Whether sdplan's file ``name`` was edited since it wrote it (None: not a file sdplan wrote)."""
        path = out / name
        if name not in mine or not path.is_file() or path.is_symlink():
            return None
        return hashlib.sha256(path.read_bytes()).hexdigest() != hashes.get(name)

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    written: dict[str, str] = {}  # name -> the sha256 of what was written
    copies: list[Path] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        new = [name for name in files if not (out / name).exists()]
        for name, content in files.items():
            path, data = out / name, as_bytes(content)
            if edited(name) and path.read_bytes() != data:
                copy = path.with_name(f"{path.stem}.edited-{stamp}{path.suffix}")
                shutil.copy2(path, copy)
                copies.append(copy)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
            written[name] = hashlib.sha256(data).hexdigest()
        for name in retire:
            if name not in files and edited(name) is False:
                (out / name).unlink()
    except OSError as e:
        raise cannot_write(out, e) from None
    finally:
        if written or copies:  # only what was written: a name that failed to write is not sdplan's
            record(out, [n for n in new if n in written], sha256=written, keep=[p.name for p in copies])
    return [out / name for name in written], copies


def kept_line(copy: Path) -> str:
    """The line saying that a copy of the user's edits was kept (:func:`write_files`)."""
    name = f"{copy.stem.split('.edited-')[0]}{copy.suffix}"
    return (
        f"kept the {name} that was there as {copy}: it was not what sdplan last wrote (your edits, or an older "
        "sdplan's file)"
    )


def entries(out: Path) -> list[str]:
    """The folder's top-level names, without sdplan's bookkeeping files and the copies it kept of the user's
    edits."""
    if not out.is_dir():
        return []
    skip = kept(out)
    return sorted(
        p.name
        for p in out.iterdir()
        if p.name not in BOOKKEEPING and p.name not in skip and not p.name.endswith(".tmp")
    )


def foreign(out: Path) -> list[str]:
    """Top-level names in ``out`` that sdplan cannot prove it wrote."""
    mine = owned(out)
    return [n for n in entries(out) if n not in mine]


def remove_owned(out: Path, names: Iterable[str]) -> list[str]:
    """Delete those of ``names`` that the manifest lists (files or folders); returns what was removed.
    A name not in the manifest is left alone, whatever it is called."""
    import shutil

    mine = owned(out)
    removed = []
    for name in names:
        path = out / name
        if name not in mine or not (path.exists() or path.is_symlink()):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(name)
    return removed


def as_bytes(content: str | bytes) -> bytes:
    """A run-folder file's bytes as sdplan writes them: text in UTF-8, an image as it is."""
    return content if isinstance(content, bytes) else content.encode()


def not_ours(out: Path, files: dict[str, str | bytes]) -> list[str]:
    """Names in ``files`` (name -> the text or bytes sdplan is about to write in ``out``) that exist there, are
    not in the manifest, and hold other bytes: writing them would overwrite a user's file."""
    mine = owned(out)
    theirs = []
    for name, text in files.items():
        path = out / name
        if name in mine or not (path.exists() or path.is_symlink()):
            continue
        try:
            same = path.is_file() and path.read_bytes() == as_bytes(text)
        except OSError:
            same = False
        if not same:
            theirs.append(name)
    return theirs


def check_not_ours(out: Path, files: dict[str, str | bytes], *, fix: str) -> None:
    """OutputExistsError when writing ``files`` in ``out`` would overwrite a file sdplan did not write."""
    theirs = not_ours(out, files)
    if theirs:
        raise OutputExistsError(
            f"{out} holds {', '.join(theirs)} not written by sdplan (no manifest entry); sdplan never writes "
            "over your files",
            fix=fix,
        )


# -- the lock ----------------------------------------------------------------------------------------------


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid from the holder."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive(pid: Any, ticks: Any = None) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _start_ticks(pid)
    return ticks is None or now is None or now == ticks


def read_lock(out: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((out / LOCK_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def holder(out: Path) -> dict[str, Any] | None:
    """The lock's content while a live process on this host holds it (or a host we cannot check); None when
    the folder is free or its lock is stale."""
    data = read_lock(out)
    if data is None:
        return None
    if data.get("host") not in (None, socket.gethostname()):
        return data  # another machine (a shared disk): we cannot tell, so it holds
    procs = [(data.get("pid"), data.get("pid_start")), (data.get("trainer_pid"), data.get("trainer_start"))]
    return data if any(_alive(pid, ticks) for pid, ticks in procs) else None


def describe(data: dict[str, Any]) -> str:
    who = f"sdplan pid {data.get('pid', '?')} on {data.get('host', '?')}"
    if data.get("trainer_pid"):
        who += f" (trainer pid {data['trainer_pid']})"
    return who + (f", started {data['started']}" if data.get("started") else "")


def check_free(out: Path) -> None:
    """Raise FolderInUse when a live run holds ``out``; writes nothing."""
    data = holder(out)
    if data is not None:
        raise FolderInUse(
            f"{out} is in use by {describe(data)}",
            fix="wait for that run to finish or stop it, or choose another --out",
        )


class RunLock:
    """Held while sdplan trains in ``out``: ``acquire()`` creates the lock file atomically (O_EXCL)."""

    def __init__(self, out: Path, command: str = ""):
        self.out = out
        self.path = out / LOCK_FILE
        self.command = command
        self.data: dict[str, Any] = {}
        self.taken_over: dict[str, Any] | None = None
        self.nested = False  # this process already held it (the demo, then the run it starts)

    def acquire(self) -> RunLock:
        current = read_lock(self.out)
        if current and current.get("pid") == os.getpid() and current.get("host") == socket.gethostname():
            self.nested, self.data = True, current
            return self
        self.data = {
            "pid": os.getpid(),
            "pid_start": _start_ticks(os.getpid()),
            "host": socket.gethostname(),
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": self.command,
        }
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                data = holder(self.out)
                if data is not None:
                    check_free(self.out)
                self.taken_over = read_lock(self.out) or {}
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            except OSError as e:
                raise cannot_write(self.out, e) from None
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.data, indent=2) + "\n")
            return self
        check_free(self.out)  # lost every race: someone else holds it now
        raise FolderInUse(f"{self.out} is in use by another sdplan run", fix="choose another --out")

    def set_trainer(self, pid: int) -> None:
        """Record the trainer's pid: a lock is stale only once sdplan and the trainer are both gone."""
        self.data.update(trainer_pid=pid, trainer_start=_start_ticks(pid))
        tmp = self.path.with_name(LOCK_FILE + ".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(self.data, indent=2) + "\n")
            tmp.replace(self.path)

    def release(self) -> None:
        if self.nested:
            return
        current = read_lock(self.out)
        if current and current.get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                self.path.unlink()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
