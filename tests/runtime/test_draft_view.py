"""Drafters read the batch through a narrow view (``rows.BatchView``): plain arrays drive them as a batch state does."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specdeploy import GenerationConfig
from specdeploy.runtime.decoder import BatchState
from specdeploy.runtime.drafters import PromptLookup, SuffixDrafter
from specdeploy.runtime.rows import RowResult
from specdeploy.runtime.suffix import SuffixIndex

from .test_drafters import _propose


@dataclass
class Arrays:
    """A batch of greedy rows as arrays alone: what a drafter reads, nothing of a batch state."""

    tokens: np.ndarray
    lengths: list[int]
    texts: list = field(default_factory=list)
    greedy: bool = True
    penalized: bool = False

    def __post_init__(self):
        self.configs = [GenerationConfig()] * len(self.lengths)
        self.texts = self.texts or [(RowResult(f"r{b}", self.tokens[b, :n]), None) for b, n in enumerate(self.lengths)]

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def rngs(self):
        return [np.random.default_rng(b) for b in range(self.batch)]

    def noise(self, b, position, vocab):
        return None


def _tokens():
    tokens = np.zeros((2, 16), np.int64)
    tokens[0, :6] = [1, 2, 3, 9, 1, 2]  # "1 2" seen before, followed by "3 9"
    tokens[1, :3] = [4, 5, 6]
    return tokens


def test_prompt_lookup_on_arrays_proposes_as_on_a_batch_state():
    tokens = _tokens()
    state = BatchState(GenerationConfig(), 16, set())
    state.join([tokens[0, :6], tokens[1, :3]], ["r0", "r1"])
    on_arrays = _propose(PromptLookup(), Arrays(tokens, [6, 3]), None, 0, 3, [3, 3])
    on_state = _propose(PromptLookup(), state, None, 0, 3, [3, 3])
    np.testing.assert_array_equal(on_arrays.drafts, on_state.drafts)
    np.testing.assert_array_equal(on_arrays.drafts, [[3, 9, 1], [6, 6, 6]])
    assert on_arrays.drafted == on_state.drafted == [3, 0]


def test_the_suffix_drafter_on_arrays_reads_each_rows_own_text_and_its_scope():
    tokens = _tokens()
    earlier = SuffixIndex()
    earlier.add("earlier", [4, 5, 6, 7, 8])  # an earlier answer in row 1's scope continues "4 5 6" with "7 8"
    view = Arrays(tokens, [6, 3], [(RowResult("r0", tokens[0, :6]), None), (RowResult("r1", tokens[1, :3]), earlier)])
    proposal = _propose(SuffixDrafter(), view, None, 0, 2, [2, 2])
    np.testing.assert_array_equal(proposal.drafts[0], [3, 9])  # its own text
    np.testing.assert_array_equal(proposal.drafts[1], [7, 8])  # its scope's
    assert proposal.drafted == [2, 2] and proposal.origins[1] == "earlier"
