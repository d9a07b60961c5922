"""Operator settings given as text, checked alike wherever they come from: a flag or an environment variable.

click takes an environment variable that is set but empty as unset, so a secret that was not mounted (an empty
``SPECDEPLOY_API_KEY``) would start the server with no key at all; and a value read whole from a file keeps its
newline, so a padded key would start fine and refuse every client. Each text setting is refused at start, in one
line naming where it came from, when it is empty, padded with whitespace or holds a control character, and its
own form is checked (a root path, an origin, an address). A secret's value is never repeated in the message.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable

import click
from click.core import ParameterSource

from ..values import short

ORIGIN = re.compile(r"\*|[a-z][a-z0-9+.\-]*://[^/\s]+")  # scheme://host[:port], no path; or '*'
ROOT_PATH = re.compile(r"(/[^/\s]+)+")  # /a/b: a leading slash, none trailing


def _where(ctx: click.Context, param: click.Parameter) -> str:
    """The flag, or the environment variable the value came from."""
    if ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT and isinstance(param.envvar, str):
        return f"the environment variable {param.envvar}"
    return "/".join(param.opts)


def _text_problem(value: str, secret: bool) -> str | None:
    """What is wrong with a setting's text as such, or None."""
    if not value:
        return "got an empty value"
    if value != value.strip():
        padding = value[len(value.rstrip()):] or value[: len(value) - len(value.lstrip())]
        return (f"got a value padded with whitespace ({padding[:8]!r}: a file read whole keeps its newline); "
                "expected the value alone")
    bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        where = "" if secret else f" in {short(value, 40)}"
        return f"got a control character (U+{ord(bad):04X}){where}; expected printable text"
    return None


def text_setting(form: Callable[[str], str | None] | None = None, secret: bool = False, free_text: bool = False):
    """A click callback that refuses an empty, padded or control-character value (or, for an option that reads an
    environment variable, that variable set but empty), then ``form(value)``'s problem, if it names one.
    ``free_text``: whitespace and newlines are the value's own (a template): only emptiness is refused."""

    def check(ctx: click.Context, param: click.Parameter, value):
        envvar = param.envvar if isinstance(param.envvar, str) else None
        if value is None:
            if envvar is not None and envvar in os.environ:  # set, and empty: click would take it as unset
                raise click.ClickException(f"the environment variable {envvar}: got an empty value; expected a value, "
                                           "or the variable unset")
            return None
        for item in value if isinstance(value, tuple) else (value,):
            problem = ("got an empty value" if not item else None) if free_text else _text_problem(item, secret)
            problem = problem or (form(item) if form is not None else None)
            if problem is not None:
                raise click.ClickException(f"{_where(ctx, param)}: {problem}")
        return value

    return check


def check_environment(*names: str) -> None:
    """Refuse, in one line, an environment variable among ``names`` that is set but empty, padded or holds a control
    character (``SPECDEPLOY_CACHE``: a padded path would make a directory of that name)."""
    for name in names:
        value = os.environ.get(name)
        problem = None if value is None else _text_problem(value, secret=False)
        if problem is not None:
            raise click.ClickException(f"the environment variable {name}: {problem}; or leave it unset")


def root_path_form(value: str) -> str | None:
    if ROOT_PATH.fullmatch(value):
        return None
    return f"got {short(value, 80)}; expected a path prefix such as '/llm' (a leading slash, none trailing)"


def origins_form(value: str) -> str | None:
    """An --allowed-origins value: origins separated by commas, or a JSON list (parsed later, its items checked)."""
    if value.lstrip().startswith("["):
        return None
    for origin in value.split(","):
        if not ORIGIN.fullmatch(origin.strip()):
            return f"got the origin {short(origin.strip(), 80)}; expected scheme://host[:port] without a path, or '*'"
    return None


def networks_form(value: str) -> str | None:
    """--forwarded-allow-ips: addresses or networks (CIDR) separated by commas, or '*'."""
    for item in value.split(","):
        item = item.strip()
        if item == "*":
            continue
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            return f"got {short(item, 80)}; expected IP addresses or networks (CIDR) separated by commas, or '*'"
    return None
