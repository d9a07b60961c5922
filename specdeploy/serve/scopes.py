"""Whose earlier answers a request drafts from: the server's suffix index scopes.

A draft never changes a text (the target verifies every token), but its speed can: a request whose answer another
client's earlier answer contains decodes faster, and a client that times its requests could learn whether someone
asked the same. So by default each API key has an index of its own: the bearer token a request presents (checked by
``--api-key``, or by a gateway in front), hashed, names its scope; requests without one share the "anonymous" scope.
``global`` shares one index among all requests (one tenant, or texts that are public anyway); ``none`` keeps each
request to its own prompt and answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping

from ..runtime.suffix import SuffixIndex
from ..runtime.suffix_store import SuffixStore

SCOPES = ("key", "global", "none")


def suffix_scopes(store: SuffixStore, scope: str) -> Callable[[Mapping[str, str]], SuffixIndex | None]:
    """headers -> the index a request under them drafts from and adds its answer to, as ``scope`` says."""
    if scope not in SCOPES:
        raise ValueError(f"suffix scope: got {scope!r}; expected one of {', '.join(SCOPES)}")
    if scope == "none":
        return lambda headers: None
    if scope == "global":  # asked of the store each time, as a key's: an index it evicted is never used again
        return lambda headers: store.scope("global")
    return lambda headers: store.scope(key_scope(headers.get("authorization", "")))


def key_scope(authorization: str) -> str:
    """The scope of an ``Authorization`` header: a hash of its bearer token (never the token), else "anonymous"."""
    kind, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if kind.lower() != "bearer" or not token:
        return "anonymous"
    return "key:" + hashlib.sha256(token.encode()).hexdigest()[:32]
