"""The suffix index on arrays alone: matching, the most frequent continuation, estimates, bounds and its file."""

from __future__ import annotations

import json

import pytest

from specdeploy.runtime.config import ConfigError
from specdeploy.runtime.suffix import LEVELS, SuffixIndex, estimate, propose
from specdeploy.runtime.suffix_store import FORMAT, MIN_MATCH, SuffixFileError, SuffixStore, max_tokens_for


def test_a_context_seen_before_continues_as_it_did():
    index = SuffixIndex()
    index.add("a", [1, 2, 3, 4, 5, 6])
    drafts, estimates, origin = propose([index], [9, 2, 3], 3)
    assert drafts == [4, 5, 6] and origin == "a" and len(estimates) == 3
    assert propose([index], [9, 8, 7], 3) == ([], [], None)  # nothing matched: nothing proposed


def test_the_longest_match_wins_over_a_more_frequent_short_one():
    index = SuffixIndex()
    for i in range(5):
        index.add(f"short{i}", [7, 3, 50 + i])  # "7 3" then something else each time
    index.add("long", [1, 2, 5, 6, 7, 3, 99])  # "5 6 7 3" then 99: a match of four
    assert propose([index], [5, 6, 7, 3], 1)[0] == [99]
    index.add("short5", [7, 3, 55])
    assert propose([index], [8, 8, 7, 3], 1)[0] == [55]  # only "7 3" matches: six ones tie, the latest wins


def test_the_most_frequent_continuation_is_followed_and_its_share_estimated():
    index = SuffixIndex()
    for key, tail in (("a", [4, 4]), ("b", [4, 5]), ("c", [4, 5]), ("d", [6, 6])):
        index.add(key, [1, 2, *tail])
    drafts, estimates, _ = propose([index], [1, 2], 2, floor=0.0)
    assert drafts == [4, 5]
    assert estimates[0] == pytest.approx(estimate(3, 4, 2)) and estimates[1] == pytest.approx(estimate(2, 3, 3))
    assert estimate(1, 1, 2) == pytest.approx(0.5) and estimate(1, 1, 32) > 0.9  # a long match is surer


def test_a_proposal_stops_where_its_running_estimate_falls_below_the_floor():
    index = SuffixIndex()
    index.add("a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(propose([index], [1, 2], 6, floor=0.0)[0]) == 6
    short = propose([index], [1, 2], 6, floor=0.2)
    assert 0 < len(short[0]) < 6 and all(e < 1 for e in short[1])


def test_indexes_together_count_their_occurrences_and_the_first_wins_a_tie():
    own, shared = SuffixIndex(), SuffixIndex()
    own.add("me", [1, 2, 3])
    shared.add("other", [1, 2, 4])
    assert propose([own, shared], [1, 2], 1)[0] == [3]
    shared.add("third", [1, 2, 4])
    assert propose([own, shared], [1, 2], 1)[0] == [4]  # two against one


def test_the_index_never_drafts_past_its_own_end_and_extends_as_tokens_commit():
    index = SuffixIndex()
    index.extend("me", [1, 2, 3, 1, 2])
    assert propose([index], [1, 2, 3, 1, 2], 4)[0] == [3, 1, 2]  # the continuation runs into the text's end
    index.extend("me", [3, 8])
    assert index.length("me") == 7 and propose([index], [1, 2, 3, 8, 1, 2, 3], 1)[0] == [8]  # the latest, now


def test_eviction_keeps_the_caps_least_recently_used_first():
    index = SuffixIndex(max_tokens=10, max_sequences=3)
    index.add("a", [1, 2, 3, 4])
    index.add("b", [5, 6, 7, 8])
    index.touch("a")  # drafted from: "b" is now the least recently used
    index.add("c", [9, 10, 11, 12])
    assert "b" not in index and "a" in index and "c" in index and index.tokens == 8
    assert propose([index], [5, 6], 1)[0] == []  # an evicted text's anchors are gone with it
    for i in range(5):
        index.add(f"x{i}", [20 + i, 30])
    assert len(index) == 3 and index.tokens <= 10
    assert all(not level for level in _anchors_of(SuffixIndex()))  # an empty index has no anchors
    emptied = SuffixIndex(max_tokens=4)
    emptied.add("a", list(range(40)))  # larger than the cap alone: nothing is kept, no anchor left behind
    assert len(emptied) == 0 and emptied.tokens == 0 and all(not level for level in _anchors_of(emptied))


def _anchors_of(index: SuffixIndex):
    return index._anchors


def test_memory_is_linear_in_the_tokens_kept():
    small, large = SuffixIndex(), SuffixIndex()
    small.add("a", [i % 977 for i in range(1000)])
    large.add("a", [i % 977 for i in range(10_000)])
    assert large.nbytes() < 11 * small.nbytes()
    assert sum(len(level) for level in large._anchors) <= len(LEVELS) * 10_000


def test_a_store_keeps_scopes_apart_and_bounds_their_number():
    store = SuffixStore(max_tokens=100, max_sequences=10, max_scopes=2)
    store.index("key:a").add("r1", [1, 2, 3])
    assert propose([store.index("key:b")], [1, 2], 1)[0] == []  # another scope never sees it
    store.index("key:b").add("r2", [4, 5])
    store.index("key:c").add("r3", [6])  # a third scope: the least recently used ("key:a") goes
    assert store.stats()["scopes"] == 2 and store.stats()["tokens"] == 3
    assert propose([store.index("key:a")], [1, 2], 1)[0] == []  # made anew, empty


def test_a_scopes_index_follows_an_earlier_text_after_four_matched_tokens_a_requests_own_after_two():
    """Two tokens met again in another request's text say little of what follows (replayed: docs/results/replay_all);
    in the request's own text they are the start of a repeat."""
    store = SuffixStore()
    store.index("default").add("earlier", [5, 1, 2, 3, 4, 9, 9])
    own = SuffixIndex()
    own.add("own", [5, 1, 2, 3, 4, 9, 9])
    assert store.index("default").min_match == MIN_MATCH == 4 and own.min_match == 2
    assert propose([store.index("default")], [7, 3, 4], 2)[0] == []  # a 2-token match in an earlier text: nothing
    assert propose([own], [7, 3, 4], 2)[0] == [9, 9]
    assert propose([store.index("default")], [1, 2, 3, 4], 2)[0] == [9, 9]
    assert propose([own, store.index("default")], [7, 3, 4], 2)[0] == [9, 9]  # together: the own text's match counts
    with pytest.raises(ValueError, match="min_match: got 0; expected a positive integer"):
        SuffixIndex(min_match=0)


def test_a_saved_store_round_trips(tmp_path):
    store = SuffixStore()
    store.index("default").add("r1", [1, 2, 3, 4, 5, 6])
    store.index("key:x").add("r2", [7, 8, 9, 10, 11])
    path = tmp_path / "suffix.json"
    store.save(path, "fp", 100)
    loaded = SuffixStore()
    assert loaded.load(path, "fp", 100) == 2
    assert propose([loaded.index("default")], [1, 2, 3, 4], 2)[0] == [5, 6]
    assert propose([loaded.index("key:x")], [7, 8, 9, 10], 1)[0] == [11]
    assert not list(tmp_path.glob(".*tmp"))  # the write left nothing beside the file
    assert SuffixStore().load(tmp_path / "missing.json", "fp", 100) == 0  # no file yet: an empty index


@pytest.mark.parametrize("content,expected", [
    (b"{not json", "not JSON"),
    (json.dumps({"format": "other"}).encode(), "not a suffix index"),
    (json.dumps({"format": "specdeploy.suffix-index", "version": 1, "tokenizer": "other", "vocab_size": 100,
                 "scopes": {}}).encode(), "another tokenizer"),
    (json.dumps({"format": "specdeploy.suffix-index", "version": 1, "tokenizer": "fp", "vocab_size": 100,
                 "scopes": {"s": [[1, 2, 100]]}}).encode(), "token ids in [0, 100)"),
    (json.dumps({"format": "specdeploy.suffix-index", "version": 1, "tokenizer": "fp", "vocab_size": 100,
                 "scopes": {"s": [[1, True]]}}).encode(), "token ids in [0, 100)"),
    (json.dumps({"format": "specdeploy.suffix-index", "version": 9}).encode(), "version 9"),
])
def test_a_corrupt_or_foreign_file_is_refused_in_one_line(tmp_path, content, expected):
    path = tmp_path / "suffix.json"
    path.write_bytes(content)
    with pytest.raises(SuffixFileError) as caught:
        SuffixStore().load(path, "fp", 100)
    assert expected in str(caught.value) and str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_an_oversized_file_or_a_directory_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "suffix.json"
    path.write_bytes(b" " * (8 * 10 * 1 + 2**20 + 1))
    with pytest.raises(SuffixFileError, match="expected at most"):
        SuffixStore(max_tokens=10, max_scopes=1).load(path, "fp", 100)
    with pytest.raises(SuffixFileError, match="a directory"):
        SuffixStore().load(tmp_path, "fp", 100)


@pytest.mark.parametrize("name,value", [("max_tokens", 0), ("max_sequences", -1), ("max_scopes", True),
                                        ("max_tokens", 1.5)])
def test_a_store_refuses_bounds_that_are_not_positive_integers(name, value):
    with pytest.raises(ValueError, match=name):
        SuffixStore(**{name: value})


@pytest.mark.parametrize("levels", [(2,), (32, 16, 8, 4, 2), (3, 1)])
def test_an_evicted_text_leaves_no_occurrence_behind_at_any_level(monkeypatch, levels):
    import specdeploy.runtime.suffix as suffix

    monkeypatch.setattr(suffix, "LEVELS", levels)
    index = SuffixIndex(max_sequences=2)
    texts = [[(i * 7 + j) % 11 for j in range(40)] for i in range(6)]
    for number, text in enumerate(texts):
        index.add(number, text)
        live = {n for n, _ in index._sequences.values()}
        for level in index._anchors:
            for occurrences in level.values():
                assert occurrences and {packed >> suffix._SHIFT for packed in occurrences} <= live
        assert propose([index], text[:5], 3)[0] == text[5:8]


def _file(path, scopes):
    path.write_text(json.dumps({"format": FORMAT, "version": 1, "tokenizer": "fp", "vocab_size": 100, "scopes": scopes},
                               separators=(",", ":")))
    return path


def test_a_deeply_nested_file_is_refused_in_one_line(tmp_path):
    """A valid header and a list nested 2,000,000 deep (4 MB, inside the byte bound): one line, not a RecursionError."""
    path = tmp_path / "suffix.json"
    head = json.dumps({"format": FORMAT, "version": 1, "tokenizer": "fp", "vocab_size": 100})[:-1]
    path.write_text(head + ', "scopes": {"s": ' + "[" * 2_000_000 + "]" * 2_000_000 + "}}")
    with pytest.raises(SuffixFileError) as caught:
        SuffixStore().load(path, "fp", 100)
    assert "nested too deeply" in str(caught.value) and str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_loading_keeps_what_adding_in_order_keeps(tmp_path):
    """The loader picks each scope's sequences before indexing; what it keeps is what adding them one by one keeps:
    the latest that fit, none from before one that alone is over the bound."""
    texts = [[1, 2, 3] * 10, [4] * 5000, [5, 6] * 20, [7] * 30, [8, 9] * 10, [], [3, 1] * 5]
    store = SuffixStore(max_tokens=100, max_sequences=4, max_scopes=2)
    store.load(_file(tmp_path / "suffix.json", {"a": texts, "b": texts[:2], "c": texts[2:]}), "fp", 100)
    reference = SuffixIndex(100, 4)
    for number, tokens in enumerate(texts[2:]):
        reference.add(number, tokens)
    assert store.index("c").sequences() == reference.sequences() == [[7] * 30, [8, 9] * 10, [], [3, 1] * 5]
    assert store.index("b").sequences() == []  # its last text alone is over the bound; "a" was the oldest scope
    assert "saved-c-1" in store.index("c") and "saved-c-4" in store.index("c")  # numbered by place in the file


@pytest.mark.parametrize("sequences", [[[1] * 100_000], [[1]] * 100_000])
def test_loading_indexes_no_more_than_the_bound_whatever_the_file_holds(tmp_path, monkeypatch, sequences):
    """One 100,000-token sequence, or 100,000 one-token ones, inside the byte bound of a 1,000-token store: at most
    1,000 tokens are indexed (all of them were, and evicted after: 100 s and 2 GB for 2,300,000 tokens)."""
    indexed = []
    extend = SuffixIndex._extend
    monkeypatch.setattr(SuffixIndex, "_extend", lambda self, key, new: (indexed.append(len(new)), extend(self, key, new)))
    store = SuffixStore(max_tokens=1000, max_scopes=1)
    store.load(_file(tmp_path / "suffix.json", {"s": sequences}), "fp", 100)
    assert sum(indexed) <= 1000 and len(indexed) <= 1000
    assert store.index("s").tokens == (0 if len(sequences) == 1 else 1000)


def test_a_token_bound_beyond_memory_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^suffix index max_tokens: got 1,000,000,000,000; expected at most [\d,]+ "
                                          r"\(16 scopes of up to 1,100 bytes a token in half of this machine's"):
        SuffixStore(max_tokens=10**12)
    assert SuffixStore(max_tokens=max_tokens_for(16)).max_tokens == max_tokens_for(16)


def test_a_symlinked_file_is_written_through_and_stays_a_link(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    target, link = shared / "suffix.json", tmp_path / "suffix.json"
    link.symlink_to(target)
    store = SuffixStore()
    store.index("s").add("r1", [1, 2, 3])
    store.save(link, "fp", 100)
    assert link.is_symlink() and json.loads(target.read_text())["scopes"] == {"s": [[1, 2, 3]]}
    assert sorted(p.name for p in shared.iterdir()) == ["suffix.json"]  # no partial file left beside it
