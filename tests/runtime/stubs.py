"""Policy stubs shared by the runtime and server tests."""

from __future__ import annotations

from specdeploy.runtime.policies import Policy


class Judge(Policy):
    """Drafts 3 tokens by the draft model (no free drafts), and answers every catch-up question with ``pays``;
    ``fed`` lists, for each draft prefill (an outcome without a target call), the tokens its widest row fed."""

    def __init__(self, pays: bool):
        self.pays, self.asked, self.fed = pays, [], []

    def next_k(self, batch: int, lookup: bool = False) -> int:
        return 0 if lookup else 3

    def catchup_pays(self, batch, behind, to_come):
        self.asked.append((batch, behind, to_come))
        return self.pays

    def observe(self, outcome):
        if not outcome.verify_tokens:
            self.fed.append(outcome.first_call_tokens)
