"""Where an artifact is written (by ``specdeploy export`` and ``specdeploy import`` alike; a module of the package's own,
not the exporter's, so that an import loads no torch): ``--out`` checked before any work, an existing artifact
replaced in one step.

``--force`` replaces only what specdeploy wrote: a directory whose ``manifest.json`` is ours (its ``contract``)
and which holds nothing but that manifest and the files it lists. Anything else there (a web app's
``manifest.json``, notes kept beside the graphs) means the directory is refused, and nothing is deleted.

What the filesystem can refuse is refused before any work, in one line: a symlink loop, a path under a regular
file, a directory one may not write. The new artifact's directory gets the permissions the umask gives (a staging
dir is made 0700), and once it is in place the export has succeeded: the artifact it replaced is removed, and what
cannot be removed now (a read-only directory, say) is left under a name the next export removes.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .contract import CONTRACT, MANIFEST, sha256_file
from .files import MAX_JSON_BYTES, FileRefused, read_regular


class OutputError(ValueError):
    """An output directory that cannot be written or replaced, in one line."""


SHOWN = 5  # foreign files named in a refusal; the rest are counted


def output_dir(out: Path, force: bool) -> Path:
    """The directory an export writes: ``out``, or the directory a symlink at ``out`` points to (the link stays and
    points to the new artifact). Refused in one line: the directory one stands in (or one holding it), a dangling
    symlink, an existing ``out`` without ``force``, and with it anything ``replaceable`` refuses."""
    out = Path(out)
    try:
        if out.is_symlink():
            target = out.resolve(strict=False)
            if not target.exists():
                raise OutputError(f"{out}: a symlink to {target}, which does not exist; give a directory to write")
            out = target
        here, where = Path.cwd().resolve(), out.resolve()
    except (RuntimeError, OSError) as exc:  # ELOOP: Python 3.11 raises RuntimeError for a loop, 3.13 OSError
        raise OutputError(f"--out {out}: cannot be followed ({exc}); give a directory, or a symlink to one") from exc
    _check_writable(out)
    if where == here or where in here.parents:
        raise OutputError(f"--out {out}: the current directory, or one that holds it; give the artifact a directory of "
                          "its own (--out ./artifact)")
    if out.exists() or out.is_symlink():
        if not force:
            raise OutputError(f"{out}: already exists; pass --force to replace it")
        replaceable(out)
    return out


def _check_writable(out: Path) -> None:
    """Refuse ``out`` when the directory it would be made in cannot be: its nearest existing ancestor is not a
    directory (``--out notes.txt/art``), or is one this process may not write."""
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        if ancestor.is_symlink():  # a dangling link on the way
            raise OutputError(f"--out {out}: {ancestor} is a symlink to nothing; expected a directory")
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"--out {out}: {ancestor} is a file, not a directory; give a path under a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"--out {out}: cannot write in {ancestor} (permission denied); give a directory you may write")


def replaceable(out: Path) -> None:
    """Refuse (OutputError) unless ``out`` is an artifact directory specdeploy wrote that holds only its own files."""
    if not out.is_dir():
        raise OutputError(f"{out}: not a directory; --force replaces only an artifact directory")
    listed = artifact_files(out)
    if listed is None:
        raise OutputError(f"{out}: not an artifact directory (no manifest.json), or not one `specdeploy export` wrote "
                          f"(contract {CONTRACT!r}); --force replaces only artifacts")
    try:
        foreign = sorted(p.name for p in out.iterdir() if p.name not in listed or p.is_symlink() or not p.is_file())
    except OSError as exc:
        raise OutputError(f"{out}: cannot be listed ({exc.strerror or exc}); --force needs to see what it replaces") from exc
    if foreign:
        more = f" and {len(foreign) - SHOWN:,} more" if len(foreign) > SHOWN else ""
        raise OutputError(f"{out}: holds files specdeploy did not write ({', '.join(foreign[:SHOWN])}{more}); move them out "
                          "first: --force replaces an artifact's own files only")


def artifact_files(directory: Path) -> set[str] | None:
    """The names an artifact directory's own manifest says specdeploy wrote there (itself and its ``files``), or None
    where there is no such manifest."""
    try:
        data = json.loads(read_regular(directory / MANIFEST, MAX_JSON_BYTES))
    except (FileRefused, ValueError, RecursionError):  # missing, not ours, not JSON
        return None
    if not isinstance(data, dict) or data.get("contract") != CONTRACT or not isinstance(data.get("files"), dict):
        return None
    return {MANIFEST, *data["files"]}


PID_FILE = ".pid"  # a staging dir's writer: ``remove_abandoned`` removes the dir once that process is gone


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A staging dir beside ``out`` for an export or an import to write into, marked with this process's pid while it
    is written (so that ``remove_abandoned`` removes it should the process be killed); put at ``out`` (``replace``)
    when the body returns, removed when it raises."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    (staging / PID_FILE).write_text(str(os.getpid()))
    try:
        yield staging
        (staging / PID_FILE).unlink()
        replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def file_hashes(staging: Path) -> dict[str, str]:
    """The sha256 of every file written into ``staging`` (``staged``), its pid marker left out: the manifest's files."""
    return {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file() and p.name != PID_FILE}


def replace(staging: Path, out: Path) -> None:
    """Put the finished ``staging`` dir at ``out``, with the permissions the umask gives. An artifact already there
    (``replaceable`` checked once more: an export takes minutes) is swapped out in one step where the system can
    (Linux's ``renameat2`` with RENAME_EXCHANGE: a reader sees the old artifact or the new, never neither), else
    moved aside first; it is then removed (``discard``): from the swap on, the export has succeeded."""
    staging.chmod(0o777 & ~_umask())
    if not (out.exists() or out.is_symlink()):
        staging.rename(out)
        return
    replaceable(out)
    if _exchange(staging, out):
        old = staging  # the previous artifact, now at the staging dir's name
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        out.rename(old)  # onto the empty dir just made
        staging.rename(out)
    discard(old, out)


def discard(old: Path, out: Path) -> None:
    """Remove ``old``, the artifact ``out`` replaced, raising nothing: it is renamed ``.NAME.replaced-PID`` first, so
    that what cannot be removed now (a kill, a read-only directory) is found and removed by the next export."""
    aside = out.with_name(f".{out.name}.replaced-{os.getpid()}")
    try:
        old.rename(aside)
        old = aside
    except OSError:  # a name taken by a leftover of this process: removed where it lies
        pass
    try:
        _remove(old)
    except OSError as exc:
        warnings.warn(f"{out}: replaced, but the previous artifact at {old} could not be removed ({exc}); the next "
                      f"export to {out} removes it", stacklevel=2)


def _remove(directory: Path) -> None:
    """``shutil.rmtree``, making a directory writable where removing from it was refused (an artifact someone made
    read-only)."""
    def writable_then_again(function, path, _exc):
        parent = Path(path).parent
        parent.chmod(parent.stat().st_mode | 0o700)
        function(path)

    shutil.rmtree(directory, onerror=writable_then_again)


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it; set back at once
    os.umask(mask)
    return mask


def remove_abandoned(out: Path) -> None:
    """Staging dirs and replaced artifacts of an export that was killed, or that could not remove them, would hold
    gigabytes forever. So would a ``.NAME.old`` artifact that exporters before 0.3.4 left when killed: removed only
    if it is one. A ``.NAME.replaced-PID`` is removed once its process has ended (or is this one)."""
    old = out.with_name(f".{out.name}.old")
    if old.is_dir() and not old.is_symlink() and artifact_files(old) is not None:
        shutil.rmtree(old, ignore_errors=True)
    for left in out.parent.glob(f".{out.name}.replaced-*"):
        pid = left.name.rsplit("-", 1)[1]
        if left.is_dir() and not left.is_symlink() and pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            try:
                _remove(left)
            except OSError:
                pass  # tried again next time
    for staging in out.parent.glob(f".{out.name}.*"):
        pid_file = staging / PID_FILE
        if staging.is_symlink() or not staging.is_dir() or not pid_file.is_file():
            continue
        try:
            os.kill(int(pid_file.read_text()), 0)
        except (ProcessLookupError, ValueError):
            shutil.rmtree(staging, ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True


AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``, which Python's ``os`` does not offer);
    False where the system or the filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without it (glibc < 2.28, musl)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # an old kernel, or a filesystem without it
        return False
    raise OSError(code, os.strerror(code), str(second))
