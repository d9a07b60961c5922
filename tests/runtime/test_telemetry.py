"""Cycle records: the fields renamed in 0.5 still read under their old names, with a DeprecationWarning."""

from __future__ import annotations

import warnings

import pytest

from specdeploy.runtime.policies import CycleOutcome
from specdeploy.runtime.telemetry import RENAMED, CycleRecord, FinalToken, summarize, upgraded


def _record(**fields) -> CycleRecord:
    base = dict(request_id="req-0", cycle=3, drafted=4, accepted=2, rejected_at=3, final=FinalToken.RECOVERED,
                committed=3, draft_s=0.01, verify_s=0.02, accept_s=0.001, cache_s=0.002, batch_size=1, free=True,
                drafted_from="req-9")
    return CycleRecord(**{**base, **fields})


@pytest.mark.parametrize("old,new", sorted(RENAMED.items()))
def test_an_old_attribute_reads_the_new_field_with_a_deprecation(old, new):
    record = _record()
    with pytest.warns(DeprecationWarning, match=f"CycleRecord.{old} is deprecated: use CycleRecord.{new}"):
        assert getattr(record, old) == getattr(record, new)
    assert old not in record.to_dict() and new in record.to_dict()  # written under the new name only


def test_a_record_written_before_0_5_is_read_under_the_new_names():
    record = _record()
    old = {{"drafted": "k", "committed": "emitted", "free": "lookup"}.get(k, k): v for k, v in record.to_dict().items()}
    with pytest.warns(DeprecationWarning, match="k, emitted, lookup are deprecated"):
        assert CycleRecord.from_dict({"type": "cycle", "config": "x", **old}) == record
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a current record reads with no warning
        assert CycleRecord.from_dict(record.to_dict()) == record and upgraded(record.to_dict()) == record.to_dict()
    assert summarize([CycleRecord.from_dict(record.to_dict())])["tokens"] == 3


def test_the_policys_outcome_keeps_lookup_as_a_deprecated_name_of_free():
    outcome = CycleOutcome(2, drafted=[3, 0], accepted=[1, 0], free=[True, False])
    with pytest.warns(DeprecationWarning, match="CycleOutcome.lookup is deprecated: use CycleOutcome.free"):
        assert outcome.lookup == [True, False]
