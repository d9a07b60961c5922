"""GGUF files of the families transformers cannot load from GGUF (granite, olmo2, smollm3): their config read from the
metadata (exporter/gguf_config.py), exported in both graph forms with the logits and greedy tokens of transformers' own
model that the file was converted from.

Each file is written here as llama.cpp's converter writes one (convert_hf_to_gguf.py: its keys, its tensor names, q and
k rows permuted for the families it converts as a Llama), from a tiny random Hugging Face model with settings that bite:
Granite's multipliers far from 1, OLMo 2's norms
after attention and MLP and its q/k norms over the projection, SmolLM3's fourth layer without RoPE (llama.cpp's fixed
step: the converter writes no key for it), a tied head.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from specdeploy import GenerationConfig, Pipeline
from specdeploy.exporter import export_artifact
from specdeploy.exporter.checkpoint import load_checkpoint, load_tokenizer_and_config
from specdeploy.exporter.errors import ExportError
from specdeploy.exporter.registry import architecture_of
from tests import tiny

VOCAB = 300
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             max_position_embeddings=256)
# GGUF architecture: (the HF config, whether its q/k rows are stored permuted, the metadata the converter adds)
FAMILIES = {
    "granite": (lambda: tiny.llama_config("granite", **SIZES, embedding_multiplier=6.0, residual_multiplier=0.3,
                                          logits_scaling=4.0, attention_multiplier=0.05),
                True, lambda w, c: (w.add_embedding_scale(c.embedding_multiplier), w.add_residual_scale(c.residual_multiplier),
                                    w.add_logit_scale(c.logits_scaling), w.add_attention_scale(c.attention_multiplier))),
    "olmo2": (lambda: tiny.llama_config("olmo2", **SIZES, tie_word_embeddings=True), False, None),
    "smollm3": (lambda: tiny.llama_config("smollm3", **SIZES | {"num_hidden_layers": 4}, pad_token_id=None), True, None),
}
PROMPT = [5, 97, 98, 99, 257, 40, 41]
NEW = 16


def permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its interleaved rotary (convert_hf_to_gguf.py's LlamaModel.permute)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path, model, architecture: str, permute: bool, extra=None) -> None:
    """``model`` as llama.cpp's converter writes a file of ``architecture``, with a byte-level BPE tokenizer of VOCAB
    tokens (``add_tokenizer``)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if permute:  # written by the converter's LlamaModel; OLMo 2's (TextModel) writes no vocab size: the token count
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    if extra is not None:
        extra(writer, config)
    add_tokenizer(writer)
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture)
    table = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    kv_heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head is the embedding: no output tensor
        stem, _, suffix = name.rpartition(".")
        array = tensor.numpy().astype(np.float32)
        projection = stem.rpartition(".")[2]
        if permute and projection in kv_heads:
            array = permuted(array, kv_heads[projection])
        writer.add_tensor(f"{table.get_name(stem)}.{suffix}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tokenizer(writer, vocab: int = VOCAB) -> None:
    """A byte-level BPE tokenizer of ``vocab`` tokens as llama.cpp's converter writes one (ids 256.. are "ab", "abc" and
    fillers; the last two BOS and EOS, EOS spelled as GPT-2's, which transformers' byte-level tokenizer would otherwise
    add past the vocabulary)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["ab", "abc"]
    tokens += [f"<extra{i}>" for i in range(vocab - 1 - len(tokens))] + ["<|endoftext|>"]  # as GPT-2's vocabulary ends
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["a b", "ab c"])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)


BUILT: dict[str, tuple] = {}  # one file per family for the module, whichever parametrization asks for it


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """One GGUF per family, written from a tiny random HF model; the model, its greedy tokens after ``PROMPT`` (no
    cache: each step recomputes the whole sequence) and its logits over prompt and tokens."""
    name = request.param
    if name not in BUILT:
        config, permute, extra = FAMILIES[name]
        model = tiny.build_model(config(), seed=3)
        path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
        write_gguf(path, model, name, permute, extra)
        ids = list(PROMPT)
        with torch.no_grad():
            for _ in range(NEW):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            logits = model(torch.tensor([ids])).logits[0].numpy()
        BUILT[name] = (name, path, model, ids, logits)
    return BUILT[name]


def test_the_config_read_from_the_metadata_is_the_models(family):
    name, path, model, _, _ = family
    _, config = load_tokenizer_and_config(path, tokenizer=False)
    expected = model.config
    assert config.model_type == expected.model_type == name
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                  "vocab_size", "tie_word_embeddings", "rms_norm_eps", "max_position_embeddings",
                  "embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier",
                  "no_rope_layers"):
        assert getattr(config, field, None) == pytest.approx(getattr(expected, field, None)), field
    described = architecture_of(name)
    assert described.dims(config) == described.dims(expected)  # head_dim among them, where a config has none
    checkpoint = load_checkpoint(path)
    assert set(checkpoint.weights) == set(model.state_dict()) - ({"lm_head.weight"} if expected.tie_word_embeddings else set())
    for weight, value in model.state_dict().items():
        if weight in checkpoint.weights:  # q and k rows back in Hugging Face's order
            np.testing.assert_array_equal(checkpoint.weights[weight].numpy(), value.numpy(), err_msg=weight)
    assert checkpoint.eos_token_ids == (VOCAB - 1,)


# both forms read the same config and weights (what is new here), and each form's graph of each family is held to
# transformers elsewhere (test_parity): the explicit form's trace (seconds) is paid for Granite alone
EXPORTS = [(name, "fused") for name in sorted(FAMILIES)] + [("granite", "explicit")]


@pytest.mark.parametrize("family,graph", EXPORTS, indirect=["family"])
def test_a_gguf_transformers_cannot_load_exports_with_the_models_logits_and_greedy_tokens(tmp_path, family, graph):
    name, path, model, ids, expected = family
    assert len(set(ids[len(PROMPT):])) >= 3  # tokens that tell one model from another
    manifest = export_artifact(path, tmp_path / "art", graph=graph, capacity=96, isolate=False)
    assert manifest.target.architecture == name
    pipeline = Pipeline.load(tmp_path / "art")
    engine = pipeline.target
    logits = engine.infer(np.array([ids], np.int64), np.array([0], np.int64), engine.allocate_cache(1, 96)).logits[0]
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * float(np.abs(expected).max()),
                               err_msg=f"{name} {graph}")
    tokens = pipeline.generate([PROMPT], GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True))
    assert tokens[0].token_ids == ids[len(PROMPT):]


def test_a_granite_file_without_attention_scale_scales_scores_by_head_dim(tmp_path):
    """The converter writes a multiplier only where it is set; llama.cpp then scales scores by head_dim^-1/2, where
    GraniteConfig's own default would be 1."""
    model = tiny.build_model(FAMILIES["granite"][0](), seed=3)
    path = tmp_path / "granite.gguf"
    write_gguf(path, model, "granite", True)
    config = load_tokenizer_and_config(path, tokenizer=False)[1]
    assert config.attention_multiplier == 16 ** -0.5
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("architecture,extra,refusal", [
    ("olmo2", lambda w, c: w.add_sliding_window(4), "olmo2: attention.sliding_window 4 (an OLMo 3 file) is not supported"),
    ("granite", lambda w, c: w.add_tensor("rope_freqs.weight", np.ones(8, np.float32)),
     "granite: a rope_freqs tensor (Llama 3-style RoPE scaling) is not read back"),
    ("smollm3", lambda w, c: (w.add_rope_scaling_type(gguf_rope("LONGROPE")), w.add_rope_scaling_factor(4.0)),
     "smollm3: rope.scaling.type 'longrope' is not supported"),
])
def test_what_the_metadata_cannot_say_is_refused_in_one_line(tmp_path, architecture, extra, refusal):
    """An OLMo 3 file (converted as olmo2, with sliding windows), Llama 3-style RoPE factors (a tensor, not a config) and
    a RoPE scaling we do not read would each export a different model: refused in one line, naming what was found,
    before anything is written."""
    model = tiny.build_model(FAMILIES[architecture][0](), seed=3)
    path = tmp_path / f"{architecture}.gguf"
    write_gguf(path, model, architecture, FAMILIES[architecture][1], extra)
    with pytest.raises(ExportError, match=re.escape(refusal)):
        load_tokenizer_and_config(path, tokenizer=False)
    with pytest.raises(ExportError, match=re.escape(refusal)) as refused:
        export_artifact(path, tmp_path / "art", isolate=False)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "art").exists()


def gguf_rope(name: str):
    import gguf

    return getattr(gguf.RopeScalingType, name)


def test_a_file_without_an_architecture_is_refused_in_one_line(tmp_path):
    """The architecture decides which reader builds the config: a file whose metadata names none is refused naming the
    file, whatever gguf-py makes of it."""
    key, value = b"general.name", b"granite"
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
                      + len(key).to_bytes(8, "little") + key + (8).to_bytes(4, "little") + len(value).to_bytes(8, "little")
                      + value)
    with pytest.raises(ExportError, match=f"{re.escape(str(other))}: cannot be loaded as GGUF .*general.architecture"):
        load_tokenizer_and_config(other, tokenizer=False)


@pytest.mark.parametrize("scaling,expected", [
    (lambda w: (w.add_rope_scaling_type(gguf_rope("LINEAR")), w.add_rope_scaling_factor(2.0)),
     {"rope_type": "linear", "factor": 2.0}),
    (lambda w: (w.add_rope_scaling_type(gguf_rope("YARN")), w.add_rope_scaling_factor(4.0),
                w.add_rope_scaling_orig_ctx_len(64)),
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
])
def test_rope_scaling_is_read_from_the_metadata(tmp_path, scaling, expected):
    """Linear and YaRN scaling as the converter writes them (type, factor, original context) become the config's
    rope_parameters, and the export's RoPE tables are the ones transformers computes from them."""
    from specdeploy.exporter.rope import ropes

    model = tiny.build_model(FAMILIES["smollm3"][0](), seed=3)
    path = tmp_path / "smollm3.gguf"
    write_gguf(path, model, "smollm3", True, lambda w, c: scaling(w))
    config = load_tokenizer_and_config(path, tokenizer=False)[1]
    assert config.rope_parameters == {"rope_theta": model.config.rope_parameters["rope_theta"], **expected}
    reference = tiny.llama_config("smollm3", **SIZES | {"num_hidden_layers": 4},
                                  rope_parameters={"rope_theta": model.config.rope_parameters["rope_theta"], **expected})
    ours, theirs = ropes(config, 16), ropes(reference, 16)
    assert set(ours) == set(theirs) and all(torch.equal(ours[k].inv_freq, theirs[k].inv_freq) and
                                            ours[k].scaling == theirs[k].scaling for k in ours)
