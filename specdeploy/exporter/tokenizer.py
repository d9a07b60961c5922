"""The report of how two tokenizers differ (fingerprints live in the contract)."""

from __future__ import annotations

from tokenizers import Tokenizer

from ..contract import special_tokens as _special_tokens


def differences(a: Tokenizer, b: Tokenizer, names: tuple[str, str] = ("target", "draft")) -> list[str]:
    """Human-readable differences between two tokenizers; empty when they tokenise alike."""
    problems = []
    va, vb = a.get_vocab(with_added_tokens=True), b.get_vocab(with_added_tokens=True)
    if len(va) != len(vb):
        problems.append(f"vocab sizes differ: {names[0]} {len(va)}, {names[1]} {len(vb)}")
    sa, sb = _special_tokens(a), _special_tokens(b)
    if sa != sb:
        only_a = sorted(set(sa.items()) - set(sb.items()))[:5]
        only_b = sorted(set(sb.items()) - set(sa.items()))[:5]
        problems.append(f"special tokens differ: only in {names[0]} {only_a}, only in {names[1]} {only_b}")
    ia, ib = {i: t for t, i in va.items()}, {i: t for t, i in vb.items()}
    differing = [i for i in sorted(set(ia) | set(ib)) if ia.get(i) != ib.get(i)]
    if differing:
        shown = ", ".join(f"{i}: {ia.get(i)!r} vs {ib.get(i)!r}" for i in differing[:5])
        problems.append(f"{len(differing)} ids map to different tokens; first: {shown}")
    return problems
