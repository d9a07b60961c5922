"""The suite's shared traces (tests/traces.py) are keyed by what a trace reads: the same checkpoint saved in two
places shares one, a checkpoint that differs in a weight or in its config does not."""

from __future__ import annotations

import json
from types import SimpleNamespace

from transformers import AutoConfig

from specdeploy.exporter.options import Form
from tests import tiny, traces


def _key(directory, capacity=96, form=Form()):
    checkpoint = SimpleNamespace(source=str(directory), config=AutoConfig.from_pretrained(directory))
    return traces._key(SimpleNamespace(name="llama"), checkpoint, "dims", capacity, form)


def test_a_trace_is_keyed_by_the_checkpoints_content_not_where_it_lies(tmp_path):
    model = tiny.build_model(tiny.llama_config(), seed=0)
    first, second = (tiny.save_checkpoint(model, tmp_path / name) for name in ("first", "second"))
    assert _key(first) == _key(second)  # the config as loaded names its directory: not part of the key
    assert _key(first) != _key(first, capacity=64)
    assert _key(first) != _key(first, form=Form(graph="fused"))
    assert _key(first) == _key(first, form=Form(filled_slots=64))  # OpenVINO's form rewrites the same trace
    other = tiny.save_checkpoint(tiny.build_model(tiny.llama_config(), seed=1), tmp_path / "other")
    assert _key(first) != _key(other)
    config = json.loads((second / "config.json").read_text())
    (second / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-3}))
    assert _key(first) != _key(second)
