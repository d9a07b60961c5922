"""Acceptance rules: which drafted tokens survive verification, and which token comes next.

Glossary (as in vLLM's rejection sampler):
- *draft tokens* d_1..d_K: proposed by the drafter, with proposal distributions q_1..q_K.
- *accepted* tokens: the longest prefix of the drafts that survives; n of them, 0 <= n <= K.
- *recovered* token: emitted at the first rejection (position n + 1) instead of d_{n+1}; greedy
  takes the target's argmax there, sampling draws from normalise(max(0, p_{n+1} - q_{n+1})).
- *bonus* token: emitted when all K drafts are accepted, from the target's p_{K+1}.
Every cycle emits n + 1 tokens: n accepted plus one recovered or bonus token.

A seeded request uses *keyed* verification instead (``keyed_accept_row``): each position's token is drawn from
noise keyed by its seed and position (``sampling.keyed_noise``); the draft proposes the token that same noise
picks from q, and a draft is kept while it equals the token the noise picks from p. Every emitted token is then
exactly the token plain seeded decoding emits at that position, whatever the draft length, drafter or batch
mates: the same seed gives the same text. It keeps fewer drafts than the rule above (for p and q at total
variation d, at least (1 - d) / (1 + d) against 1 - d).

Outputs follow vLLM: ``accepted`` [batch] and ``emitted`` [batch, K + 1] padded with -1.
Pure functions: no I/O, no timing, no globals; randomness comes from the caller's generators.
"""

from __future__ import annotations

import numpy as np

from ..engines.base import EngineOutput
from .rows import BatchView
from .sampling import keyed_token, penalize_rows, row_probabilities, sample

PAD = -1


def greedy_accept_row(target_argmax: list[int], drafts: list[int]) -> int:
    """Greedy verification of one row: how many leading drafts equal the target's argmax.

    target_argmax: K + 1 ints; drafts: K ints. The row emits target_argmax[:accepted + 1] (accepted
    drafts equal the target's argmax, so every emitted token is the argmax at its position). On
    Python ints: a row holds a handful of tokens, where each NumPy call costs more than the loop.
    """
    accepted = 0
    for draft, target in zip(drafts, target_argmax):
        if draft != target:
            break
        accepted += 1
    return accepted


def speculative_accept(
    p: np.ndarray,
    q: np.ndarray | None,
    drafts: np.ndarray,
    rngs: list[np.random.Generator],
    limits: list[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Distribution-preserving speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    p: [batch, K + 1, vocab] target probabilities (processed); q: [batch, K, vocab] draft
    probabilities, or None when the drafter proposes deterministically (q is one-hot on the
    draft); drafts: [batch, K]; rngs: one generator per row.
    Draft d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the
    recovered token is drawn from normalise(max(0, p_i - q_i)); after K accepts the bonus token is
    drawn from p_{K+1}. The emitted tokens are then distributed exactly as p.
    ``limits`` [batch] caps the drafts row b may keep: after limits[b] accepts its next token is drawn
    from p there, exactly as if it had been offered only limits[b] drafts (still exactly p).
    Returns accepted [batch] and emitted [batch, K + 1] (-1 padded).
    """
    drafts = np.asarray(drafts, dtype=np.int64)
    batch, k = drafts.shape
    rows = np.arange(batch)[:, None]
    cols = np.arange(k)[None, :]
    p_draft = p[rows, cols, drafts]  # [batch, K]
    q_draft = np.ones_like(p_draft) if q is None else q[rows, cols, drafts]  # [batch, K]
    ratio = np.divide(p_draft, q_draft, out=np.zeros_like(p_draft), where=q_draft > 0)  # [batch, K]
    if limits is None:
        uniforms = np.stack([rng.random(k) for rng in rngs]) if k else np.zeros((batch, 0))  # [batch, K]
    else:  # a row draws for its own drafts only: its randomness does not depend on its batch mates' k
        uniforms = np.full((batch, k), np.inf)
        for b, (rng, limit) in enumerate(zip(rngs, limits)):
            uniforms[b, :limit] = rng.random(limit)
    accepted = np.cumprod(uniforms < ratio, axis=1).sum(axis=1)  # [batch]
    emitted = np.full((batch, k + 1), PAD, dtype=np.int64)
    for b in range(batch):
        n = int(accepted[b])
        emitted[b, :n] = drafts[b, :n]
        target = p[b, n]  # [vocab]
        if n < k and (limits is None or n < limits[b]):
            proposal = q[b, n] if q is not None else _one_hot(drafts[b, n], target.shape[-1])
            residual = np.maximum(target - proposal, 0.0)
            # p == q exactly leaves no residual mass; rejection then has probability 0 in exact
            # arithmetic, and p itself is the right fallback for what rounding left.
            target = residual if residual.sum() > 0 else target
        emitted[b, n] = sample(target, rngs[b])
    return accepted, emitted


def keyed_accept_row(p: np.ndarray, drafts: list[int], drafted: int, noise: list[np.ndarray]) -> tuple[int, list[int]]:
    """Keyed verification of one seeded row: p [K + 1, vocab] its target probabilities (processed), ``drafted`` of
    its K drafts real, ``noise`` K + 1 arrays [vocab] keyed by the positions they decide. Returns (accepted, the
    target's keyed tokens [K + 1]): the drafts kept are those equal to the target's keyed tokens, and the row emits
    those tokens up to the first that differs."""
    target = [keyed_token(p[j], noise[j]) for j in range(len(noise))]
    return min(greedy_accept_row(target, drafts), drafted), target


def sampled_accept(p: np.ndarray, q: np.ndarray | None, drafts: np.ndarray, drafted: list[int],
                   rngs: list[np.random.Generator], noises: list[list[np.ndarray] | None]) -> tuple[list[int], list[list[int]]]:
    """Sampling verification of a batch: p [batch, K + 1, vocab], q [batch, K, vocab] or None, drafts [batch, K] of which
    row b has ``drafted[b]``; a row with ``noises[b]`` (K + 1 keyed arrays: a seeded row) by ``keyed_accept_row``, the
    others by ``speculative_accept`` with their generators. Returns (accepted, emitted tokens) per row."""
    if all(noise is None for noise in noises):
        accepted, emitted = speculative_accept(p, q, drafts, rngs, drafted)
        return accepted.tolist(), emitted.tolist()
    accepted, emitted = [], []
    for b, noise in enumerate(noises):
        if noise is not None:
            n, tokens = keyed_accept_row(p[b], drafts[b].tolist(), drafted[b], noise)
        else:
            n, tokens = speculative_accept(p[b : b + 1], None if q is None else q[b : b + 1], drafts[b : b + 1], [rngs[b]],
                                           [drafted[b]])
            n, tokens = int(n[0]), tokens[0].tolist()
        accepted.append(n)
        emitted.append(tokens)
    return accepted, emitted


def _one_hot(token: int, vocab: int) -> np.ndarray:
    out = np.zeros(vocab)
    out[token] = 1.0
    return out


def accept_rows(verified: EngineOutput, drafts: np.ndarray, drafted: list[int], q: np.ndarray | None,
                rows: BatchView) -> tuple[list[int], list[list[int]]]:
    """A cycle's verification of ``rows``: (accepted drafts, emitted tokens) per row, from the target's ``verified``
    output over drafts [batch, K] (row b's first ``drafted[b]`` real; q [batch, K, vocab] or None: one-hot). Greedy on
    Python ints while every row is greedy, from the target's argmax ids alone (on a GPU, K + 1 integers a row reach
    the host, not K + 1 rows of logits); else by ``sampled_accept``, seeded rows keyed by position."""
    logits = None if rows.greedy and not rows.penalized else verified.logits  # greedy alone: the ids suffice
    if rows.penalized:
        logits = penalize_rows(logits, rows.tokens, rows.lengths, drafts, rows.configs)
    if rows.greedy:  # each row keeps the drafts equal to the target's argmax, then emits its own token
        target = (verified.ids if logits is None else logits.argmax(-1)).tolist()  # [batch][K + 1]
        return [min(greedy_accept_row(t, d), n) for t, d, n in zip(target, drafts.tolist(), drafted)], target
    p = row_probabilities(logits, rows.configs)  # [batch, K + 1, vocab]
    width, vocab = drafts.shape[1], p.shape[-1]
    noises = [None if rows.noise(b, at, vocab) is None else [rows.noise(b, at + j, vocab) for j in range(width + 1)]
              for b, at in enumerate(rows.lengths)]  # seeded rows' draws keyed by position
    return sampled_accept(p, q, drafts, drafted, rows.rngs(), noises)
