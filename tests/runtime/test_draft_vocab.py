"""A draft that scores only the first N tokens (``export --draft-vocab N``): output stays the target's."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from scipy.stats import chi2_contingency

from specdeploy import GenerationConfig, Pipeline
from specdeploy.cli import main
from specdeploy.contract import ContractError, Manifest
from tests import tiny
from tests.runtime.test_lossless_sampling import ALPHA, SAMPLED, _end_to_end_counts

KEPT = tiny.VOCAB // 2
PROMPTS = ["w5 w6 w7", "w9", "w30 w31 w30 w31", "w100 w101"]
NEW = 24


@pytest.fixture(scope="module")
def trimmed(fused_dirs):
    return Pipeline.load(fused_dirs["trimmed"])


@pytest.fixture(scope="module")
def close(fused_dirs):
    return Pipeline.load(fused_dirs["close"])


def test_the_draft_scores_the_kept_tokens_as_before_and_the_rest_minus_infinity(trimmed, close):
    assert trimmed.draft.spec.vocab_kept == KEPT and trimmed.target.spec.vocab_kept is None
    ids, past = np.array([[5, 6, 7, 90], [100, 101, 9, 3]]), np.zeros(2, np.int64)
    cut = trimmed.draft.infer(ids, past, trimmed.draft.allocate_cache(2, 8)).logits.copy()
    full = close.draft.infer(ids, past, close.draft.allocate_cache(2, 8)).logits
    np.testing.assert_allclose(cut[..., :KEPT], full[..., :KEPT], atol=1e-5)
    assert np.isneginf(cut[..., KEPT:]).all()
    assert (full.argmax(-1) >= KEPT).any()  # the full draft would have proposed tokens the cut one cannot


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("policy", ["fixed", "cost"])
def test_greedy_output_is_the_targets_and_outside_tokens_are_never_drafted(trimmed, k, policy):
    plain = trimmed.generate(PROMPTS, GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True))
    spec = trimmed.generate(PROMPTS, GenerationConfig(k=k, policy=policy, drafter="model", max_new_tokens=NEW,
                                                       ignore_eos=True))
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert any(t >= KEPT for r in plain for t in r.token_ids)  # the target does emit tokens the draft leaves out
    drafted = [r for result in spec for r in result.records if r.drafted > 0]
    if policy == "fixed":  # the cost policy may find drafting does not pay on these dispatch-bound tiny models
        assert sum(r.accepted for r in drafted) > 0 and any(r.accepted < r.drafted for r in drafted)
    # a token outside the kept ones can only come from the target: as a correction or bonus, never accepted
    for result in spec:
        position = 0
        for record in result.records:
            accepted = result.token_ids[position : position + record.accepted]
            assert all(t < KEPT for t in accepted), (accepted, record)
            position += record.committed


def test_sampled_output_follows_the_targets_distribution(trimmed):
    prompt = "w30 w31 w30 w31 w30"
    plain = _end_to_end_counts(trimmed, GenerationConfig(drafter="none", seed=11, **SAMPLED), prompt)
    spec = _end_to_end_counts(trimmed, GenerationConfig(k=3, policy="fixed", drafter="model", seed=12, **SAMPLED), prompt)
    for position in (0, 1):
        a, b = [x[position] for x in plain], [x[position] for x in spec]
        tokens = sorted(set(a) | set(b))
        table = np.array([[a.count(t) for t in tokens], [b.count(t) for t in tokens]])
        table = table[:, table.sum(0) >= 5]
        assert table.shape[1] >= 2, "the processed distribution should not be degenerate"
        assert chi2_contingency(table).pvalue >= ALPHA, f"position {position}: {table}"


@pytest.mark.parametrize("extra,message", [
    (["--draft-vocab", "64"], "there is no draft model to trim"),
    (["--draft-vocab", "64", "--draft", "D", "--graph", "explicit"], "needs the fused graph form"),
    (["--draft-vocab", str(tiny.VOCAB), "--draft", "D", "--graph", "fused"], "leaves nothing out of the vocabulary"),
    (["--draft-vocab", "0", "--draft", "D"], "0 is not in the range x>=1"),
])
def test_a_draft_vocab_that_cannot_apply_is_refused(checkpoints, tmp_path, extra, message):
    args = ["export", "--target", str(checkpoints["target"]), "--out", str(tmp_path / "out"),
            *[str(checkpoints["close"]) if a == "D" else a for a in extra]]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_the_manifest_allows_a_cut_vocabulary_on_the_draft_alone(fused_dirs, tmp_path):
    for role, value, message in (("target", 64, "only a draft may leave tokens out"),
                                 ("draft", tiny.VOCAB, "vocab_kept must be an integer in"),
                                 ("draft", True, "vocab_kept must be an integer in")):
        broken = tmp_path / f"{role}-{value}"
        shutil.copytree(fused_dirs["trimmed"], broken)
        manifest = json.loads((broken / "manifest.json").read_text())
        manifest["models"][role]["vocab_kept"] = value
        (broken / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ContractError, match=message):
            Manifest.read(broken)
    shown = CliRunner().invoke(main, ["inspect", str(fused_dirs["trimmed"])], env={"COLUMNS": "240"})
    assert shown.exit_code == 0 and f"{tiny.VOCAB} (scores {KEPT})" in shown.output, shown.output
