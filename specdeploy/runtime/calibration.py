"""The cost table, remembered from one process to the next.

A ``specdeploy generate`` run is a fresh process: it warms its shapes up and measures them
(``Pipeline.warm_up``), but its cycles at other batch sizes, its catch-ups and its drift are what an
earlier run already learned. The engines' costs belong to the models, the execution providers (each model's
own), the thread count and this machine, so they are kept per (artifact manifest, providers, threads, ONNX Runtime
version, machine) in the user's cache (``$SPECDEPLOY_CACHE``, default ``~/.cache/specdeploy``), one record
holding both modes' tables: the default's and exact mode's (``GenerationConfig.exact``: every target call padded to
an even number of tokens, so its calls cost otherwise). A record, or a table in it, that is missing, unreadable or
malformed only means starting from the warm-up's measurements.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path

from ..digests import cache_dir, read_record, write_record
from ..engines.providers import Provider
from .cost_policy import Costs

FOLDER = "costs"
TABLES = ("costs", "exact_costs")  # the default mode's table, exact mode's (records before exact mode: the first)


def machine_key(directory: Path, provider: str | Provider, threads: int | None,
                draft_provider: str | Provider | None = None) -> str:
    """Who the remembered costs belong to: this artifact (its manifest names every file's digest) with its target on
    ``provider`` and its draft on ``draft_provider`` (None: the same; each with its options: OpenVINO's device and
    precision), thread count, ONNX Runtime and machine. The table holds both models' calls, each priced as its own
    provider ran it, so the key names both (a pair on one provider keeps the key it had before a draft could run
    elsewhere)."""
    import onnxruntime

    manifest = hashlib.sha256((Path(directory) / "manifest.json").read_bytes()).hexdigest()
    providers = Provider.of(provider).key
    if draft_provider is not None and Provider.of(draft_provider).key != providers:
        providers += f" draft:{Provider.of(draft_provider).key}"
    facts = [manifest, providers, str(threads), onnxruntime.__version__, platform.machine(), platform.node(),
             str(os.cpu_count())]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:32]


class RememberedCosts:
    """The cost table of one (artifact, providers, threads, ONNX Runtime, machine), kept in the user's cache."""

    def __init__(self, key: str):
        self.path = cache_dir() / FOLDER / f"{key}.json"
        self._lock = threading.Lock()

    def recall(self, table: str = "costs") -> Costs | None:
        """The ``table`` (one of ``TABLES``) an earlier process kept; None where there is none or it is unusable (a
        cold start)."""
        if table not in TABLES:
            raise ValueError(f"table: got {table!r}; expected one of {', '.join(TABLES)}")
        record = read_record(self.path)
        try:
            return Costs.from_dict(record[table]) if table in record else None
        except ValueError:
            return None

    def remember(self, costs: Costs, exact_costs: Costs) -> None:
        """Keep both modes' tables for the next process (a read-only home: the next run starts cold). A process
        that ran one mode alone passes the other's table as it recalled it, so that table is kept as it was."""
        with self._lock:
            write_record(self.path, {"costs": costs.to_dict(), "exact_costs": exact_costs.to_dict()})
