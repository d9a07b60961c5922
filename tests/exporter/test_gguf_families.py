"""GGUF checkpoints of the families beyond Llama: each exported in both graph forms gives the logits and the greedy
tokens of transformers' own model loaded from the same file.

Only the architectures transformers can load from GGUF are here (its ``GGUF_SUPPORTED_ARCHITECTURES``): qwen3,
phi3, gemma2 and gemma3. Granite, OLMo 2 and SmolLM3 are not among them: we read their config from the metadata
ourselves, and test_gguf_config holds their files to the Hugging Face models they were converted from.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdeploy import GenerationConfig, Pipeline
from tests import tiny
from tests.exporter.test_gguf import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, VOCAB, reference, write_tiny_gguf

HEAD_DIM, WINDOW = HIDDEN // HEADS, 8  # a window shorter than prompt plus output: the sliding layers are exercised
KV = KV_HEADS * HEAD_DIM


def layers(shapes: dict[str, tuple | None]) -> dict[str, tuple | None]:
    """Per-layer tensors, by their GGUF names without the ``blk.N.`` prefix and ``.weight`` suffix."""
    return {f"blk.{i}.{name}.weight": shape for i in range(LAYERS) for name, shape in shapes.items()}


def gemma_metadata(writer) -> None:
    writer.add_key_length(HEAD_DIM)  # Gemma's head size is its own key, not hidden / heads
    writer.add_value_length(HEAD_DIM)
    writer.add_sliding_window(WINDOW)


GEMMA2_TENSORS = {"output.weight": None,  # tied to the embedding, as Gemma's files are
                  **layers({"post_attention_norm": (HIDDEN,), "post_ffw_norm": (HIDDEN,)})}
QK_NORMS = layers({"attn_q_norm": (HEAD_DIM,), "attn_k_norm": (HEAD_DIM,)})
QWEN3_HEAD_DIM = 128  # transformers reads no head size from a qwen3 GGUF: its config's default, as every Qwen3 has


def qwen3_metadata(writer) -> None:
    writer.add_key_length(QWEN3_HEAD_DIM)  # as llama.cpp writes it, though transformers does not read it
    writer.add_value_length(QWEN3_HEAD_DIM)


QWEN3_TENSORS = layers({"attn_q": (HEADS * QWEN3_HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * QWEN3_HEAD_DIM, HIDDEN),
                        "attn_v": (KV_HEADS * QWEN3_HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * QWEN3_HEAD_DIM),
                        "attn_q_norm": (QWEN3_HEAD_DIM,), "attn_k_norm": (QWEN3_HEAD_DIM,)})


def phi3_metadata(writer) -> None:
    writer.add_pad_token_id(VOCAB - 9)  # the end-of-text id, as Phi-3's files say; else Phi3Config's 32000 is past the vocab


FAMILIES = {  # GGUF architecture: (seed, metadata beside Llama's, tensors added, replaced or dropped); seeds whose
    # greedy tokens are not one token repeated (a tied head, as Gemma's, favours the token it was given)
    "qwen3": (3, qwen3_metadata, QWEN3_TENSORS),
    "phi3": (4, phi3_metadata, layers({"attn_q": None, "attn_k": None, "attn_v": None,
                                       "attn_qkv": (HIDDEN + 2 * KV, HIDDEN), "ffn_gate": None,
                                       "ffn_up": (2 * INTERMEDIATE, HIDDEN)})),  # fused, as Phi-3 holds them
    "gemma2": (3, gemma_metadata, GEMMA2_TENSORS),
    "gemma3": (1, gemma_metadata, GEMMA2_TENSORS | QK_NORMS),
}
PROMPT = [5, 97, 98, 99, 257, 40, 41]
NEW = 16


@pytest.fixture(autouse=True)
def traced_in_this_process(monkeypatch):
    """These tiny GGUFs are traced in the test's own process: a child per export (the default for a GGUF file, which
    test_gguf.py's CLI exports keep, and test_external_data.py checks) costs ~6 s of CPU to start, more than the fused
    export itself; what this file checks is each family's graph, which is the same wherever it is traced."""
    from specdeploy.exporter import artifact

    monkeypatch.setattr(artifact, "_is_large", lambda source: False)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """One GGUF per family, transformers' model of it, the greedy tokens that model gives after ``PROMPT`` and its
    logits over prompt and tokens (past the sliding window)."""
    seed, metadata, tensors = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    write_tiny_gguf(path, seed=seed, architecture=request.param, metadata=metadata, tensors=tensors)
    model = reference(path)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW):  # no cache: each step recomputes the whole sequence, the plainest reference
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = model(torch.tensor([ids])).logits[0].numpy()
    return request.param, path, model, ids, logits


# both forms read the same config and weights (what is new here), and each form's graph of each family is held to
# transformers elsewhere (test_parity): the explicit form's trace (seconds) is paid for Gemma 2 alone
EXPORTS = [(name, "fused") for name in sorted(FAMILIES)] + [("gemma2", "explicit")]


@pytest.mark.parametrize("family,graph", EXPORTS, indirect=["family"])
def test_a_family_gguf_exports_with_transformers_logits_and_greedy_tokens(tmp_path, family, graph):
    name, path, model, ids, expected = family
    assert model.config.model_type == {"gemma3": "gemma3_text"}.get(name, name)  # the family's own model, not Llama
    assert len(set(ids[len(PROMPT):])) >= 3  # tokens that tell one model from another
    art = tiny.export_cli(tmp_path / "art", path, None, "--graph", graph)
    assert tiny.read_json(art / "manifest.json")["models"]["target"]["architecture"] == model.config.model_type
    pipeline = Pipeline.load(art)
    engine = pipeline.target
    logits = engine.infer(np.array([ids], np.int64), np.array([0], np.int64), engine.allocate_cache(1, 96)).logits[0]
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * scale, err_msg=f"{name} {graph}")
    tokens = pipeline.generate([PROMPT], GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True))
    assert tokens[0].token_ids == ids[len(PROMPT):]
