"""specdeploy.values: the one rule for repeating a value in a message, and for what counts as an integer."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy.values import LIMIT, is_integer, short


@pytest.mark.parametrize("value,expected", [
    (3, True), (0, True), (-2**70, True), (np.int64(5), True), (np.uint8(1), True),
    (True, False), (np.bool_(True), False), (3.0, False), (np.float64(3), False), ("3", False), (None, False),
])
def test_an_integer_is_a_python_or_numpy_integer_never_a_bool_or_a_whole_float(value, expected):
    assert is_integer(value) is expected


def test_a_long_value_is_cut_with_its_length_or_type_said():
    assert short("abc") == "'abc'" and short("abc", quoted=False) == "abc"
    cut = short("x" * 10_000)
    assert len(cut) < LIMIT + 30 and cut.startswith("'xxx") and cut.endswith("... (10,002 characters)")
    assert short(list(range(1000)), 20).endswith("... (list)")
    assert short(10 ** 10_000) == f"an integer of {(10 ** 10_000).bit_length():,} bits"  # past Python's digit limit
