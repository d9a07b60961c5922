"""The cost-model policy: the K that maximises expected tokens per second, weighing the draft's catch-up.

Registered as "cost" (``--policy cost``) when ``policies`` imports it. Its estimates (acceptance per position,
draft and verification costs per batch size, the catch-up's rate) and when it re-measures them are documented
on the class; ``remembered`` / ``recall`` carry the costs to a later process (``calibration``).
"""

from __future__ import annotations

import numpy as np

from .policies import CycleOutcome, Policy


class CostModel(Policy):
    """Pick the K that maximises expected tokens per second, K = 0 (plain decoding) included.

    It keeps running estimates of
    - a_i, the rate at which draft i is accepted given drafts 1..i-1 were (decayed counts),
    - c_d, the time of one draft step, and v(T), the time of a target call over T tokens,
    and chooses argmax_K E[tokens | K] / (K c_d + v(K + 1)), with E[tokens | K] = 1 + sum_{j<=K}
    prod_{i<=j} a_i (Leviathan et al. 2023, per-position). While K = 0 wins it probes with the
    best K > 0 every ``probe_every`` cycles, so it notices when speculation starts to pay again.

    Before the first draft, a draft model must catch up on the whole prompt, a cost no later
    saving recovers when the prompt is long and the output short (Spec-Bench's summarization prompts).
    Given a ``plan``, the first cycle decodes plainly to measure v(1), and speculation starts only
    if an optimistic saving over the tokens to come (every draft accepted at ``optimism``) repays
    the estimated catch-up twice; otherwise the request stays plain, without probes (each would pay it).

    In a server, rows join a running batch: the draft's prefill of their prompts is a catch-up like
    any other, and under load it can cost more than speculation saves (a 0.5B int4 draft prefills at
    nearly the 1.5B int8 target's cost per token on a CPU). ``catchup_pays`` weighs it with the costs
    measured at that batch size and the catch-up's measured seconds per token: the scheduler skips
    the draft's prefill of joining rows when it does not pay, and a cycle stays plain rather than pay it.
    A "no" is paid now and then all the same (``revisit_budget``), or a sample of a long catch-up (``catchup_sample``):
    only the draft's calls re-measure what said no.

    Acceptance belongs to the text, and a text changes as it goes (an answer's opening words, then its translation
    or its code): a text's first drafts are measured at the K that pays best at ``optimism`` (``explore_k``), from a
    prior at that optimism, and a single row's refused catch-up is paid to probe the text again while it costs at
    most ``probe_share`` of what drafting would save over the tokens to come at ``optimism``, a share halved by
    each probe in a row that left the "no" standing. Each of these was chosen by replaying recorded
    texts through the runtime at measured costs (``tools/replay.py``; README, Measuring).

    The first call at a new shape is cold (ONNX Runtime plans and allocates its buffers): on the real
    pair the first verification of 5 tokens took 68 ms, the next ones 47-50 ms, and a first plain step
    at 3 rows 94 ms against ~45. A cost's first measurement in a process counts no more than the estimate
    it replaces (recalled, or the nearest batch size's), then the lower of the first two counts, later
    ones blend in (``_learn``); and a verify size measured only once is priced no higher than the sizes
    measured since suggest, so one cold call cannot rule its K (or plain decoding) out for good. The record a
    process leaves (``remembered``) says which sizes rest on one call, and the next process caps them the same way.
    """

    name = "cost"
    plans = True
    weighs_catchup = True
    optimism = 0.8  # acceptance assumed per position when judging a catch-up before any was measured
    close = 0.8  # plain within this fraction of the best rate: re-measured every 2 * probe_every drafting cycles
    carried_cycles = 8  # the weight of an earlier request's acceptance in a new one's (``inherit``)
    rate_tokens = 16  # catch-ups of fewer tokens do not teach ``catchup_rate``
    revisit_share = 0.05  # of the time decoded plainly, at most this modelled to be lost re-measuring a "no"
    revisit_halvings = 4  # ... halved after each revisit that left the "no" standing, down to 1/16 of it
    sample_tokens = 32  # of each row's catch-up, what a revisit pays to re-measure its rate (``catchup_sample``)
    first_call_most = 3.0  # a first draft call measured dearer than this many later ones is a stall, not its cost
    probe_share = 0.2  # of what drafting would save if the text now accepted at ``optimism``, at most this paid to probe
    doubt = 1.0  # standard errors of benefit of the doubt a text's acceptance gets before drafting is ruled out ...
    settled = 6  # ... while fewer first drafts than this have been verified (decayed count): then the estimate rules

    def __init__(self, k_max: int, start: int | None = None, decay: float = 0.97, prior: float | None = None,
                 probe_every: int = 16):
        self.k_max = k_max
        self.start = min(start if start is not None else k_max, k_max)
        # a_1 before a text's first drafts: the optimism its first catch-up was judged at (at 0.5, two rejected first
        # drafts of a translation whose draft agreed on 84 % of it kept it plain for good: tools/replay.py)
        self.decay, self.prior, self.probe_every = decay, self.optimism if prior is None else prior, probe_every
        self.tried = np.zeros(k_max + 1)  # index i: times draft i was verified (index 0 unused)
        self.kept = np.zeros(k_max + 1)
        self.draft_step: float | None = None  # a draft call after a cycle's first
        # The first draft call of a cycle feeds the tokens the last cycle committed (its last kept draft and the
        # target's token: 2), the later calls one each: its cost over a later call's, measured in cycles of 2 or
        # more drafts. Priced as a later one, 1-draft cycles measured the 2-token call (17.4-18.6 ms against 16.3 on
        # the real pair, the first 1.12-1.16x a later one) and priced every K by it: K = 1 went on looking best, by
        # a near-tie, while fixed K = 4 ran 4-7 % faster (tools/load_test.py, one client).
        self.first_call = 1.0
        self.verify: dict[int, float] = {}
        self.plain_streak = self.draft_streak = 0
        self.pending_catchup: tuple[float, int, float] | None = None  # (seconds, tokens to come, draft/target cost)
        self.plain_only = False
        self.cost_ratio: float | None = None  # a draft step's cost over a target step's, by parameters (``plan``)
        # A cycle's costs depend on how many rows share it (a server's batch grows and shrinks): draft_step
        # and verify are the running batch size's; the other sizes' are kept here.
        self.batch = 1
        self.measured: set = set()  # what has been measured at this batch size: "draft", verify sizes
        self.by_batch: dict[int, tuple[float | None, dict[int, float], set]] = {}
        self.catchup_rate: float | None = None  # seconds per token the draft catches up on (all rows together)
        # decoded plainly at each batch size since its last drafting cycle (``catchup_pays`` revisits a "no" there)
        self.plain_seconds: dict[int, float] = {}
        self.exploring = False  # the next drafting cycle measures acceptance at ``explore_k()`` drafts (``recall``)
        self.revisits_lost = 0  # revisits in a row whose drafting left the "no" standing (``_revisit``)
        self.revisit_measured: bool | None = None  # a revisit outstanding: has a drafting cycle measured it yet?
        self.sample_due = 0  # tokens of each row's catch-up a revisit asks to be paid now (``catchup_sample``)
        self.probes_lost = 0  # probes of this text in a row whose drafting left the "no" standing (``catchup_pays``)
        self.probe_measured: bool | None = None  # a probe outstanding: has a drafting cycle measured it yet?
        # measurements taken in this process, by (batch size, "draft" | verify tokens | "catchup"): the first is cold
        self.samples: dict[tuple[int, int | str], int] = {}
        self.firsts: dict[tuple[int, int | str], float] = {}  # first measurements, until the second comes
        # (batch size, verify tokens) an earlier process measured twice or more (``recall``), or this one before a
        # ``_revisit``: warm, though this process has not measured them twice
        self.trusted: set[tuple[int, int]] = set()

    def plan(self, catchup_seconds: float, new_tokens: int, draft_cost_ratio: float) -> None:
        """Before the first cycle: the draft's estimated catch-up time, the tokens to generate, and a
        draft step's cost relative to a target step (the models' parameter ratio)."""
        self.cost_ratio = draft_cost_ratio
        if catchup_seconds > 0:
            self.pending_catchup = (catchup_seconds, new_tokens, draft_cost_ratio)

    def _catchup_pays(self) -> bool:
        """Would the best K, all at ``optimism``, save more than the catch-up costs over the tokens to come?"""
        seconds, tokens, ratio = self.pending_catchup
        v1 = self.verify[1]  # the only cost measured yet: verify_cost extrapolates from it
        best = float(self.expected_rate(np.full(self.k_max, self.optimism), ratio * v1).max())
        # The estimate scales the target's prefill by the parameter ratio, which undercounts a draft whose
        # kernels prefill slower per parameter than the target's (int4 beside int8 GEMM; README, Measuring):
        # the saving must repay the estimate twice over.
        return tokens * (v1 - 1 / best) > 2 * seconds

    def acceptance(self, doubt: float = 0.0) -> np.ndarray:
        """Estimated conditional acceptance a_i for i = 1..k_max.  # [k_max]

        Each rate is shrunk towards the one before it (a_1 towards ``prior``): a position seldom
        verified inherits its neighbour's rate, so positions never tried are neither dismissed nor
        over-trusted. With ``doubt``, each rate is raised by that many standard errors of a rate
        measured over its (decayed) count of verified drafts: what the text may still turn out to accept.
        """
        rates, previous = [], self.prior
        for kept, tried in zip(self.kept.tolist()[1:], self.tried.tolist()[1:]):
            previous = (kept + previous) / (tried + 1.0)
            rates.append(previous)
        rates = np.array(rates)
        if doubt:
            rates = np.minimum(rates + doubt * np.sqrt(rates * (1 - rates) / (self.tried[1:] + 1.0)), 1.0)
        return rates

    def verify_cost(self, tokens: int) -> float:
        """v(T) at this batch size: measured where known, else a least-squares line through the measured
        points, else what the size started from (``_estimates``); never more than a longer call was measured to
        cost (a cold first call at a new shape can come out dearer). A size measured once in this process (its
        cold call) costs no more than a line through two sizes measured twice or more suggests.

        Another size's estimates never cap this size's measurements: 2 rows verify row by row in the fused form,
        and one row's v(5) capping them made K = 2 look as cheap at 2 rows as alone."""
        return self.verify_costs(tokens)[-1]

    def verify_costs(self, most: int) -> list[float]:
        """v(1) .. v(``most``), each as ``verify_cost`` prices it, in one pass: the policy prices every K at every cycle.
        Priced one T at a time, a decision took 92 us and a catch-up judgement 218 us of CPU on a 2-core machine (0.92 and
        0.32 ms of a server's cycle in wall time): little beside a CPU's 95 ms target step, much beside a GPU's few ms."""
        own = {t: v for t, v in self.verify.items() if t in self.measured}
        warm = {t: v for t, v in own.items() if self._warm(t)}
        warm_line = _fit(warm) if len(warm) >= 2 else None
        start_line = None
        cap = min((v for t, v in own.items() if t > most), default=np.inf)  # the cheapest longer call measured
        costs = [0.0] * most
        for tokens in range(most, 0, -1):
            if tokens in own:  # measured; once only (cold): no dearer than the warm sizes' line suggests
                cost = own[tokens] if tokens in warm or warm_line is None else min(warm_line(tokens), own[tokens])
            elif warm_line is not None:
                cost = warm_line(tokens)
            elif tokens in self.verify:  # started from
                cost = self.verify[tokens]
            else:  # this size's points and those it started from
                start_line = start_line or _fit(self.verify)
                cost = start_line(tokens)
            costs[tokens - 1] = min(cost, cap)
            cap = min(cap, own.get(tokens, np.inf))
        return costs

    def _warm(self, tokens: int, batch: int | None = None) -> bool:
        """Does v(``tokens``) at ``batch`` rows (default: this batch size) rest on more than one call, the first at its
        shape being cold? Measured twice in this process, or recalled as measured twice: two first calls, each cold in
        its own process, are not."""
        key = (self.batch if batch is None else batch, tokens)
        return self.samples.get(key, 0) >= 2 or key in self.trusted

    def expected_rate(self, acceptance: np.ndarray | None = None, draft_step: float | None = None) -> np.ndarray:
        """Expected tokens per second for K = 0..k_max (from the estimates, or the ones given).  # [k_max + 1]

        On Python floats: NumPy's cost per call over k_max + 1 values was most of a decision's time."""
        rates = (self.acceptance() if acceptance is None else acceptance).tolist()
        step = (self.draft_step if draft_step is None else draft_step) or 0.0
        first = (self.first_call - 1.0) * step  # what the first call costs beyond a later one
        verify = self.verify_costs(self.k_max + 1)
        out, survive, tokens = [], 1.0, 0.0
        for k in range(self.k_max + 1):
            if k:
                survive *= rates[k - 1]
            tokens += survive  # E[tokens | K] = sum_{j=0..K} survive_j
            out.append(tokens / ((k * step + first if k else 0.0) + verify[k]))
        return np.array(out)

    def next_k(self) -> int:
        if self.plain_only:
            return 0
        if self.pending_catchup is not None:
            if 1 not in self.verify:
                return 0  # one plain step measures v(1) before the catch-up is paid
            # Judged from the parameter ratio, a "no" is final: each probe would pay the catch-up at an unknown
            # price. Once the catch-up's rate is known (recalled), ``catchup_pays`` weighs it at each drafting
            # cycle instead, and now and then pays a "no" to re-measure (``_revisit``): a "no" from costs an
            # earlier process measured too high (a cold call at a size it rarely ran) would otherwise stand for
            # good, in every later process (make demo's prompt: 125 of 128 tokens decoded plainly, 0.81x).
            self.plain_only = not self._catchup_pays() and self.catchup_rate is None
            self.pending_catchup = None
            if self.plain_only:
                return 0
            # then as any cycle: with costs known from an earlier request (``inherit``), the best K
        if self.draft_step is None or not self.verify:
            if self.verify and self.cost_ratio:  # a draft step priced as its share of the target's parameters
                return self.explore_k(self.cost_ratio * self.verify_cost(1))
            return self.start  # nothing measured yet: speculate to learn the costs
        if self.exploring:
            return self.explore_k()
        if 1 not in self.measured and "draft" in self.measured:
            return 0  # one plain step measures v(1) at this batch size: extrapolated, it comes out too dear
        rates = self.expected_rate()
        best = int(np.argmax(rates))
        if best == 0 and self.k_max > 0:
            # Plain decoding is chosen early only where drafting loses even with the benefit of the doubt: two
            # cycles are too few to rule it out. On make demo's prompt the first drafts were all rejected and the second
            # cycle kept 4 of 8 (a_1 0.50): decided there, the request stayed plain at 0.92x plain decoding's
            # speed for the 125 cycles left (its probes each refused their catch-up), where fixed K = 4 ran 1.4x.
            hopeful = self.expected_rate(self.acceptance(self.doubt)) if self.tried[1] < self.settled else rates
            if hopeful[1:].max() > hopeful[0]:
                best = int(np.argmax(hopeful[1:])) + 1
        if best == 0 and self.k_max > 0:
            self.plain_streak += 1
            if self.plain_streak >= self.probe_every:
                self.plain_streak = 0
                return int(np.argmax(rates[1:])) + 1
        else:
            self.plain_streak = 0
            self.draft_streak += 1
            # v(1) is measured only by plain steps: while drafting wins narrowly, one now and then keeps it
            # current, so that one dear measurement does not keep the policy drafting for good
            if self.draft_streak >= 2 * self.probe_every and rates[0] >= self.close * rates[best]:
                self.draft_streak = 0
                return 0
        return best

    def explore_k(self, draft_step: float | None = None) -> int:
        """Drafts of the first cycle that measures a text's acceptance: the K that pays best if the text accepts at
        ``optimism``, by this machine's costs; ``draft_step``: its price before it is measured. A fixed 4 drafts
        cost a 5-token verification, 2.4x a plain step on an AVX2 CPU where only K = 1 pays at that optimism,
        wherever the first draft was rejected."""
        rates = self.expected_rate(np.full(self.k_max, self.optimism), draft_step)
        return int(np.argmax(rates[1:])) + 1 if self.k_max > 0 else 0

    def catchup_pays(self, batch: int, behind: int, to_come: int) -> bool:
        if behind <= 0 or self.catchup_rate is None:
            return True  # nothing to pay, or its price unknown: drafting is how it gets measured
        saved = self.batch, self.draft_step, self.verify, self.measured
        self.draft_step, self.verify, self.measured = self._estimates(batch)  # a look, not a switch
        self.batch = batch
        try:
            if self.draft_step is None or not self.verify:
                return True
            # tokens per row per second, K = 0..k_max; before this request has verified any draft (costs recalled
            # from an earlier process, acceptance not), at ``optimism``, as ``plan`` judged its first catch-up
            unseen = not self.tried[1:].any()
            hoped = self.expected_rate(np.full(self.k_max, self.optimism))
            rates = hoped if unseen else self.expected_rate()
        finally:
            self.batch, self.draft_step, self.verify, self.measured = saved
        saving = to_come * (1 / rates[0] - 1 / rates[1:].max()) / batch  # a batch-token takes 1 / (rate * rows) s
        # both sides measured (a cycle spends ~0.1 ms beside its engine calls on the real pair): no margin, unlike
        # ``plan``'s estimate from the parameter ratio. Twice over, the load test's lone client stayed plain
        # where drafting made it 7 % faster.
        cost = behind * self.catchup_rate
        if saving > cost:
            self.revisits_lost, self.revisit_measured = 0, None
            self.probes_lost, self.probe_measured = 0, None
            return True
        if unseen and cost <= self.revisit_share * to_come / (rates[0] * batch):
            # Nothing of this text's acceptance is known, and the catch-up costs little beside the plain decoding
            # to come: pay it to measure (the drafting costs it was judged with may be an earlier process's
            # cold calls; priced so, make demo's 30-token prompt was refused and decoded plainly at 0.81x)
            self.exploring = True
            return True
        if self.revisit_measured:  # the last revisit drafted and measured, and the answer is still no
            self.revisits_lost, self.revisit_measured = self.revisits_lost + 1, None
        # Paid from the plain decoding at this batch size only: funded by a server's busy stages (2-8 rows, where a
        # revisit's catch-up is dear), the lone client's revisits came at once, one each 1-client stage of a load test,
        # each 4-10 % of the stage (tools/load_test.py). A long catch-up is not paid whole to re-measure what said no:
        # a sample of it is (``catchup_sample``), and the "no" judged again with what the sample measured.
        sample = min(behind, self.sample_tokens * batch)
        loss = sample * self.catchup_rate + (self.draft_step or 0.0) if sample < behind else cost - saving
        if loss <= self.revisit_budget() * self.plain_seconds.get(batch, 0.0):
            self._revisit(batch)
            if sample == behind:
                return True
            self.sample_due = self.sample_tokens
            return False
        # The text may have turned easier to draft since it was last measured (an answer's opening words, then its
        # translation or its code): a probe is paid while it costs a small share of what drafting would save over
        # the tokens to come if the text now accepted at ``optimism``; each probe in a row that left the "no"
        # standing halves that share, so probes on a text that stays hard cost a bounded share in all.
        # A single text only: in a batch, rows are several texts, each catch-up a joining prompt's whole prefill, and
        # fading evidence there had a 2-client server pay them where drafting never pays (0.89x plain decoding).
        hope = to_come * (1 / hoped[0] - 1 / hoped[1:].max()) / batch
        if self.probe_measured:
            self.probes_lost, self.probe_measured = self.probes_lost + 1, None
        if batch == 1 and cost <= self.probe_share / 2 ** self.probes_lost * hope:
            self.probe_measured, self.exploring = False, True
            return True
        return False

    def catchup_sample(self) -> int:
        due, self.sample_due = self.sample_due, 0
        return due

    def observe_sample(self, catchup_seconds: float, catchup_tokens: int, step_seconds: float, rows: int) -> None:
        """What a revisit's sample measured, learned afresh as a revisit's drafting is (``_revisit``): the catch-up's rate,
        and a draft call (a later one of a cycle: one token a row). The next "no" to a catch-up counts the revisit lost.

        Paid whole, a revisit of a lone client's "no" cost a catch-up of its ~130-token prompt (1.66 s on a first-
        generation EPYC) to re-measure what 32 of its tokens and one call measure (0.55 s and ~35 ms there), then drafted
        at a loss (tools/load_test.py: 0.95x plain decoding in the stage that paid it)."""
        self.observe_catchup(catchup_seconds, catchup_tokens)
        if step_seconds > 0:
            self._use_batch(rows)
            self._learn_draft_step(step_seconds, 0.1)
        if self.revisit_measured is False:
            self.revisit_measured = True

    def revisit_budget(self) -> float:
        """The share of plain time a revisit may lose: ``revisit_share``, halved for each revisit in a row that
        left the "no" standing. Where drafting does not pay (2 busy rows on 2 cores), each revisit is a loss (in
        one load test the cost server drafted through a stage at 2 clients, most likely after a revisit, and plain
        decoding won that stage by a third), and a
        "no" that one revisit confirmed is likelier to stand at the next."""
        return self.revisit_share / 2 ** min(self.revisits_lost, self.revisit_halvings)

    def _revisit(self, batch: int) -> None:
        """Pay a refused catch-up (of a long one, a sample: ``catchup_sample``) and draft (``explore_k()``) to re-measure
        what refused it. A "no" is never revisited by itself: only the draft's calls measure its costs. Measured under contention
        (another process busy on the 2 cores while a server warmed up: a draft step of 27 ms against 10, a
        catch-up of 5.7 ms a token against 1.9), they kept a lone client plain for a whole load test. So a "no"
        is paid when its modelled loss is within ``revisit_budget()`` of the time decoded plainly at ``batch`` rows since
        the last drafting cycle there, and the drafting costs at ``batch`` are learned afresh, as in a new process (``_learn``),
        instead of blending a tenth of each new measurement into the stale ones."""
        self.plain_seconds[batch], self.exploring, self.revisit_measured = 0.0, True, False
        self.trusted |= {key for key, count in self.samples.items() if isinstance(key[1], int) and count >= 2}
        for key in [key for key in self.samples if key == ("catchup", 0) or (key[0] == batch and key[1] != 1)]:
            del self.samples[key]
            self.firsts.pop(key, None)

    def inherit(self, previous: Policy) -> None:
        """The engines' costs carry over whole: they belong to the models and this machine, and measuring them
        again costs every request a plain step, probes and a cold start at K = k_max, a large share of a
        128-token completion. Acceptance belongs to the text: it carries over as a prior worth at most
        ``carried_cycles`` verified cycles, which the request's own outcomes soon outweigh."""
        if not isinstance(previous, CostModel) or previous.k_max != self.k_max:
            return
        self.draft_step, self.verify, self.measured = previous.draft_step, dict(previous.verify), set(previous.measured)
        self.batch, self.catchup_rate, self.plain_seconds = previous.batch, previous.catchup_rate, dict(previous.plain_seconds)
        self.first_call = previous.first_call
        self.revisits_lost, self.revisit_measured = previous.revisits_lost, previous.revisit_measured
        self.sample_due = previous.sample_due
        self.samples, self.firsts = dict(previous.samples), dict(previous.firsts)  # the same process: its calls are warm
        self.trusted = set(previous.trusted)
        self.by_batch = {b: (step, dict(verify), set(measured)) for b, (step, verify, measured) in previous.by_batch.items()}
        weight = min(1.0, self.carried_cycles / previous.tried[1]) if previous.tried[1] > 0 else 0.0
        self.tried, self.kept = previous.tried * weight, previous.kept * weight

    def remembered(self) -> dict:
        """The state ``recall`` starts a later process from. ``once`` lists, per batch size, the verify sizes whose
        cost rests on a single call (cold). Recorded as if warm, make demo's record kept a v(4) of 83 ms beside a
        v(9) of 97 ms: the next process priced K = 3 out, and in 70 cycles never drafted 3 to re-measure it."""
        def costs(batch, step, verify, measured):
            once = [t for t in measured if t != "draft" and not self._warm(t, batch)]
            return {"draft_step": step, "verify": {str(t): v for t, v in verify.items()},
                    "measured": sorted(map(str, measured)), "once": sorted(map(str, once))}

        return {"k_max": self.k_max, "tried": self.tried.tolist(), "kept": self.kept.tolist(), "batch": self.batch,
                "catchup_rate": self.catchup_rate, "first_call": self.first_call,
                **costs(self.batch, self.draft_step, self.verify, self.measured),
                "by_batch": {str(b): costs(b, *entry) for b, entry in self.by_batch.items()}}

    def recall(self, state: dict) -> bool:
        """The engines' costs of the policy ``state`` describes, as ``inherit`` carries them; a state that does
        not fit this policy (another k, a malformed or hand-edited record) is refused whole.

        Acceptance is left behind: it belongs to the earlier process's text, and carried from an unrelated
        prompt (a chat question before a completion of code) it kept the policy plain for most of a request
        that fixed K sped up by a fifth (tools/bench_cli_policies.py). Instead, the first drafting cycle
        proposes ``explore_k()`` drafts to measure this text's acceptance."""
        try:
            previous = CostModel(self.k_max)
            if state["k_max"] != self.k_max:
                return False
            previous.tried, previous.kept = _counts(state["tried"], self.k_max), _counts(state["kept"], self.k_max)
            previous.batch = _positive_int(state["batch"])
            previous.catchup_rate = _seconds(state["catchup_rate"], optional=True)
            previous.first_call = _first_call(state.get("first_call", 1.0), self.first_call_most)  # absent from older records
            previous.draft_step, previous.verify, previous.measured = _costs(state)
            previous.trusted = _trusted(previous.batch, state)
            previous.by_batch = {}
            for b, entry in state["by_batch"].items():
                previous.by_batch[_positive_int(b)] = _costs(entry)
                previous.trusted |= _trusted(_positive_int(b), entry)
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        previous.tried[:] = previous.kept[:] = 0.0
        self.inherit(previous)
        self.exploring = True
        return True

    def observe_catchup(self, seconds: float, tokens: int) -> None:
        # a catch-up of a few tokens costs about one call whatever its length (3 tokens: 7.5 ms a token, a
        # 100-token prefill 1.8 ms): it tells the call's cost, not the rate a prompt is caught up at
        if tokens >= self.rate_tokens:
            self.catchup_rate = self._learn(("catchup", 0), self.catchup_rate, seconds / tokens)

    def _learn(self, key: tuple, known: float | None, value: float, blend: float = 0.1, recalled: bool = False) -> float:
        """A cost's new estimate after measuring ``value``: the first measurement in this process (cold) no
        more than the estimate it replaces (recalled, or the nearest batch size's), then the lower of the first
        two measurements (a cold call or a stall only ever comes out dearer: a plain step at 4 rows once took
        146 ms against ~40), later ones blended in by ``blend``. A cost estimated too low is soon measured
        again; one too high may never be. A ``recalled`` cost (this size's, measured by an earlier process)
        counts as one of the first two: a short run's two cold calls at a size replaced 64 ms with 98 ms."""
        count = self.samples.get(key, 0)
        self.samples[key] = count + 1
        if count == 0:
            self.firsts[key] = min(known, value) if recalled and known is not None else value
            return value if known is None else min(known, value)
        if count == 1:
            return min(self.firsts.pop(key), value)
        return (1 - blend) * known + blend * value

    def _estimates(self, batch: int) -> tuple[float | None, dict[int, float], set]:
        """(draft step, verify costs, what was measured) for ``batch`` rows: their own where known. A size never
        seen starts from the nearest size's, with each call of several tokens priced for ``batch`` rows (row by
        row, as the fused form verifies a batch: the dearest a batch's verification can be), nothing measured.
        Taken at the nearest size's price, a server's first cycles at 3 and 4 rows paid 2 s of the draft's
        prefill for joining rows (tools/load_test.py), drafts that a batch of 4 then never used."""
        if batch == self.batch:
            return self.draft_step, self.verify, self.measured
        if batch in self.by_batch:
            return self.by_batch[batch]
        nearest = min({self.batch, *self.by_batch}, key=lambda b: (abs(b - batch), b))  # a tie: the fewer rows
        step, verify, _ = self._estimates(nearest)
        step = None if step is None else step * batch / nearest  # until v(1) is measured here (``_step_as_v1``)
        return step, {t: v * batch / nearest if t > 1 else v for t, v in verify.items()}, set()

    def _step_as_v1(self) -> float | None:
        """The draft step at this batch size before it is measured: the nearest size's where both were measured,
        scaled as this size's v(1) is to that size's. Both models' one-token calls grow alike with the rows, and
        priced at one row's, the draft looked cheap enough at 2 rows to pay a 0.6 s catch-up and draft for cycles
        that lost to plain decoding (13-16 ms a draft step against 10.4 alone, tools/load_test.py)."""
        sizes = [b for b, (_, _, measured) in self.by_batch.items() if {"draft", 1} <= measured]
        if not sizes:
            return self.draft_step
        nearest = min(sizes, key=lambda b: (abs(b - self.batch), b))
        step, verify, _ = self.by_batch[nearest]
        return step * self.verify[1] / verify[1]

    def _use_batch(self, batch: int) -> None:
        """Switch the cost estimates to ``batch`` rows (``_estimates``); a new size's give way to its own
        measurements as ``_learn`` takes them."""
        if batch == self.batch:
            return
        estimates = self._estimates(batch)
        self.by_batch[self.batch] = (self.draft_step, self.verify, self.measured)
        self.draft_step, self.verify, self.measured = estimates
        self.batch = batch

    def _learn_draft_step(self, seconds: float, blend: float) -> None:
        """A later draft call measured at this batch size (``_learn``)."""
        self.draft_step = self._learn((self.batch, "draft"), self.draft_step, seconds, blend, "draft" in self.measured)
        self.measured.add("draft")

    def _draft_call(self, outcome: CycleOutcome) -> float:
        """A later draft call's cost, from a drafting cycle: with 2 or more calls, the later ones' mean (and the first's
        ratio to it is learned); with one, the first call's priced down by that ratio."""
        first, steps = outcome.first_draft_seconds, outcome.draft_steps
        if steps == 1 and 0 < first <= outcome.draft_seconds:
            return outcome.draft_seconds / self.first_call
        if not 0 < first < outcome.draft_seconds:  # not told what the first call took: all calls alike
            return outcome.draft_seconds / steps
        later = (outcome.draft_seconds - first) / (steps - 1)
        ratio = min(max(first / later, 1.0), self.first_call_most)
        self.first_call = 0.9 * self.first_call + 0.1 * ratio  # each ratio a noisy sample of a stable one
        return later

    def observe(self, outcome: CycleOutcome) -> None:
        k = outcome.proposed
        self.exploring = self.exploring and k == 0
        if k > 0 and self.revisit_measured is False:
            self.revisit_measured = True
        if k > 0 and self.probe_measured is False:
            self.probe_measured = True
        self._use_batch(len(outcome.accepted))
        blend = 0.1  # costs drift slowly (cache growth, machine load); acceptance decays apart
        if k > 0:
            self.tried *= self.decay
            self.kept *= self.decay
            for n in outcome.accepted:
                reached = min(int(n) + 1, k)  # drafts 1..n accepted, n + 1 rejected (if it exists)
                self.tried[1 : reached + 1] += 1
                self.kept[1 : int(n) + 1] += 1
        # A catch-up after plain cycles feeds the draft many tokens at once; timing it as one step
        # would make drafting look dear and keep the policy from ever speculating again.
        self.plain_seconds[self.batch] = 0.0 if k > 0 else self.plain_seconds.get(self.batch, 0.0) + outcome.verify_seconds
        if outcome.draft_steps and outcome.catchup_tokens <= 2:
            self._learn_draft_step(self._draft_call(outcome), blend)
        if outcome.verify_tokens:
            t, v = outcome.verify_tokens, outcome.verify_seconds
            self.verify[t] = self._learn((self.batch, t), self.verify.get(t), v, blend, t in self.measured)
            self.measured.add(t)
            if t == 1 and "draft" not in self.measured:
                self.draft_step = self._step_as_v1()


def _first_call(value, most: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1.0 <= value <= most:
        raise ValueError(f"first_call: got {value!r}; expected a number in [1, {most}]")
    return float(value)


def _fit(verify: dict[int, float]):
    """v(T) from measured points, as a function of T: a least-squares line, never below the cheapest point; from one
    point, 10 % a token."""
    if len(verify) == 1:
        (t0, v0), = verify.items()
        return lambda tokens: v0 * (1 + 0.1 * (tokens - t0))
    # the closed form of a degree-1 least-squares fit: np.polyfit took 90 us, and the policy asks every cycle
    mean_t, mean_v = sum(verify) / len(verify), sum(verify.values()) / len(verify)
    slope = (sum((t - mean_t) * (v - mean_v) for t, v in verify.items())
             / sum((t - mean_t) ** 2 for t in verify))
    floor = min(verify.values())
    return lambda tokens: max(mean_v + slope * (tokens - mean_t), floor)


def _counts(values, k_max: int) -> np.ndarray:
    counts = np.array(values, dtype=np.float64)
    if counts.shape != (k_max + 1,) or not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError(f"expected {k_max + 1} finite counts >= 0")
    return counts


def _positive_int(value) -> int:
    number = int(value)
    if number < 1 or str(number) != str(value).strip():
        raise ValueError(f"expected a positive integer, got {value!r}")
    return number


def _seconds(value, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"expected a positive finite time, got {value!r}")
    return float(value)


def _costs(entry: dict) -> tuple[float | None, dict[int, float], set]:
    """(draft step, verify costs by tokens, what was measured) out of a remembered record."""
    verify = {_positive_int(t): _seconds(v) for t, v in entry["verify"].items()}
    measured = {m if m == "draft" else _positive_int(m) for m in entry["measured"]}
    return _seconds(entry["draft_step"], optional=True), verify, measured


def _trusted(batch: int, entry: dict) -> set[tuple[int, int]]:
    """The (batch, verify size) pairs of a remembered record measured twice or more: every measured size but those
    listed ``once`` (a record written before ``once`` existed trusts them all, as it was read then)."""
    once = {_positive_int(t) for t in entry.get("once", [])}
    measured = {m for m in entry["measured"] if m != "draft"}
    sizes = {_positive_int(m) for m in measured}
    if not once <= sizes:
        raise ValueError(f"once: {sorted(once - sizes)} not among the measured sizes")
    return {(batch, t) for t in sizes - once}
