"""What the engines' calls cost on this machine, and how long its answers run: measured as a pipeline works, and
remembered from one process to the next (``Calibration``).

ONNX Runtime grows its buffers at the first call that needs them (on the real pair a cold 100-token prefill took
1.02 s in the target, 0.56 s the second time), so the cost policy's first cycle is priced with warm calls' costs:
``Calibration.warm_up`` calls the shapes a request will call and measures them into the table.

A ``specdeploy generate`` run is a fresh process: it warms its shapes up and measures them, but its cycles at other
batch sizes, its catch-ups and its drift are what an earlier run already learned. The engines' costs belong to the
models, the execution providers (each model's own), the thread count and this machine, so they are kept per (artifact
manifest, providers, threads, ONNX Runtime version, machine) in the user's cache (``$SPECDEPLOY_CACHE``, default
``~/.cache/specdeploy``), one record holding both modes' tables: the default's and exact mode's
(``GenerationConfig.exact``: every target call padded to an even number of tokens, so its calls cost otherwise), and
the lengths of the latest answers (``AnswerLengths``: what a catch-up is repaid over). A record, or a table in it,
that is missing, unreadable or malformed only means starting from the warm-up's measurements (and from each request's
budget).
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import time
from pathlib import Path

import numpy as np

from ..contract import PREFILL_CHUNK
from ..digests import cache_dir, read_record, write_record
from ..engines.base import Engine, feed
from ..engines.providers import Provider
from ..values import short
from .answer_lengths import AnswerLengths
from .cache import slots_needed
from .cost_policy import Costs

FOLDER = "costs"
CATCHUP_TOKENS = 32  # a draft catch-up long enough to time a rate, not a call
CHANGE_ROUNDS = 3  # rounds of (two tokens, one, one) that time what a change of shape costs a model
# a change of shape costs nothing below this share of a call that kept its shape: the CPU provider's read -1.0 to
# +0.75 ms of a 46 ms call on the demo's target, which is two minimums of three calls apart; OpenVINO's 8.2-8.8 ms of 48
NOTICEABLE = 0.05
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
            raise ValueError(f"table: got {short(table)}; expected one of {', '.join(TABLES)}")
        record = read_record(self.path)
        try:
            return Costs.from_dict(record[table]) if table in record else None
        except ValueError:
            return None

    def recall_answers(self) -> AnswerLengths | None:
        """The lengths of the answers an earlier process finished; None where there are none or they are unusable."""
        record = read_record(self.path)
        try:
            return AnswerLengths.from_list(record["answers"]) if "answers" in record else None
        except ValueError:
            return None

    def remember(self, costs: Costs, exact_costs: Costs, answers: AnswerLengths | None = None) -> None:
        """Keep both modes' tables, and the answers' lengths, for the next process (a read-only home: the next run
        starts cold). A process that ran one mode alone passes the other's table as it recalled it, so that table is
        kept as it was."""
        record = {"costs": costs.to_dict(), "exact_costs": exact_costs.to_dict()}
        if answers is not None:
            record["answers"] = answers.to_list()
        with self._lock:
            write_record(self.path, record)


class Calibration:
    """A pipeline's cost tables, one per mode: the default's (``costs``) and exact mode's (``exact_costs``: every target
    call padded to an even number of tokens, so its calls cost otherwise). ``warm_up`` measures the shapes a request
    calls before its first cycle; every request's cost policy prices by its mode's table and blends its cycles in, so
    what one request measured the next one starts from. ``remembered``: the record they start from and are kept in
    across processes (None: this process learns its own)."""

    def __init__(self, remembered: RememberedCosts | None = None):
        self.remembered = remembered
        self.costs = (remembered.recall() if remembered else None) or Costs()
        self.exact_costs = (remembered.recall("exact_costs") if remembered else None) or Costs()
        self.answers = (remembered.recall_answers() if remembered else None) or AnswerLengths()
        self._warmed: set[tuple[int, bool]] = set()  # the (k, exact) whose shapes ``warm_up`` has run
        self._lock = threading.Lock()

    def table(self, exact: bool) -> Costs:
        """Exact mode's table (``exact``) or the default's."""
        return self.exact_costs if exact else self.costs

    def warmed(self, k: int, exact: bool) -> bool:
        """Whether ``warm_up`` has run the shapes of ``k`` drafts in this mode."""
        return (k, exact) in self._warmed

    def remember(self) -> None:
        """Keep both tables and the answers' lengths for the next process (nothing where none is remembered)."""
        if self.remembered is not None:
            self.remembered.remember(self.costs, self.exact_costs, self.answers)

    def warm_up(self, target: Engine, draft: Engine | None, k: int, prompt_tokens: int = 0, exact: bool = False) -> float:
        """Bring the shapes a request of at most ``k`` drafts calls at batch 1 into the mode's table (``exact``:
        exact mode's, ``target`` its padded target): T = 1 .. k + 1 in the target, and in the ``draft`` its one- and
        two-token calls and a catch-up of ``CATCHUP_TOKENS`` (none with ``k`` = 0 or no draft model). A shape the table
        lacks is called twice and the quicker call measured: the first is cold, either may be stalled on a busy host,
        and the table takes its first measurement of a shape whole (one stalled call there can price drafting out of
        a short request); one it has (recalled from an earlier process) is left to the requests. Then, where the table
        has not measured it, what a change of shape costs each model (``change_seconds``). With ``prompt_tokens``,
        each model first prefills that many tokens (a server's chunk), so that its first request's prefill is warm
        too. Returns the seconds taken."""
        with self._lock:
            began = time.perf_counter()
            costs = self.table(exact)
            # (engine, its table, tokens, logits kept: None for all): the target's calls keep every position's
            shapes = [(target, "verify", t, None) for t in range(1, k + 2)]
            if k and draft is not None:
                shapes += [(draft, "draft", t, 1) for t in (1, 2, CATCHUP_TOKENS)]
            for engine in dict.fromkeys(shape[0] for shape in shapes):  # the target first
                room = engine.spec.capacity - slots_needed(0, 1, k)  # the longest prompt of a one-token request
                prompt = min(prompt_tokens, PREFILL_CHUNK, room)
                cache = engine.allocate_cache(1, engine.spec.capacity)
                if prompt > 0:
                    feed(engine, cache, np.zeros((1, prompt), np.int64), [prompt])
                mine = [shape for shape in shapes if shape[0] is engine]
                for _, name, tokens, last in mine:
                    past = max(0, min(prompt, room - tokens))
                    if (1, tokens) in getattr(costs, name) or tokens > room:
                        continue
                    seconds = min(_call(engine, cache, tokens, past, last) for _ in range(2))
                    costs.learn(name, (1, tokens), seconds, past)
                for name, last in dict.fromkeys((name, last) for _, name, _, last in mine):
                    if name not in costs.change and room >= 2:
                        costs.change[name] = change_seconds(engine, cache, max(0, min(prompt, room - 2)), last)
            self._warmed.add((k, exact))
            return time.perf_counter() - began


def change_seconds(engine: Engine, cache, past: int, last: int | None) -> float:
    """What ``engine``'s call pays when its token count differs from its previous call's: ``CHANGE_ROUNDS`` rounds of
    a two-token call and two one-token calls after ``past`` (keeping the logits of ``last`` positions; None: all), the
    quicker of the first one-token calls (after a change) less the quicker of the second (the shape kept); none where
    that is under ``NOTICEABLE`` of a kept call. OpenVINO's execution provider takes a new shape as a new
    inference (docs/results/openvino/, Round three)."""
    changed, kept = [], []
    for _ in range(CHANGE_ROUNDS):
        _call(engine, cache, 2, past, last)
        changed.append(_call(engine, cache, 1, past, last))
        kept.append(_call(engine, cache, 1, past, last))
    change = min(changed) - min(kept)
    return change if change >= NOTICEABLE * min(kept) else 0.0


def _call(engine: Engine, cache, tokens: int, past: int, last: int | None) -> float:
    """The seconds of one call of ``tokens`` (zeros) after ``past`` on a warm-up's throwaway ``cache``."""
    return engine.infer(np.zeros((1, tokens), np.int64), np.array([past], np.int64), cache, last).seconds
