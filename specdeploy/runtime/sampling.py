"""Logit processing, applied identically to draft and target logits before acceptance.

Order (as transformers applies it): repetition penalty, temperature, top-k, top-p, min-p.
Temperature 0 means greedy: the processed distribution is one-hot on the argmax.
"""

from __future__ import annotations

import math

import numpy as np

from .config import GenerationConfig


def penalize(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """Repetition penalty over tokens in ``seen``: positive logits / penalty, negative * penalty.

    logits: [vocab]; returns a new array.
    """
    out = logits.copy()
    if penalty != 1.0 and seen.size:
        ids = np.unique(seen)
        vals = out[ids]
        out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def penalize_positions(logits: np.ndarray, history: np.ndarray, drafts: np.ndarray, penalty: float) -> np.ndarray:
    """Penalty for each of T positions, position t seeing ``history`` plus ``drafts[:t]``.

    logits: [T, vocab]; history: committed tokens; drafts: [T - 1] (or more). Returns [T, vocab].
    """
    if penalty == 1.0:
        return logits
    return np.stack([penalize(logits[t], np.concatenate([history, drafts[:t]]), penalty) for t in range(len(logits))])


def penalize_rows(logits: np.ndarray, tokens: np.ndarray, lengths: list[int], drafts: np.ndarray,
                  configs: list[GenerationConfig]) -> np.ndarray:
    """``penalize_positions`` for each row b of a verification: logits [batch, K + 1, vocab], its committed
    tokens[b, :lengths[b]] and drafts [batch, K], under its own config's penalty."""
    return np.stack([penalize_positions(logits[b], tokens[b, :at], drafts[b], config.repetition_penalty)
                     for b, (at, config) in enumerate(zip(lengths, configs))])


def probabilities(logits: np.ndarray, config: GenerationConfig) -> np.ndarray:
    """Processed distribution over the vocabulary for each row of ``logits`` [..., vocab] (float64)."""
    logits = np.asarray(logits, dtype=np.float64)
    if config.greedy:
        probs = np.zeros_like(logits)
        np.put_along_axis(probs, logits.argmax(-1)[..., None], 1.0, axis=-1)
        return probs
    scaled = logits / config.temperature
    vocab = scaled.shape[-1]
    if 0 < config.top_k < vocab:
        kth = np.partition(scaled, vocab - config.top_k, axis=-1)[..., vocab - config.top_k, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = _softmax(scaled)
    if config.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop_sorted = (np.cumsum(sorted_p, axis=-1) - sorted_p) >= config.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(-1, keepdims=True)
    if config.min_p > 0:
        floor = config.min_p * probs.max(-1, keepdims=True)
        probs = np.where(probs < floor, 0.0, probs)
        probs /= probs.sum(-1, keepdims=True)
    return probs


def row_probabilities(logits: np.ndarray, configs: list[GenerationConfig]) -> np.ndarray:
    """``probabilities`` with each row of ``logits`` [batch, ..., vocab] under its own config; one pass
    when the rows share their sampling settings (the common case)."""
    key = _sampling_key(configs[0])
    if all(_sampling_key(c) == key for c in configs[1:]):
        return probabilities(logits, configs[0])
    return np.stack([probabilities(logits[b], config) for b, config in enumerate(configs)])


def _sampling_key(config: GenerationConfig) -> tuple:
    return (config.temperature, config.top_k, config.top_p, config.min_p) if not config.greedy else ()


def _softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - x.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


class DistributionError(ArithmeticError):
    """A distribution with no mass to draw from: NaN or infinite probabilities, or all zero."""


def unseeded_generator() -> np.random.Generator:
    """The generator of a request without a seed: fresh entropy (tests replace it to make such runs repeatable)."""
    return np.random.default_rng()


def keyed_noise(seed: int, stream: int, position: int, vocab: int) -> np.ndarray:
    """Exp(1) noise [vocab] for the token at ``position`` of a seeded request: drawn from (seed, stream, position) alone,
    so that what decides a position's token depends on nothing else (draft length, drafter, batch mates)."""
    return np.random.default_rng([seed, stream, position]).standard_exponential(vocab, dtype=np.float32)


def keyed_token(probs: np.ndarray, noise: np.ndarray) -> int:
    """The token of ``probs`` [vocab] that ``noise`` (``keyed_noise``) picks: argmax p_i / E_i, an exact draw from
    ``probs`` for E_i ~ Exp(1) (the exponential race, the Gumbel-max trick's twin)."""
    ratio = probs / noise
    token = int(np.argmax(ratio))
    if not ratio[token] > 0 or not math.isfinite(ratio[token]):  # NaN, infinite or no mass: nothing to draw from
        raise DistributionError(f"a distribution without mass to draw from (its largest weight {ratio[token]!r})")
    return token


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token id drawn from ``probs`` [vocab] (need not be normalised). Raises DistributionError where the
    mass is not a positive finite number (NaN logits; the last id used to come back at every step)."""
    cdf = np.cumsum(probs)
    mass = float(cdf[-1])  # a Python float: this runs for every sampled token, and NumPy scalars compare slowly
    if not 0.0 < mass < math.inf:  # NaN fails both comparisons
        raise DistributionError(f"sampling: the distribution's mass is {mass}; expected a positive finite number "
                                f"({np.isnan(probs).sum()} NaN of {len(probs)} probabilities)")
    return int(min(np.searchsorted(cdf, rng.random() * mass, side="right"), len(probs) - 1))
