"""Whose earlier texts a request drafts from and whose kept K/V it reuses: the server's scopes.

A draft never changes a text (the target verifies every token), but its speed can: a request whose answer another
client's earlier answer contains decodes faster, and a client that times its requests could learn whether someone
asked the same; so can a prompt's first token, where another's kept K/V gave its start. So by default each API key is
a scope of its own: the bearer token a request presents (checked by ``--api-key``, or by a gateway in front), hashed,
names it; requests without one share the "anonymous" scope. ``--suffix-scope`` says whose suffix index a request
drafts from: its key's (``key``), one shared by all requests under the scope "global" (``global``: one tenant, or texts
that are public anyway, K/V shared as well), or none, its own prompt and answer alone (``none``: its K/V still kept and
reused under its key's scope).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping

from ..runtime.suffix import SuffixIndex
from ..runtime.suffix_store import SuffixStore
from ..values import short

SCOPES = ("key", "global", "none")


# headers -> (the scope a request under them keeps and reuses K/V in, the suffix index it drafts from: None for none)
ScopeOf = Callable[[Mapping[str, str]], tuple[str, SuffixIndex | None]]


def suffix_scopes(store: SuffixStore, mode: str) -> ScopeOf:
    """Each request's scope name and suffix index, as ``mode`` (``--suffix-scope``: one of ``SCOPES``) says; an index
    is asked of the store each time, so one it evicted is never used again."""
    if mode not in SCOPES:
        raise ValueError(f"suffix scope: got {short(mode)}; expected one of {', '.join(SCOPES)}")
    if mode == "global":
        return lambda headers: ("global", store.index("global"))

    def of_key(headers: Mapping[str, str]) -> tuple[str, SuffixIndex | None]:
        name = key_scope(headers.get("authorization", ""))
        return name, store.index(name) if mode == "key" else None

    return of_key


def key_scope(authorization: str) -> str:
    """The scope of an ``Authorization`` header: a hash of its bearer token (never the token), else "anonymous"."""
    kind, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if kind.lower() != "bearer" or not token:
        return "anonymous"
    return "key:" + hashlib.sha256(token.encode()).hexdigest()[:32]
