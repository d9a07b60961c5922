"""Speculation over sliding-window layers stays exact: greedy speculative output equals plain greedy output when the
window (4) is far shorter than prompt + answer, with drafts from a draft model and from the suffix index, two rows
of different lengths in one batch (ragged acceptance, rollback past the window's edge), in both graph forms."""

from __future__ import annotations

import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.suffix import SuffixIndex
from tests import tiny

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]  # ragged: 9 and 3 tokens
NEW = 28


@pytest.fixture(scope="module", params=["explicit", "fused"])
def pipeline(request, tmp_path_factory, exported_architecture):
    """Gemma 3 (a window of 4 on its first layer, a local and a global RoPE, soft-caps; parity's model, whose trace is
    shared: tests/traces.py) drafted for by its own int4 copy (rounding moves its logits: partial acceptance). Gemma 2's
    model served here until it was seen to repeat its prompt's last token: every draft kept, no rollback at all."""
    checkpoint = exported_architecture.checkpoint("gemma3_text")
    directory = tiny.export_cli(tmp_path_factory.mktemp("windows") / "art", checkpoint, checkpoint,
                                "--graph", request.param, "--draft-weights", "int4")
    return Pipeline.load(directory)


@pytest.fixture(scope="module")
def plain(pipeline):
    config = GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True)
    answers = [pipeline.generate([p], config)[0].token_ids for p in PROMPTS]
    assert all(len(set(answer)) >= 8 for answer in answers)  # not a token repeated: the window moves over new keys
    return answers


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("drafter", ["model", "suffix"])
def test_speculative_greedy_over_windows_equals_plain(pipeline, plain, drafter, k):
    config = GenerationConfig(k=k, policy="fixed", drafter=drafter, max_new_tokens=NEW, ignore_eos=True)
    index = SuffixIndex()
    if drafter == "suffix":  # earlier texts of these prompts with every fifth answer token changed: drafts that run right
        # for four tokens, across the window's edge, and then part from the text (a rejection and a rollback)
        for i, (prompt, answer) in enumerate(zip(PROMPTS, plain)):
            index.add(("earlier", i), prompt + [t if j % 5 != 4 else (t + 1) % tiny.VOCAB for j, t in enumerate(answer)])
    results = pipeline.generate(PROMPTS, config, suffix_index=index)  # batch 2
    assert [r.token_ids for r in results] == plain
    drafted = [r for result in results for r in result.records if r.drafted]
    assert max(r.accepted for r in drafted) >= 2  # drafts accepted past one token
    assert any(r.accepted < r.drafted for r in drafted)  # and some rolled back


def test_seeded_sampling_over_windows_is_reproducible_whatever_drafts(pipeline):
    """A seeded request's text depends on neither the drafter nor its batch mate, across the window's edge too."""
    texts = []
    for drafter in ("none", "model", "suffix"):
        config = GenerationConfig(k=4, drafter=drafter, temperature=0.8, seed=11, max_new_tokens=NEW, ignore_eos=True)
        texts.append([r.token_ids for r in pipeline.generate(PROMPTS, config)])
    assert texts[0] == texts[1] == texts[2]
    greedy = GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True)
    assert texts[0] != [r.token_ids for r in pipeline.generate(PROMPTS, greedy)]  # sampled, not greedy
