"""Logit processing agrees with transformers' own processors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdeploy import GenerationConfig
from specdeploy.runtime.sampling import penalize, penalize_positions, probabilities, sample


def _reference(logits, config, seen=None):
    x = torch.tensor(logits)[None]
    ids = torch.tensor(seen if seen is not None else [], dtype=torch.long)[None]
    if config.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(config.repetition_penalty)(ids, x)
    x = TemperatureLogitsWarper(config.temperature)(ids, x)
    if config.top_k:
        x = TopKLogitsWarper(config.top_k)(ids, x)
    if config.top_p < 1:
        x = TopPLogitsWarper(config.top_p)(ids, x)
    if config.min_p:
        x = MinPLogitsWarper(config.min_p)(ids, x)
    return torch.softmax(x, -1)[0].numpy()


@pytest.mark.parametrize("options", [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.9, top_k=20, top_p=0.6),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.0, repetition_penalty=1.3, top_k=10),
])
def test_probabilities_match_transformers(options):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, 64)
    seen = np.array([3, 7, 7, 20])
    config = GenerationConfig(**options)
    ours = probabilities(penalize(logits, seen, config.repetition_penalty), config)
    np.testing.assert_allclose(ours, _reference(logits, config, seen), atol=1e-6)


def test_greedy_is_one_hot_on_the_argmax():
    logits = np.array([[0.1, 3.0, 2.9], [5.0, -1.0, 0.0]])
    probs = probabilities(logits, GenerationConfig(temperature=0))
    np.testing.assert_array_equal(probs, [[0, 1, 0], [1, 0, 0]])


def test_penalty_per_position_sees_earlier_drafts():
    logits = np.ones((3, 5))
    out = penalize_positions(logits, history=np.array([0]), drafts=np.array([1, 2]), penalty=2.0)
    np.testing.assert_array_equal(out[0], [0.5, 1, 1, 1, 1])
    np.testing.assert_array_equal(out[1], [0.5, 0.5, 1, 1, 1])
    np.testing.assert_array_equal(out[2], [0.5, 0.5, 0.5, 1, 1])


def test_sample_follows_probabilities_and_skips_zeros():
    rng = np.random.default_rng(0)
    probs = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    draws = np.bincount([sample(probs, rng) for _ in range(4000)], minlength=5)
    assert draws[0] == draws[2] == draws[4] == 0
    assert abs(draws[3] / 4000 - 0.75) < 0.03
