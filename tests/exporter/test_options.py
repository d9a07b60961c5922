"""Export options: one validated object for the CLI and ``export_artifact``; errors name the option, got vs expected."""

from __future__ import annotations

import pytest

from specdeploy.exporter import ARCHITECTURES, ExportError, ExportOptions, export_artifact
from specdeploy.exporter.options import Form


@pytest.mark.parametrize("fields,match", [
    (dict(dtype="bfloat16"), r"dtype: got 'bfloat16'; expected one of float32, float16"),
    (dict(weights="int3"), r"weights: got 'int3'; expected one of full, int4, int8"),
    (dict(draft_weights="int2"), r"draft_weights: got 'int2'; expected one of full, int4, int8, or None"),
    (dict(graph="tree"), r"graph: got 'tree'; expected one of explicit, fused"),
    (dict(block_size=48), r"block_size: got 48; expected one of 16, 32, 64, 128, 256"),
    (dict(block_size="32"), r"block_size: got '32'; expected one of 16"),
    (dict(accuracy_level=5), r"accuracy_level: got 5; expected one of 0, 1, 2, 3, 4"),
    (dict(accuracy_level=True), r"accuracy_level: got True"),
    (dict(capacity=1), r"capacity: got 1; expected an integer >= 2, or None"),
    (dict(capacity=64.0), r"capacity: got 64.0; expected an integer >= 2"),
    (dict(draft_vocab=0), r"draft_vocab: got 0; expected a positive integer, or None"),
    (dict(draft_vocab=True), r"draft_vocab: got True; expected a positive integer"),
    (dict(isolate="yes"), r"isolate: got 'yes'; expected True or False or None"),
    (dict(force=1), r"force: got 1; expected True or False"),
])
def test_a_bad_option_is_refused_when_made_naming_it(fields, match):
    with pytest.raises(ExportError, match=match):
        ExportOptions(**fields)


def test_a_draft_vocab_needs_a_draft_then_the_fused_form():
    with pytest.raises(ExportError, match="there is no draft model to trim"):
        ExportOptions(draft_vocab=64).check_draft(None)
    with pytest.raises(ExportError, match=r"draft_vocab: got 64 with the draft's graph 'explicit'; expected graph 'fused'"):
        ExportOptions(draft_vocab=64).check_draft("draft")
    ExportOptions(draft_vocab=64, graph="fused").check_draft("draft")
    ExportOptions(draft_vocab=64, graph="fused", provider="openvino", draft_provider="cpu").check_draft("draft")


def test_each_roles_form_follows_from_the_options():
    options = ExportOptions(dtype="float16", weights="int4", draft_weights="int8", graph="fused", block_size=64,
                            accuracy_level=1, draft_vocab=64)
    assert options.weights_of("target") == "int4" and options.weights_of("draft") == "int8"
    assert options.form("target") == Form("fused", (64, 1), None, "float16")  # int4 quantized as it is written
    # int8's rewrite reads fp32 graphs; a mixture's experts are written int8 (int8=True)
    assert options.form("draft") == Form("fused", None, 64, "float32", int8=True)
    assert ExportOptions(weights="int4").form("target") == Form("explicit", None, None, "float32")


def test_each_model_is_written_for_its_own_provider():
    """OpenVINO's form (explicit, reading the filled slots) for a model written for it; --graph for the CPU provider's."""
    options = ExportOptions(weights="int4", graph="fused", provider="openvino", draft_provider="cpu", block_size=128)
    assert options.provider_of("target") == "openvino" and options.provider_of("draft") == "cpu"
    assert options.form("target") == Form("explicit", None, None, "float32", filled_slots=64)
    assert options.form("draft") == Form("fused", (128, 4), None, "float32")
    assert ExportOptions(provider="openvino").form("draft").filled_slots == 64  # the draft follows the target's
    with pytest.raises(ExportError, match=r"graph: got 'fused' with provider 'openvino'; expected 'explicit'.*"
                                          r"--draft-provider cpu"):
        ExportOptions(graph="fused", provider="openvino")
    with pytest.raises(ExportError, match=r"draft_provider: got 'cuda'; expected one of cpu, openvino, or None"):
        ExportOptions(draft_provider="cuda")


def test_export_artifact_takes_the_options_or_their_fields_and_refuses_before_writing(tmp_path):
    with pytest.raises(ExportError, match=r"block_size: got 48"):
        export_artifact(tmp_path / "missing", tmp_path / "out", block_size=48)
    with pytest.raises(TypeError, match="not both"):
        export_artifact(tmp_path / "missing", tmp_path / "out", options=ExportOptions(), capacity=64)
    with pytest.raises(TypeError, match="capacty"):
        export_artifact(tmp_path / "missing", tmp_path / "out", capacty=64)
    assert not (tmp_path / "out").exists()


def test_every_registered_family_declares_its_sizes_and_both_graph_forms():
    """A family's ``dims`` returns ``Dims`` and its verify model writes the fused form too (``VerifyModel``)."""
    import inspect

    from specdeploy.exporter.dims import Dims

    for arch in set(ARCHITECTURES.values()):
        assert inspect.signature(arch.dims).return_annotation in (Dims, "Dims"), arch.name
        model = inspect.signature(arch.build).return_annotation
        built = vars(inspect.getmodule(arch))[model] if isinstance(model, str) else model
        assert callable(getattr(built, "write_fused", None)) and callable(getattr(built, "forward", None)), arch.name
