"""The suffix drafter in a pipeline: a later request drafts from an earlier one's answer (its records say whose),
scopes keep texts apart, and the index persists across processes."""

from __future__ import annotations

import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.config import ConfigError
from specdeploy.runtime.suffix import SuffixIndex
from specdeploy.runtime.suffix_store import DEFAULT_SCOPE, SuffixStore

PROMPT = "w40 w41 w42 w43"
CONFIG = GenerationConfig(k=4, policy="fixed", drafter="suffix", max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def pipeline(pair_dir):
    return Pipeline.load(pair_dir)


def _sources(result) -> set:
    return {r.drafted_from for r in result.records if r.drafted_from is not None}


def test_a_later_request_drafts_from_an_earlier_answer_and_says_whose(pipeline):
    index = SuffixIndex()
    first = pipeline.generate(PROMPT, CONFIG, suffix_index=index)[0]
    second = pipeline.generate(PROMPT, CONFIG, suffix_index=index)[0]
    assert second.token_ids == first.token_ids  # the target's own text, whatever was drafted
    earlier = first.records[0].request_id
    assert earlier in _sources(second) and earlier not in _sources(first)
    assert sum(r.accepted for r in second.records) > sum(r.accepted for r in first.records)
    assert len(second.records) < len(first.records)  # fewer target calls: the earlier answer was followed
    assert all(r.free for r in second.records if r.drafted_from == earlier)


def test_a_request_without_a_shared_index_drafts_from_its_own_text_alone(pipeline):
    index = SuffixIndex()
    own = pipeline.generate(PROMPT, CONFIG, suffix_index=index)[0]
    alone = pipeline.generate(PROMPT, CONFIG, suffix_index=None)[0]
    assert alone.token_ids == own.token_ids
    assert _sources(alone) <= {alone.records[0].request_id}
    assert len(index) == 1  # the opted-out request's text joined no index


def test_scopes_never_draft_from_each_others_answers(pipeline):
    """Two scopes (a server's API keys): the second's request, the same prompt, finds nothing of the first's answer."""
    alice, bob = SuffixIndex(), SuffixIndex()
    first = pipeline.generate(PROMPT, CONFIG, suffix_index=alice)[0]
    other = pipeline.generate(PROMPT, CONFIG, suffix_index=bob)[0]
    assert first.records[0].request_id not in _sources(other)
    run = pipeline.start([PROMPT, PROMPT], CONFIG, suffix_index=[alice, bob])  # one batch, a scope per row
    while not run.done:
        run.step()
    mine, theirs = run.results
    assert first.records[0].request_id in _sources_of(mine)
    assert not _sources_of(theirs) & {first.records[0].request_id, mine.request_id}


def _sources_of(row) -> set:
    return {r.drafted_from for r in row.records if r.drafted_from is not None}


def test_the_pipelines_own_index_is_shared_by_generate_stream_and_start(pipeline):
    before = len(pipeline.suffix_store.index(DEFAULT_SCOPE))
    text = pipeline.generate("w50 w51", CONFIG)[0].token_ids
    chunks = list(pipeline.stream("w50 w51", CONFIG))
    assert chunks[-1].result.token_ids == text
    assert _sources(chunks[-1].result) - {chunks[-1].result.records[0].request_id}  # drafted from generate's answer
    assert len(pipeline.suffix_store.index(DEFAULT_SCOPE)) == before + 2


def test_pipelines_sharing_a_store_keep_each_others_texts(pair_dir):
    """A new pipeline a request over one store (as tools.replay runs fresh processes, or an application its workers):
    each request's text is kept beside the others', not in place of one that had the same default id."""
    store = SuffixStore()
    first, second = (Pipeline.load(pair_dir, suffix_store=store).generate(prompt, CONFIG)[0]
                     for prompt in (PROMPT, "w50 w51"))
    assert first.records[0].request_id != second.records[0].request_id
    assert len(store.index(DEFAULT_SCOPE)) == 2
    third = Pipeline.load(pair_dir, suffix_store=store).generate(PROMPT, CONFIG)[0]
    assert first.records[0].request_id in _sources(third)  # the first text is still there to draft from


def test_a_failed_or_mistyped_index_is_refused_naming_the_argument(pipeline):
    with pytest.raises(ConfigError, match="suffix_index"):
        pipeline.start([PROMPT], CONFIG, suffix_index="default")
    with pytest.raises(ConfigError, match=r"one of either per prompt \(2\)"):
        pipeline.start([PROMPT, PROMPT], CONFIG, suffix_index=[None])


def test_a_persisted_index_round_trips_into_a_new_pipeline(pair_dir, tmp_path):
    path = tmp_path / "suffix.json"
    writer = Pipeline.load(pair_dir, suffix_file=path)
    first = writer.generate(PROMPT, CONFIG)[0]
    assert writer.save_suffix_file() == path and path.is_file()
    reader = Pipeline.load(pair_dir, suffix_file=path)
    again = reader.generate(PROMPT, CONFIG)[0]
    assert again.token_ids == first.token_ids and any(s.startswith("saved-") for s in _sources(again))


def test_a_corrupt_persisted_index_is_refused_in_one_line_and_the_pipeline_starts(pair_dir, tmp_path):
    path = tmp_path / "suffix.json"
    path.write_text("{ half a file")
    said = []
    pipeline = Pipeline.load(pair_dir, suffix_file=path, log=said.append)
    assert len(said) == 1 and str(path) in said[0] and "not JSON" in said[0] and "\n" not in said[0]
    assert len(pipeline.suffix_store.index(DEFAULT_SCOPE)) == 0 and pipeline.generate(PROMPT, CONFIG)[0].token_ids


def test_a_text_drafted_from_is_the_last_to_be_evicted(pipeline):
    """The shared index evicts the least recently used text: added, or drafted from."""
    index = SuffixIndex(max_sequences=2)
    first = pipeline.generate(PROMPT, CONFIG, suffix_index=index)[0].records[0].request_id
    pipeline.generate("w80 w81 w82", CONFIG, suffix_index=index)
    again = pipeline.generate(PROMPT, CONFIG, suffix_index=index)[0]  # drafts from the first: it is used again
    assert first in _sources(again) and len(index) == 2
    assert first in index and again.records[0].request_id in index  # the unused second text went
