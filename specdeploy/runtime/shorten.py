"""One rule for repeating a value in a message: cut short, as a prompt or a client's value may be megabytes.

Standard library only: the chat worker, run as a script with nothing but the standard library and jinja2, uses it too.
"""

from __future__ import annotations

LIMIT = 60  # characters of a value repeated in a message


def short(value, limit: int = LIMIT, quoted: bool = True) -> str:
    """``value`` as a message repeats it: its repr (a string as it is, when not ``quoted``), cut to ``limit`` characters
    with a string's length or another value's type said; an integer too long for Python to print, by its size."""
    try:
        text = value if isinstance(value, str) and not quoted else repr(value)
    except ValueError:  # an integer over sys.get_int_max_str_digits() digits
        return f"an integer of {value.bit_length():,} bits"
    if len(text) <= limit:
        return text
    return f"{text[: limit - 3]}... ({f'{len(text):,} characters' if isinstance(value, str) else type(value).__name__})"
