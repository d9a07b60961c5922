"""File digests, and facts read from files, remembered per file identity: an artifact is hashed once.

Hashing a 1.5B/0.5B artifact (3.3 GB) takes 2-5 s, a third or more of a CLI run's start. A file's
identity is (device, inode, size, mtime_ns, ctime_ns): any write or replacement changes it, and
ctime cannot be set back by the file's owner, so a file whose identity matches the record still
has the bytes that were hashed. The record is a JSON file in the user's cache
(``$SPECDEPLOY_CACHE``, default ``~/.cache/specdeploy``); an unreadable or unwritable record only
means hashing again. ``specdeploy doctor`` always hashes every byte.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from .files import read_regular, regular_stat, sha256_file

RECORD = "digests.json"
KEPT = 256  # files remembered; the oldest are forgotten
MAX_RECORD_BYTES = 64 * 2**20  # 256 entries of a few KB each; a larger record is not ours, and is started afresh


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEPLOY_CACHE") or Path.home() / ".cache" / "specdeploy")


def _identity(path: Path) -> list[int]:
    """(device, inode, size, mtime_ns, ctime_ns) of a regular file; FileRefused for anything else (a FIFO would
    block whoever reads it next, a device never ends)."""
    info = regular_stat(path)
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def read_record(record: Path) -> dict:
    """A JSON object kept in the user's cache; {} where it is missing, unreadable, not a regular file, too large or
    not an object."""
    try:
        entries = json.loads(read_regular(record, MAX_RECORD_BYTES))
    except (OSError, ValueError, RecursionError):  # FileRefused and JSONDecodeError are ValueErrors
        return {}
    return entries if isinstance(entries, dict) else {}


def write_record(record: Path, entries: dict) -> None:
    """Replace ``record`` with ``entries`` atomically (a concurrent reader sees the old record or the new
    one); a read-only cache only means the record is not kept."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_name(f"{record.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        partial.write_text(json.dumps(entries))
        partial.replace(record)
    except OSError:
        pass


def remembered_sha256(path: Path) -> str:
    """sha256 of ``path``: the recorded one while the file's identity is unchanged, else hashed (and recorded)."""
    digest = _remember(path, "sha256", sha256_file)
    return digest if isinstance(digest, str) else sha256_file(path)


def remembered_fact(path: Path, name: str, compute):
    """``compute(path)``, a JSON-able function of the file's bytes alone (the external-data locations a graph
    names, say), computed once per file identity. FileRefused for anything but a regular file: ``compute``
    never opens a FIFO or a device."""
    return _remember(path, f"fact:{name}", compute)


_lock = threading.Lock()  # one read-modify-write of the record at a time in this process (engines load in parallel)


def _remember(path: Path, field: str, compute):
    path = Path(path)  # as given, so that a refusal names the artifact's file, not where a link leads
    key = str(path.resolve())  # one entry per file, however it is reached
    record = cache_dir() / RECORD
    identity = _identity(path)
    entry = read_record(record).get(key)
    if isinstance(entry, dict) and entry.get("identity") == identity and field in entry:
        return entry[field]
    value = compute(path)
    if _identity(path) != identity:  # written while being read: nothing to remember
        return value
    with _lock:
        entries = read_record(record)
        entry = entries.pop(key, None)
        if not isinstance(entry, dict) or entry.get("identity") != identity:
            entry = {"identity": identity}  # another file now, or never seen: what was known of it is void
        entry[field] = value
        entries[key] = entry  # last in the record: the most recently used
        for old in list(entries)[: max(0, len(entries) - KEPT)]:
            del entries[old]
        write_record(record, entries)  # a read-only home: the file is read again next time
    return value
