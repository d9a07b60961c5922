"""Stop strings: the same answers as searching the whole text, from work in proportion to the new text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.stops import StopScanner, StopStrings

ALPHABET = "ab c"
texts = st.text(alphabet=ALPHABET, max_size=60)
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4)


def _settled_by_search(text: str, stops) -> int:
    """What no stop string can still change, by brute force: before the earliest complete stop string, and before
    the longest tail of the text that begins one (a match still under way)."""
    starts = [text.find(stop) for stop in stops if stop in text]
    tails = [n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])]
    held = len(text) - max(tails, default=0)
    return min([held, *starts])


@settings(max_examples=300, deadline=None)
@given(text=texts, stops=stop_lists, cuts=st.lists(st.integers(0, 60), max_size=8))
def test_the_scanner_settles_what_a_search_of_the_whole_text_settles(text, stops, cuts):
    scanner, fed = StopScanner(stops), 0
    for cut in sorted(set(cuts)) + [len(text)]:
        piece, fed = text[fed:max(fed, cut)], max(fed, cut)
        scanner.feed(piece)
        assert scanner.settled == _settled_by_search(text[:fed], stops)
    # what was settled never reaches past where the final text is cut
    assert scanner.settled <= len(StopStrings(stops, None).cut(text))


PIECES = ["", "a", "b", " ", "ab", "ba ", "c", "abc", "  ", "cab"]  # token id -> text: empty and several-character tokens


def _decode(ids):
    return "".join(PIECES[i] for i in ids)


@settings(max_examples=300, deadline=None)
@given(previous=st.lists(st.integers(0, len(PIECES) - 1), max_size=40),
       new=st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=6), stops=stop_lists)
def test_check_agrees_with_decoding_everything(previous, new, stops):
    """Where the text before the new tokens holds no stop string (else its request would have ended), the fewest
    new tokens completing one are those found by decoding the whole text each time."""
    if any(stop in _decode(previous) for stop in stops):
        return
    whole = next((keep for keep in range(1, len(new) + 1) if any(s in _decode(previous + new[:keep]) for s in stops)),
                 None)
    assert StopStrings(stops, _decode).check(previous, new) == whole


def test_check_decodes_a_window_not_the_whole_text():
    """A cycle's check used to decode every token so far: quadratic over a long generation."""
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return _decode(ids)

    stops = StopStrings(["abcab", "x"], decode)
    previous = [1, 2, 3] * 10_000  # "ab ab ..." without a stop string
    assert stops.check(previous, [4, 6, 4, 2]) == 3  # "ab" + "c" + "ab" completes "abcab"
    assert max(decoded) <= len("abcab") + 4 + 4  # the window the longest stop needs, the slack and the new tokens


def test_long_stop_strings_cost_no_more_than_their_length():
    """The scanner on a text that keeps almost matching a 256-character stop string: each character is fed once,
    and what is held back is the match under way."""
    stop = "a" * 255 + "b"
    scanner = StopScanner([stop])
    for _ in range(2_000):
        scanner.feed("a" * 50)
    assert scanner.settled == 2_000 * 50 - 255
    scanner.feed("b")
    assert scanner.settled == 2_000 * 50 - 255 and scanner.first == 2_000 * 50 - 255


def test_streamed_chunks_add_up_with_bounded_stops(pair_dir):
    """Many long stop strings (at the bounds) and a streamed request: the chunks add up to the final text."""
    pipeline = Pipeline.load(pair_dir)
    plain = pipeline.generate(["w5 w6"], GenerationConfig(max_new_tokens=24, ignore_eos=True, drafter="none"))[0].text
    words = plain.split()
    stops = [" ".join(words[8:10])] + ["w" + "9" * 255] * 15  # the first one ends the text; the others never appear
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True, stop=stops, k=3)
    chunks = list(pipeline.stream("w5 w6", config))
    text = "".join(chunk.text for chunk in chunks)
    assert text == chunks[-1].result.text == plain[: plain.index(stops[0])]
    assert chunks[-1].result.finish_reason == "stop"
