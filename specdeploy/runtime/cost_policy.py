"""The cost policy: the draft length with the most expected tokens per second, plain decoding included.

It prices a cycle of K drafts with a table of what each call costs on this machine (``Costs``, by batch size, tokens
a row and the past the calls attend over: measured when the pipeline warms its shapes up, then as it runs) and the
acceptance the text has shown (``acceptance``), for each source of drafts apart: the draft model, whose drafts cost
calls, and the sources whose drafts cost only a longer verification: a suffix index, whose drafts each carry an
estimate and are priced row by row (``free_drafts``: the default, the hybrid drafter, weighs them against the draft
model's), and prompt lookup (``next_k(lookup=True)``). Before the draft model drafts, it may have a prompt to catch
up on: ``catchup_pays`` weighs that against what drafting would save over the tokens to come. What it refuses it
re-measures now and then from one exploration budget: a share of the time decoded without that source, halved each
time a "no" is confirmed.

OpenVINO's execution provider pays 8-9 ms for a call whose shape differs from the model's previous call's (the CPU
provider nothing it can measure): the table keeps what a change costs each model (``Costs.change``, measured at warm-up),
its call costs are those of calls that kept their shape, and a cycle whose calls change shape is priced with the
change: a verification of drafts at another length than the last one's, a drafting cycle's first two draft calls.

Each step of the pricing is a pure function below; ``tools/replay.py`` judges the whole on recorded traces.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..values import short
from .policies import CycleOutcome, Policy

# Each chosen by replaying recorded real-pair traces at three cost tables (tools/replay.py; docs/runtime.md).
PRIOR = 0.7  # acceptance a position is assumed to have before the text has shown its own ...
PRIOR_WEIGHT = 4.0  # ... worth this many verified drafts: one rejected first draft must not end drafting for good
DECAY = 0.97  # per cycle, what a text accepted weighs less: a text changes as it goes (a translation's opening words)
BLEND = 0.1  # of each new measurement of a cost, what enters its running value: costs drift slowly (load, cache growth)
EXPLORE_SHARE = 0.05  # of the time decoded without a source, at most this spent re-measuring it; halved per "no"
# a suffix index's estimate of a draft, in buckets (upper edges) that each learn how often the target keeps one
ESTIMATE_EDGES = (0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.95)
# a call's cost by the past it attends over, in bands that double from this width (0-63, 64-127, 128-255, ...): how
# much a longer verification adds depends on it (a mixture's T = 3 costs 2.2x its T = 1 after 10 tokens, 1.4x after
# 384), and a request starting after a long one would otherwise price its first cycles at the long one's costs
PAST_BAND = 64

# whose acceptance is counted by position: the draft model, or prompt lookup (no model call, no estimates; a suffix
# index's drafts are counted by their estimates instead: ``calibrated``)
SOURCES = ("model", "lookup")


@dataclass
class Costs:
    """Seconds of each call on this machine by (batch, tokens a row), at every past together and by past band
    (``band``): what the cost policy prices a cycle with. One table per pipeline (its engines' costs), shared by its
    requests and kept across processes (``to_dict``)."""

    verify: dict[tuple[int, int], float] = field(default_factory=dict)  # target calls keeping every position's logits
    draft: dict[tuple[int, int], float] = field(default_factory=dict)  # draft calls keeping the last position's:
    # 1 token (a cycle's later drafts), 2 (its first call, after a drafting cycle), many (a catch-up)
    by_past: dict[tuple[str, int], dict[tuple[int, int], float]] = field(default_factory=dict)  # ("verify" or
    # "draft", band): the same calls measured at that band's pasts
    change: dict[str, float] = field(default_factory=dict)  # "verify" or "draft": what that model's call pays when its
    # (batch, tokens) differs from its previous call's, beyond the tables' costs (calls that kept their shape); absent:
    # not measured yet (``calibration.Calibration.warm_up`` measures it)

    def learn(self, name: str, key: tuple[int, int], seconds: float, past: int | None = None) -> None:
        """Blend a measurement of a ``name`` ("verify" or "draft") call into its table (the first is taken whole), and
        into its band's table where the call's ``past`` is known."""
        tables = [getattr(self, name)] + ([self.by_past.setdefault((name, band(past)), {})] if past is not None else [])
        for table in tables:
            table[key] = seconds if key not in table else (1 - BLEND) * table[key] + BLEND * seconds

    def table(self, name: str, batch: int, past: int | None) -> dict[tuple[int, int], float]:
        """The ``name`` calls to price ``batch`` rows at ``past`` by: the nearest band to the past's (its own first)
        that has measured two sizes at that batch (a line through them is that band's cost), else every past's."""
        if past is None:
            return getattr(self, name)
        shaped = [b for (kind, b), table in self.by_past.items()
                  if kind == name and sum(rows == batch for rows, _ in table) >= 2]
        here = band(past)
        return self.by_past[name, min(shaped, key=lambda b: (abs(b - here), b))] if shaped else getattr(self, name)

    def at(self, batch: int, past: int | None) -> Costs:
        """The tables ``table`` picks for ``batch`` rows at ``past``, as a table of their own: a cycle's prices read
        each call's cost there without looking for the band again."""
        return Costs(self.table("verify", batch, past), self.table("draft", batch, past), change=self.change)

    def verify_cost(self, batch: int, tokens: int, past: int | None = None) -> float | None:
        """A target call of ``tokens`` a row at ``batch`` rows after ``past`` (``call_seconds``; None: whatever the
        past), its shape kept; None: nothing measured."""
        return call_seconds(self.table("verify", batch, past), batch, tokens)

    def draft_cost(self, batch: int, k: int, past: int | None = None) -> float | None:
        """The draft calls of a cycle of ``k`` drafts: a first call of two tokens, then k - 1 of one, with the changes
        of shape they make (``draft_changes``)."""
        if k == 0:
            return 0.0
        table = self.table("draft", batch, past)
        first, later = call_seconds(table, batch, 2), call_seconds(table, batch, 1)
        return None if first is None else first + (k - 1) * later + draft_changes(k) * self.change.get("draft", 0.0)

    def catchup_cost(self, batch: int, tokens: int, past: int | None = None) -> float | None:
        """The draft catching up on ``tokens`` (all ``batch`` rows together), as one call of their share a row."""
        seconds = call_seconds(self.table("draft", batch, past), batch, max(1, -(-tokens // batch)))
        return None if seconds is None else seconds + self.change.get("draft", 0.0)

    def to_dict(self) -> dict:
        return {name: _entries(table) for name, table in (("verify", self.verify), ("draft", self.draft))} | {
            "by_past": [[name, b, _entries(table)] for (name, b), table in sorted(self.by_past.items())],
            "change": dict(sorted(self.change.items()))}

    @classmethod
    def from_dict(cls, data) -> Costs:
        """The table ``to_dict`` wrote (one without ``by_past``, as before 0.6, or without ``change``, written before
        that was measured, too); ValueError naming what is malformed (a hand-edited or foreign record)."""
        if not isinstance(data, dict):
            raise ValueError(f"costs: expected an object, got {type(data).__name__}")
        tables = [_table(f"costs.{name}", data.get(name, [])) for name in ("verify", "draft")]
        by_past = data.get("by_past", [])
        if not isinstance(by_past, list):
            raise ValueError(f"costs.by_past: expected a list, got {type(by_past).__name__}")
        bands = {}
        for entry in by_past:
            if (not isinstance(entry, list) or len(entry) != 3 or entry[0] not in ("verify", "draft")
                    or type(entry[1]) is not int or not 0 <= entry[1] <= 64):
                raise ValueError(f"costs.by_past: got {short(entry)}; expected [\"verify\" or \"draft\", band 0-64, "
                                 "[[batch, tokens, seconds], ...]]")
            bands[entry[0], entry[1]] = _table(f"costs.by_past.{entry[0]}", entry[2])
        change = data.get("change", {})
        if not isinstance(change, dict) or not set(change) <= {"verify", "draft"}:
            raise ValueError(f"costs.change: got {short(change)}; expected {{\"verify\" or \"draft\": seconds}}")
        return cls(*tables, bands, {name: _seconds(value, zero=True) for name, value in change.items()})


def draft_changes(k: int) -> int:
    """Changes of the draft's shape in a cycle of ``k`` drafts: its first call (two tokens, after the last cycle's
    one-token calls) and its second (one token, after the two)."""
    return min(k, 2)


def band(past: int) -> int:
    """The band of a call after ``past`` tokens: 0 below PAST_BAND, then one more each time the past doubles."""
    return max(0, past // PAST_BAND).bit_length()


def call_seconds(table: dict[tuple[int, int], float], batch: int, tokens: int) -> float | None:
    """A call of ``tokens`` a row at ``batch`` rows: measured, else a line through the sizes measured at that batch,
    else the nearest batch's line with calls of several tokens scaled by the rows (the fused form runs such a batch
    row by row: the dearest it can be), at this batch's level where it has one size measured. None: nothing measured."""
    if (batch, tokens) in table:
        return table[batch, tokens]
    own = {t: v for (b, t), v in table.items() if b == batch}
    if len(own) >= 2:
        return _line(own, tokens)
    sizes = [b for b, _ in table]
    shaped = {b for b in sizes if b != batch and sizes.count(b) >= 2}
    if not shaped:  # one point at most: flat (drafting looks cheap, and drafting measures it)
        return next(iter(own.values()), next(iter(table.values()), None))
    nearest = min(shaped, key=lambda b: (abs(b - batch), b))

    def scaled(t: int) -> float:
        return call_seconds(table, nearest, t) * (batch / nearest if t > 1 else 1.0)

    (t0, v0), = own.items() if own else ((1, scaled(1)),)
    return scaled(tokens) * v0 / scaled(t0)


def acceptance(tried: Sequence[float], kept: Sequence[float], prior: float = PRIOR, weight: float = PRIOR_WEIGHT) -> list[float]:
    """a_i, the rate draft i is kept given drafts 1..i-1 were, i = 1..len(tried), from decayed counts of drafts
    verified (``tried``) and kept at each position; each shrunk towards the one before it (a_1 towards ``prior``)
    by ``weight`` drafts' worth: a position seldom verified inherits its neighbour's rate."""
    rates, previous = [], prior
    for k, t in zip(kept, tried):
        previous = (k + weight * previous) / (t + weight)
        rates.append(previous)
    return rates


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """E[tokens | K = k] = sum_{j = 0..k} prod_{i <= j} a_i: the drafts kept and the token after them."""
    return sum(math.prod(rates[:j]) for j in range(k + 1))


def cycle_prices(costs: Costs, batch: int, k: int, model: bool, past: int | None = None,
                 last: tuple[int, int] | None = None) -> list[float] | None:
    """Seconds of a cycle of K = 0..k drafts at ``batch`` rows after ``past`` tokens (None: whatever the past): the
    draft calls (``model``: the drafts cost draft calls, prompt lookup's and the index's none) and a verification of
    K + 1, with the change of shape where it verifies drafts at another shape than ``last`` (the target's previous
    call's (batch, tokens), a verification of drafts too; None: not known). None: a cost is not measured.

    A change between plain decoding and drafting is not priced: it starts a stretch of one or the other, and priced on
    the one cycle, it kept the policy where it was, drafting on where acceptance had fallen (replayed at OpenVINO's
    table: 0.985-0.991x the geomean of pricing no change). Between drafting lengths it steadies the length:
    1.006-1.010x, the lowest group from 0.94x plain to 0.99x (docs/results/openvino/, Round four)."""
    costs, out = costs.at(batch, past), []  # the band chosen once, not for each K
    change = costs.change.get("verify", 0.0) if last is not None and last[1] > 1 else 0.0
    for drafts in range(k + 1):
        verify = costs.verify_cost(batch, drafts + 1)
        if verify is not None and drafts and (batch, drafts + 1) != last:
            verify += change
        draft = costs.draft_cost(batch, drafts) if model else 0.0
        if verify is None or draft is None:
            return None
        out.append(draft + verify)
    return out


def expected_rates(rates: Sequence[float], prices: Sequence[float] | None) -> list[float] | None:
    """Expected tokens per second a row for K = 0..len(rates): E[tokens | K] / the cycle's seconds (``cycle_prices``,
    at least len(rates) + 1 of them; Leviathan et al. 2023). None: the prices are not known."""
    if prices is None:
        return None
    out, tokens, survive = [], 0.0, 1.0
    for k in range(len(rates) + 1):
        tokens, survive = tokens + survive, survive * rates[k] if k < len(rates) else survive  # E[tokens | K = k]
        out.append(tokens / prices[k])
    return out


def best_k(rates: Sequence[float]) -> int:
    """The K of the highest rate, the fewest drafts on a tie."""
    return max(range(len(rates)), key=lambda k: (rates[k], -k))


class CostPolicy(Policy):
    """For each source of drafts, the K with the most expected tokens per second (``expected_rates``); a source
    whose best K is 0, or lookup that does not beat the model, drafts only when the exploration budget pays for it."""

    def __init__(self, k: int, costs: Costs | None = None):
        self.k, self.costs = k, costs if costs is not None else Costs()
        self.tried = {source: [0.0] * k for source in SOURCES}  # decayed drafts verified, by source and position
        self.kept = {source: [0.0] * k for source in SOURCES}
        self.budget = dict.fromkeys(SOURCES, 0.0)  # seconds each source may lose to being re-measured
        self.share = dict.fromkeys(SOURCES, EXPLORE_SHARE)
        self.exploring: dict[str, float | None] = dict.fromkeys(SOURCES)  # an outstanding re-measure: what it may lose
        self._rates: dict[tuple[str, int], list[float] | None] = {}  # ``rates`` until the next observation
        self._prices: dict[tuple[int, bool], list[float] | None] = {}  # ``cycle_prices`` until then: a batch's rows share them
        self.index_tried = [0.0] * (len(ESTIMATE_EDGES) + 1)  # decayed suffix drafts verified, by estimate bucket
        self.index_kept = [0.0] * (len(ESTIMATE_EDGES) + 1)
        self.past: int | None = None  # the past the next cycle's calls attend over (``at_past``); None: not told
        # the target's latest call heard of, (batch, tokens a row): at first, the prompt's prefill, a shape of its own
        self.last_call = (0, 0)

    def acceptance(self, source: str) -> list[float]:
        return acceptance(self.tried[source], self.kept[source])

    def rates(self, source: str, batch: int) -> list[float] | None:
        """Expected tokens per second a row for K = 0..k drafted by ``source`` at ``batch`` rows (priced once a cycle:
        a decision is made at every cycle, and on a GPU a cycle is a few milliseconds)."""
        key = (source, batch)
        if key not in self._rates:
            self._rates[key] = expected_rates(self.acceptance(source), self.prices(batch, source == "model"))
        return self._rates[key]

    def prices(self, batch: int, model: bool) -> list[float] | None:
        """``cycle_prices`` for K = 0..k at ``batch``, priced once a cycle (the costs learn at each observation)."""
        key = (batch, model)
        if key not in self._prices:
            self._prices[key] = cycle_prices(self.costs, batch, self.k, model, self.past, self.last_call)
        return self._prices[key]

    def at_past(self, past: int) -> None:
        if self.past is None or band(past) != band(self.past):  # priced at another band's costs until now
            self._rates.clear()
            self._prices.clear()
        self.past = past

    def next_k(self, batch: int, lookup: bool = False) -> int:
        source = SOURCES[lookup]
        rates = self.rates(source, batch)
        if rates is None or not self.k:  # costs not measured yet (no warm-up): drafting is how they are measured
            return self.k
        # what a row does otherwise: plain decoding, or for a lookup, the model's drafts (a row has one source a cycle;
        # without a draft model, the model's calls have no price)
        model = self.rates("model", batch) if lookup else None
        otherwise = max(model) if model else rates[0]
        best = best_k(rates)
        if best and rates[best] >= otherwise:
            return best
        trial = best or best_k(rates[1:]) + 1
        tokens = expected_tokens(self.acceptance(source), trial)
        return trial if self._affords(source, tokens / rates[trial] - tokens / otherwise) else 0

    def index_k(self, batch: int) -> int:
        return self.k  # each row's own count is priced from its drafts' estimates (``free_drafts``)

    def calibrated(self, estimate: float) -> float:
        """The rate the target keeps a suffix draft the index estimated at ``estimate``: the decayed counts of drafts
        estimated alike, shrunk towards the estimate itself by PRIOR_WEIGHT drafts' worth."""
        bucket = bisect.bisect(ESTIMATE_EDGES, estimate)
        return (self.index_kept[bucket] + PRIOR_WEIGHT * estimate) / (self.index_tried[bucket] + PRIOR_WEIGHT)

    def free_drafts(self, batch: int, estimates: Sequence[float], model: bool) -> int:
        rates = expected_rates([self.calibrated(e) for e in estimates], self.prices(batch, model=False))
        if rates is None:  # costs not measured yet: drafting is how they are measured
            return len(estimates)
        modelled = self.rates("model", batch) if model else None
        otherwise = max(modelled) if modelled else rates[0]
        best = best_k(rates)
        return best if best and rates[best] >= otherwise else 0

    def catchup_pays(self, batch: int, behind: int, to_come: float) -> bool:
        rates = self.rates("model", batch)
        price = self.costs.catchup_cost(batch, behind, self.past)
        if behind <= 0 or price is None or rates is None:
            return True  # nothing to pay, or its price unknown: drafting is how it gets measured
        saving = to_come / batch * (1 / rates[0] - 1 / max(rates))  # a batch's token takes 1 / (rate * rows) s
        loss = price - saving
        return loss <= 0 or self._affords("model", loss)

    def _affords(self, source: str, loss: float) -> bool:
        """Whether the budget pays to re-measure a refused ``source`` at a modelled ``loss`` (seconds); paid (and
        judged) once that source has drafted (a lookup may find no match to draft from)."""
        if loss > self.budget[source]:
            return False
        self.exploring[source] = max(loss, 0.0)
        return True

    def observe(self, outcome: CycleOutcome) -> None:
        self._rates.clear()
        self._prices.clear()
        self._learn_costs(outcome)
        if not outcome.verify_tokens:
            return
        estimates = outcome.estimates or [None] * len(outcome.drafted)
        self._calibrate([(e, n) for e, n in zip(estimates, outcome.accepted) if e])
        # the model's rows drafted by calls; prompt lookup's are the free rows without estimates (an index's have them)
        for source, free_rows in zip(SOURCES, (False, True)):
            rows = [(d, n) for d, n, free, e in zip(outcome.drafted, outcome.accepted, outcome.free, estimates)
                    if d and free == free_rows and not e]
            self._count(source, rows)  # plain cycles too: a refused source is forgotten as the text moves on
            if not rows:  # time this source did not draft: a share of it pays for re-measuring it
                self.budget[source] += self.share[source] * outcome.verify_seconds
            elif self.exploring[source] is not None:  # re-measured: still refused halves its share, paying resets it
                self.budget[source] -= self.exploring[source]
                self.exploring[source] = None
                rates = self.rates(source, outcome.batch)
                pays = rates is not None and best_k(rates) > 0
                self.share[source] = EXPLORE_SHARE if pays else self.share[source] / 2

    def _count(self, source: str, rows: list[tuple[int, int]]) -> None:
        tried, kept = self.tried[source], self.kept[source]
        for i in range(self.k):
            tried[i] *= DECAY
            kept[i] *= DECAY
        for drafted, accepted in rows:
            for i in range(min(accepted + 1, drafted)):  # drafts 1..n kept, n + 1 rejected (if it was drafted)
                tried[i] += 1
                kept[i] += i < accepted

    def _calibrate(self, rows: list[tuple[Sequence[float], int]]) -> None:
        """Index rows' drafts (their estimates, drafts kept): each bucket hears the drafts verified in it."""
        tried, kept = self.index_tried, self.index_kept
        for i in range(len(tried)):
            tried[i] *= DECAY
            kept[i] *= DECAY
        for estimates, accepted in rows:
            for i, estimate in enumerate(estimates[: accepted + 1]):  # drafts 1..n kept, n + 1 rejected
                bucket = bisect.bisect(ESTIMATE_EDGES, estimate)
                tried[bucket] += 1
                kept[bucket] += i < accepted

    def _learn_costs(self, outcome: CycleOutcome) -> None:
        """Each call's cost into the table, less what a change of shape cost it (``Costs.change``): a cycle's first
        draft call and its second change the draft's shape, as ``draft_cost`` prices them."""
        costs, batch, past = self.costs, outcome.batch, outcome.past
        draft_change, verify_change = costs.change.get("draft", 0.0), costs.change.get("verify", 0.0)
        if outcome.first_call_tokens:
            costs.learn("draft", (batch, outcome.first_call_tokens), _less(outcome.first_call_seconds, draft_change), past)
        if outcome.later_calls:
            later = _less(outcome.later_call_seconds, draft_change)
            costs.learn("draft", (batch, 1), later / outcome.later_calls, past)
        if outcome.verify_tokens:
            shape = (batch, outcome.verify_tokens)
            changed = self.last_call != shape
            costs.learn("verify", shape, _less(outcome.verify_seconds, verify_change if changed else 0.0), past)
            self.last_call = shape


def _line(points: dict[int, float], tokens: int) -> float:
    """v(tokens) from measured points: a least-squares line, kept to what more tokens cannot cost less than: never
    below the cheapest point from the smallest size measured on, never above it below that size (nor under that
    point's share of those tokens). A one-token call priced from a past band where only drafting cycles were measured
    (two tokens and more) is a one-token call, not the cheapest of them: priced as a two-token call, plain decoding
    looked dear, the model drafted every cycle and no one-token call came to correct it."""
    mean_t, mean_v = sum(points) / len(points), sum(points.values()) / len(points)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points.items()) / sum((t - mean_t) ** 2 for t in points)
    line, smallest, cheapest = mean_v + slope * (tokens - mean_t), min(points), min(points.values())
    if tokens < smallest:
        return min(max(line, cheapest * tokens / smallest), cheapest)
    return max(line, cheapest)


def _less(seconds: float, change: float) -> float:
    """A call's ``seconds`` less what its change of shape cost, still a time (a call quicker than the table's
    change cost, on a noisy host, is taken as a microsecond)."""
    return max(seconds - change, 1e-6) if change else seconds


def _entries(table: dict[tuple[int, int], float]) -> list[list]:
    return [[b, t, v] for (b, t), v in sorted(table.items())]


def _table(where: str, entries) -> dict[tuple[int, int], float]:
    """A table ``_entries`` wrote; ValueError naming ``where`` it is malformed."""
    if not isinstance(entries, list):
        raise ValueError(f"{where}: expected a list, got {type(entries).__name__}")
    table = {}
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 3:
            raise ValueError(f"{where}: got {short(entry)}; expected [batch, tokens, seconds]")
        table[_count(entry[0]), _count(entry[1])] = _seconds(entry[2])
    return table


def _count(value) -> int:
    """A positive integer, or its digits (at most 18: a count, never a number too long to read)."""
    if isinstance(value, str) and value.isdigit() and len(value) <= 18:
        value = int(value)
    if type(value) is not int or value < 1:  # a bool is no count
        raise ValueError(f"costs: got {short(value)}; expected a positive integer")
    return value


def _seconds(value, zero: bool = False) -> float:
    """A positive finite time in seconds (``zero``: or none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value if zero else 0 < value) \
            or not value < math.inf:
        kind = "non-negative" if zero else "positive"
        raise ValueError(f"costs: got {short(value)}; expected a {kind} finite time in seconds")
    return float(value)
