"""GGUF checkpoints: read as written, exported in both graph forms with transformers' logits, lossless."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy import GenerationConfig, Pipeline
from specdeploy.exporter import ExportOptions, artifact
from specdeploy.exporter.checkpoint import gguf_vocabulary_digest, load_checkpoint
from specdeploy.exporter.registry import ExportError
from tests import tiny

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 64, 2, 4, 2, 128, 300


def write_tiny_gguf(path, seed: int = 0, extra: str = "extra", quantized=None, reshaped=None,
                    architecture: str = "llama", metadata=None, tensors=None) -> dict[str, np.ndarray]:
    """A random GGUF (fp32 tensors; matrices in ``quantized``'s type if given) with a byte-level BPE tokenizer that
    merges "abc"; returns the tensors written (before quantization), by GGUF name.

    Llama's metadata and tensors by default; another ``architecture`` adds its own keys through ``metadata`` (called
    with the writer) and its tensors through ``tensors`` (GGUF name: a shape to add or replace, None to drop)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    tokens = list(bytes_to_unicode().values()) + ["ab", "abc"]
    tokens += [f"<{extra}{i}>" for i in range(VOCAB - 8 - len(tokens))]
    writer.add_vocab_size(VOCAB)  # room for the tokens transformers' converter adds (as real models pad theirs)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["a b", "ab c"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    if metadata is not None:
        metadata(writer)
    rng = np.random.default_rng(seed)
    kv = KV_HEADS * HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                   f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (kv, HIDDEN),
                   f"blk.{i}.attn_v.weight": (kv, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                   f"blk.{i}.ffn_gate.weight": (INTERMEDIATE, HIDDEN), f"blk.{i}.ffn_up.weight": (INTERMEDIATE, HIDDEN),
                   f"blk.{i}.ffn_down.weight": (HIDDEN, INTERMEDIATE)}
    shapes |= tensors or {}
    shapes = {name: shape for name, shape in shapes.items() if shape is not None}
    shapes |= reshaped or {}  # tensors that disagree with the metadata
    written = {}
    for name, shape in shapes.items():  # norms near 1, the rest small: logits that are not all ties
        centre, spread = (1.0, 0.1) if name.endswith("norm.weight") else (0.0, 0.05)
        written[name] = rng.normal(centre, spread, shape).astype(np.float32)
        if quantized is not None and len(shape) == 2:
            writer.add_tensor(name, gguf.quants.quantize(written[name], quantized), raw_dtype=quantized)
        else:
            writer.add_tensor(name, written[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def unpermuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per head for its rotary; Hugging Face's rotate-half order undoes it."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


HF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
            "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


@pytest.fixture(scope="module")
def gguf_file(written):
    return written[0]


def reference(gguf_file):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()


def test_gguf_weights_tokenizer_and_eos_are_read_as_written(written):
    path, tensors = written
    checkpoint = load_checkpoint(path)
    expected = {}
    for name, array in tensors.items():
        parts = name.split(".")
        if parts[0] == "blk":
            layer, kind = parts[1], parts[2]
            if kind in ("attn_q", "attn_k"):
                array = unpermuted(array, HEADS if kind == "attn_q" else KV_HEADS)
            expected[f"model.layers.{layer}.{HF_NAMES[kind]}.weight"] = array
        else:
            expected[f"{HF_NAMES[parts[0]]}.weight"] = array
    assert set(checkpoint.weights) == set(expected)
    for name, array in expected.items():
        assert checkpoint.weights[name].dtype == torch.float32
        np.testing.assert_array_equal(checkpoint.weights[name].numpy(), array, err_msg=name)
    assert checkpoint.tokenizer.encode("abc").ids == [257]  # the merges came through
    assert checkpoint.eos_token_ids == (VOCAB - 9,)
    assert checkpoint.config.num_key_value_heads == KV_HEADS and checkpoint.config.vocab_size == VOCAB


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_gguf_weights_are_transformers_own_bit_for_bit(tmp_path, qtype):
    """Tensors are dequantized one at a time as taken, with the values transformers' whole-model load gives."""
    import gguf
    from transformers import AutoModelForCausalLM

    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, quantized=gguf.GGMLQuantizationType[qtype])
    checkpoint = load_checkpoint(path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    expected = model.state_dict()
    assert set(checkpoint.weights) == set(expected)
    assert checkpoint.weights.held() == 0  # nothing is dequantized before it is taken
    assert checkpoint.parameters == sum(p.numel() for p in model.parameters())
    for name, tensor in expected.items():
        taken = checkpoint.weights[name]
        assert taken.dtype == torch.float32 and taken.shape == tensor.shape, name
        torch.testing.assert_close(taken, tensor, rtol=0, atol=0, msg=name)
    assert not torch.equal(checkpoint.weights["model.layers.0.mlp.up_proj.weight"],
                           torch.from_numpy(write_tiny_gguf(tmp_path / "plain.gguf")["blk.0.ffn_up.weight"]))


def test_a_fused_export_holds_one_layer_of_dequantized_weights_at_a_time(tmp_path, gguf_file, monkeypatch):
    """The fused form is written layer by layer, each layer built from the GGUF tensors as it is reached:
    the whole fp32 model (7.1 GB for the 1.5B) is never held, and each tensor is dequantized once."""
    import weakref

    from specdeploy.exporter import llama
    from specdeploy.exporter.gguf_weights import GgufWeights

    reads, most_held, matrices, alive = [], [], [], []  # matrices: the module's transposed copies, weakly
    original, transposed = GgufWeights._read, llama.transposed

    def spied(self, name):
        reads.append(name)
        most_held.append(self.held())
        alive.append(sum(ref() is not None for ref in matrices))
        return original(self, name)

    def kept(weight):
        matrix = transposed(weight)
        matrices.append(weakref.ref(matrix))
        return matrix

    monkeypatch.setattr(GgufWeights, "_read", spied)
    monkeypatch.setattr(llama, "transposed", kept)
    staging = tmp_path / "staging"
    staging.mkdir()
    messages = []
    artifact._trace("target", gguf_file, staging, 96, messages.append, artifact.Form("fused"))
    assert [m for m in messages if "layers written" in m] == ["target: 1/2 layers written", "target: 2/2 layers written"]
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 3 + 9 * LAYERS  # every tensor, once
    firsts = [i for i, name in enumerate(reads)
              if name.startswith("model.layers.") and not reads[i - 1].startswith(name[: name.index(".", 13) + 1])]
    assert len(firsts) == LAYERS
    assert [most_held[i] for i in firsts] == [2] * LAYERS  # only the embedding and the final norm held
    assert [alive[i] for i in firsts] == [1] * LAYERS  # the head's matrix: no earlier layer's weights remain
    assert max(most_held) == 2 + 9 - 1  # never more than one layer's nine tensors besides those


@pytest.mark.parametrize("graph", ["explicit", "fused"])
def test_a_gguf_tensor_that_disagrees_with_the_metadata_is_named(tmp_path, graph):
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path, reshaped={"blk.1.attn_q.weight": (HIDDEN - 8, HIDDEN)})
    with pytest.raises(ExportError, match=r"tensor blk\.1\.attn_q\.weight \(model\.layers\.1\.self_attn\.q_proj\.weight\) "
                                          r"has shape \(56, 64\); the file's metadata \(heads, sizes\) makes it \(64, 64\)"):
        artifact.export_artifact(path, tmp_path / "art", options=ExportOptions(graph=graph, isolate=False))
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("graph", ["explicit", "fused"])
def test_a_gguf_exports_with_transformers_logits_and_speculates_losslessly(tmp_path, gguf_file, graph):
    art = tiny.export_cli(tmp_path / "art", gguf_file, gguf_file, "--graph", graph)
    pipeline = Pipeline.load(art)  # threads= would set the process-wide pool that later plain sessions refuse
    ids = [5, 97, 98, 99, 257, 40, 41]
    engine = pipeline.target
    cache = engine.allocate_cache(1, 96)
    logits = engine.infer(np.array([ids], np.int64), np.array([0], np.int64), cache).logits[0]
    with torch.no_grad():
        expected = reference(gguf_file)(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)
    base = dict(max_new_tokens=16, ignore_eos=True)
    plain = pipeline.generate(["abc ab"], GenerationConfig(drafter="none", **base))[0].token_ids
    speculative = pipeline.generate(["abc ab"], GenerationConfig(k=4, **base))[0].token_ids
    assert speculative == plain and len(plain) == 16


def test_a_gguf_pair_with_one_tokenizer_is_checked_from_its_metadata(tmp_path, monkeypatch):
    """Byte-identical tokenizer metadata (other weights): the pair passes without building either tokenizer."""
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    write_tiny_gguf(target, seed=0)
    write_tiny_gguf(draft, seed=1)
    assert gguf_vocabulary_digest(target) == gguf_vocabulary_digest(draft) is not None

    def slow_path(_):
        raise AssertionError("the tokenizers were built although their metadata is identical")

    monkeypatch.setattr(artifact, "load_tokenizer_and_config", slow_path)
    artifact._check_pair(target, draft)


def test_a_gguf_pair_whose_vocabularies_differ_is_refused_with_the_full_report(tmp_path):
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    write_tiny_gguf(target)
    write_tiny_gguf(draft, extra="other")  # ids 258.. name other tokens
    assert gguf_vocabulary_digest(target) != gguf_vocabulary_digest(draft)
    assert gguf_vocabulary_digest(tmp_path) is None and gguf_vocabulary_digest(tmp_path / "none.gguf") is None
    with pytest.raises(ExportError, match="ids map to different tokens; first: 258: '<extra0>' vs '<other0>'"):
        artifact._check_pair(target, draft)
