"""Policy stubs shared by the runtime and server tests."""

from __future__ import annotations

from specdeploy.runtime.policies import FixedK


class Judge(FixedK):
    """Drafts k, and answers every catch-up question with ``pays``."""

    weighs_catchup = True

    def __init__(self, pays: bool):
        super().__init__(3)
        self.pays, self.asked, self.fed = pays, [], []

    def catchup_pays(self, batch, behind, to_come):
        self.asked.append((batch, behind, to_come))
        return self.pays

    def observe_catchup(self, seconds, tokens):
        self.fed.append(tokens)
