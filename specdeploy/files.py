"""Reading files we did not write: regular files only, and no more of them than a limit.

An artifact dir (or a prompt file's path) may hold anything where a file should be: a FIFO, which blocks
the reader until someone writes to it; a symlink to ``/dev/zero``, which never ends; a directory; a file
we may not read. Every reader of artifact files goes through ``open_regular``: the file is opened with
``O_NONBLOCK`` (so that opening a FIFO returns at once) and ``fstat``-ed before a byte is read, so a file
swapped between a check and the open cannot slip through. Failures are ``FileRefused`` (a ``ValueError``)
naming the path and what it is.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import BinaryIO

MAX_JSON_BYTES = 16 * 2**20  # manifest.json, tokenizer_config.json: a few KB when we write them
MAX_TOKENIZER_BYTES = 512 * 2**20  # tokenizer.json: 7 MB for Qwen's 151k tokens, ~35 MB for the largest we know


class FileRefused(ValueError):
    """A file that is not a readable regular file, or larger than its reader takes: ``path`` and ``reason``."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


class FileMissing(FileRefused):
    """No file at all at the path (a dangling symlink included)."""


def kind_of(mode: int) -> str:
    """What an ``st_mode`` is, for a message: "a directory", "a FIFO", ..."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def regular_stat(path: Path) -> os.stat_result:
    """``os.stat`` of the regular file at ``path`` (a symlink is followed); FileRefused for anything else."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise _refused(path, exc) from exc
    if not stat.S_ISREG(info.st_mode):
        raise FileRefused(path, f"{kind_of(info.st_mode)}; expected a regular file")
    return info


def open_regular(path: Path, limit: int | None = None) -> BinaryIO:
    """``path`` opened for reading in binary, once it is known to be a regular file of at most ``limit`` bytes.

    Raises FileRefused naming the path: missing, unreadable (permissions), not a regular file, or too large.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise _refused(path, exc) from exc
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(path, f"{kind_of(info.st_mode)}; expected a regular file")
        if limit is not None and info.st_size > limit:
            raise FileRefused(path, f"{info.st_size:,} bytes; expected at most {limit:,}")
    except BaseException:
        os.close(descriptor)
        raise
    return os.fdopen(descriptor, "rb")


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them (FileRefused otherwise)."""
    with open_regular(path, limit) as handle:
        try:
            # as many bytes as the file has, not the limit: a read of n bytes allocates n first (512 MiB for a
            # tokenizer of a few MB); a file that grew since fstat is read on, and still cut off at the limit
            size = os.fstat(handle.fileno()).st_size
            data = handle.read(min(size, limit) + 1)
            if size < len(data) <= limit:
                data += handle.read(limit + 1 - len(data))
        except OSError as exc:
            raise FileRefused(path, f"cannot be read ({_reason(exc)})") from exc
    if len(data) > limit:
        raise FileRefused(path, f"more than {limit:,} bytes; expected at most {limit:,}")
    return data


def read_stream(path: Path, limit: int) -> bytes:
    """The bytes of a file a user named, which may be a stream (``/dev/stdin``, a FIFO, a pipe): read to its
    end, at most ``limit`` bytes. Directories, sockets and block devices are refused."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise _refused(path, exc) from exc
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISFIFO(info.st_mode) or stat.S_ISCHR(info.st_mode)):
        raise FileRefused(path, f"{kind_of(info.st_mode)}; expected a file or a stream")
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise FileRefused(path, f"cannot be read ({_reason(exc)})") from exc
    if len(data) > limit:
        raise FileRefused(path, f"more than {limit:,} bytes; expected at most {limit:,}")
    return data


def _reason(exc: OSError) -> str:
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def _refused(path: Path, exc: OSError) -> FileRefused:
    if isinstance(exc, FileNotFoundError):
        return FileMissing(path, "missing")
    return FileRefused(path, f"cannot be read ({_reason(exc)})")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open_regular(path) as handle:  # a FIFO or a device in place of the file: FileRefused, never a hang
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
