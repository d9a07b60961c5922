"""How long a pipeline's answers run: the tokens a draft model's catch-up is repaid over.

Before the draft model drafts it catches up on what it has not seen (a request's prompt, first of all), and the cost
policy pays that only where drafting saves more over the tokens still to come (``CostPolicy.catchup_pays``). A
request's budget (``max_new_tokens``) bounds those tokens, but an answer ends where the target ends it (EOS, a stop
string): a translation ends after 10-60 tokens of a 128-token budget, and a prompt catch-up priced against the budget
was paid on every one of them and never repaid (tools/replay.py, docs/results/spec_bench_groups/).

``AnswerLengths`` keeps the new tokens of a pipeline's latest finished requests (kept with its cost table from one
process to the next: ``calibration``) and answers how many a request that has made ``made`` tokens, with ``left`` more
allowed, will make still (``to_come``). Pure and model-free.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

KEPT = 16  # the latest answers kept: a workload's lengths, learnt again within a few requests when it changes


class AnswerLengths:
    """The new tokens of the latest ``KEPT`` finished requests, each with whether it ended by itself (EOS, a stop
    string) or was cut at its budget. Shared by a pipeline's requests and threads."""

    def __init__(self, answers: Iterable[tuple[int, bool]] = ()):
        self._answers: deque[tuple[int, bool]] = deque(answers, maxlen=KEPT)  # (new tokens, ended by itself)
        self._lock = threading.Lock()

    def add(self, tokens: int, ended: bool) -> None:
        """A request finished with ``tokens`` new tokens; ``ended``: by itself (False: cut at its budget)."""
        with self._lock:
            self._answers.append((int(tokens), bool(ended)))

    def to_come(self, made: int, left: int) -> float:
        """The tokens a request that has made ``made`` and may make ``left`` more will make still: the mean over the
        kept answers that went on past ``made`` of what each made beyond it (at most ``left``), where an answer cut at
        its budget is known only to run past it. Kaplan-Meier's estimate: a cut answer counts among those that may end
        at each length up to its cut, and tells nothing beyond it, so a short run cut at a small budget (a 4-token
        warm-up) does not say that answers run to this one's budget; one cut after the longest that ended runs on to
        this one's. A request that outlived every kept answer is expected to run as long again as it has (at most
        ``left``); with none kept, ``left``: nothing says it ends sooner."""
        with self._lock:
            answers = tuple(self._answers)
        if not answers:
            return float(left)
        if all(tokens <= made for tokens, _ in answers):
            return float(min(made, left))
        horizon, position, surviving, expected = made + left, made, 1.0, 0.0
        for end in sorted({tokens for tokens, ended in answers if ended and tokens > made}):
            if end >= horizon:
                break
            expected += surviving * (end - position)
            position = end
            at_risk = sum(tokens >= end for tokens, _ in answers)  # a cut at ``end`` ran past it: still at risk there
            surviving *= 1 - sum(ended and tokens == end for tokens, ended in answers) / at_risk
        return expected + surviving * (horizon - position)

    def to_list(self) -> list[list]:
        with self._lock:
            return [[tokens, ended] for tokens, ended in self._answers]

    @classmethod
    def from_list(cls, data) -> AnswerLengths:
        """The answers ``to_list`` wrote; ValueError naming what is malformed (a hand-edited or foreign record)."""
        if not isinstance(data, list):
            raise ValueError(f"answers: expected a list, got {type(data).__name__}")
        for entry in data:
            if (not isinstance(entry, list) or len(entry) != 2 or isinstance(entry[0], bool)
                    or not isinstance(entry[0], int) or entry[0] < 0 or not isinstance(entry[1], bool)):
                raise ValueError(f"answers: expected [new tokens >= 0, ended by itself], got {entry!r}")
        return cls((tokens, ended) for tokens, ended in data)
