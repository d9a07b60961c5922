"""Where an export is written: ``--out`` checked before any work, an existing artifact replaced in one step.

``--force`` replaces only what specdeploy wrote: a directory whose ``manifest.json`` is ours (its ``contract``)
and which holds nothing but that manifest and the files it lists. Anything else there (a web app's
``manifest.json``, notes kept beside the graphs) means the directory is refused, and nothing is deleted.
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
from pathlib import Path

from ..contract import CONTRACT, MANIFEST
from ..files import MAX_JSON_BYTES, FileRefused, read_regular
from .registry import ExportError

SHOWN = 5  # foreign files named in a refusal; the rest are counted


def output_dir(out: Path, force: bool) -> Path:
    """The directory an export writes: ``out``, or the directory a symlink at ``out`` points to (the link stays and
    points to the new artifact). Refused in one line: the directory one stands in (or one holding it), a dangling
    symlink, an existing ``out`` without ``force``, and with it anything ``replaceable`` refuses."""
    out = Path(out)
    if out.is_symlink():
        target = out.resolve()
        if not target.exists():
            raise ExportError(f"{out}: a symlink to {target}, which does not exist; give a directory to write")
        out = target
    here, where = Path.cwd().resolve(), out.resolve()
    if where == here or where in here.parents:
        raise ExportError(f"--out {out}: the current directory, or one that holds it; give the artifact a directory of "
                          "its own (--out ./artifact)")
    if out.exists() or out.is_symlink():
        if not force:
            raise ExportError(f"{out}: already exists; pass --force to replace it")
        replaceable(out)
    return out


def replaceable(out: Path) -> None:
    """Refuse (ExportError) unless ``out`` is an artifact directory specdeploy wrote that holds only its own files."""
    if not out.is_dir():
        raise ExportError(f"{out}: not a directory; --force replaces only an artifact directory")
    listed = artifact_files(out)
    if listed is None:
        raise ExportError(f"{out}: not an artifact directory (no manifest.json), or not one `specdeploy export` wrote "
                          f"(contract {CONTRACT!r}); --force replaces only artifacts")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in listed or p.is_symlink() or not p.is_file())
    if foreign:
        more = f" and {len(foreign) - SHOWN:,} more" if len(foreign) > SHOWN else ""
        raise ExportError(f"{out}: holds files specdeploy did not write ({', '.join(foreign[:SHOWN])}{more}); move them out "
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


def replace(staging: Path, out: Path) -> None:
    """Put the finished ``staging`` dir at ``out``. An artifact already there (``replaceable`` checked once more: an
    export takes minutes) is swapped out in one step where the system can (Linux's ``renameat2`` with
    RENAME_EXCHANGE: a reader sees the old artifact or the new, never neither), else moved aside first; it is then
    deleted, and nothing of it stays behind."""
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
    (old / ".pid").write_text(str(os.getpid()))  # a kill before the next line leaves it to the next export to remove
    try:
        shutil.rmtree(old)
    except OSError as exc:
        warnings.warn(f"{out}: replaced, but the previous artifact at {old} could not be removed ({exc})", stacklevel=2)


def remove_abandoned(out: Path) -> None:
    """Staging dirs (and replaced artifacts) of an export that was killed, whose process is gone, would hold gigabytes
    forever. So would a ``.NAME.old`` artifact that exporters before 0.3.4 left when killed: removed only if it is one."""
    old = out.with_name(f".{out.name}.old")
    if old.is_dir() and not old.is_symlink() and artifact_files(old) is not None:
        shutil.rmtree(old, ignore_errors=True)
    for staging in out.parent.glob(f".{out.name}.*"):
        pid_file = staging / ".pid"
        if staging.is_symlink() or not staging.is_dir() or not pid_file.is_file():
            continue
        try:
            os.kill(int(pid_file.read_text()), 0)
        except (ProcessLookupError, ValueError):
            shutil.rmtree(staging, ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


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
