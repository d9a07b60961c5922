"""What the cost policy measured, remembered from one process to the next.

A ``specdeploy generate`` run is a fresh process: without this, every run's cost policy starts from
nothing, takes its first measurements while ONNX Runtime is still cold (first calls at a shape cost
several times a warm one), and spends a short completion learning what the previous run already knew.
The engines' costs belong to the models, the execution provider, the thread count and this machine, so
they are kept per (artifact manifest, provider, threads, ONNX Runtime version, machine) and per
(policy, k, drafter), in the user's cache (``$SPECDEPLOY_CACHE``, default ``~/.cache/specdeploy``).
A record that is missing, unreadable or malformed only means starting cold, as before.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path

from ..digests import cache_dir, read_record, write_record
from .policies import Policy

FOLDER = "costs"


def machine_key(directory: Path, provider: str, threads: int | None) -> str:
    """Who the remembered costs belong to: this artifact (its manifest names every file's digest) on this
    provider, thread count, ONNX Runtime and machine."""
    import onnxruntime

    manifest = hashlib.sha256((Path(directory) / "manifest.json").read_bytes()).hexdigest()
    facts = [manifest, provider, str(threads), onnxruntime.__version__, platform.machine(), platform.node(),
             str(os.cpu_count())]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:32]


class RememberedCosts:
    """The record of one (artifact, provider, threads, machine): each policy's last state, by (policy, k, drafter)."""

    def __init__(self, key: str):
        self.path = cache_dir() / FOLDER / f"{key}.json"
        self._lock = threading.Lock()

    def recall(self, policy: Policy, slot: tuple) -> bool:
        """Start ``policy`` from the state remembered for ``slot``; False where there is none (or it is unusable)."""
        state = read_record(self.path).get(_name(slot))
        return state is not None and policy.recall(state)

    def remember(self, policy: Policy, slot: tuple) -> None:
        """Keep ``policy``'s state for ``slot`` (a policy that learns nothing across requests keeps none)."""
        state = policy.remembered()
        if state is None:
            return
        with self._lock:
            entries = read_record(self.path)
            entries[_name(slot)] = state
            write_record(self.path, entries)  # a read-only home: the next run starts cold


def _name(slot: tuple) -> str:
    return "/".join(map(str, slot))
