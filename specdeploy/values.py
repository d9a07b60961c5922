"""Values as a message repeats them, and which values are integers: one rule each, for every layer of the package.

A leaf (standard library only, nothing of the package): the contract, the engines, the exporter, the runtime, the
server and the CLI all use it, and so does the chat worker, run as a script with nothing but the standard library
and jinja2.
"""

from __future__ import annotations

import numbers

LIMIT = 60  # characters of a value repeated in a message


def short(value, limit: int = LIMIT, quoted: bool = True) -> str:
    """``value`` as a message repeats it: its repr (a string as it is, when not ``quoted``), cut to ``limit`` characters
    with a string's length or another value's type said; an integer too long for Python to print, by its size. A
    prompt, a client's value or a hostile manifest's may be megabytes."""
    try:
        text = value if isinstance(value, str) and not quoted else repr(value)
    except ValueError:  # an integer over sys.get_int_max_str_digits() digits
        return f"an integer of {value.bit_length():,} bits"
    if len(text) <= limit:
        return text
    return f"{text[: limit - 3]}... ({f'{len(text):,} characters' if isinstance(value, str) else type(value).__name__})"


def is_integer(value) -> bool:
    """A Python or NumPy integer, not a bool (``True`` is an int to Python, never a count or a size to us) and not a
    float that happens to be whole."""
    if type(value) is int:  # the common case first: an engine asks it of every row's width at every call
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
