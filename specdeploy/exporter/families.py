"""The decoder families besides Llama's, each a description of how it differs from Llama (``family.Family``) over
the one block builder (``llama.DecoderVerify``). Weight names are transformers' own, so a GGUF file, whose tensors
``GgufWeights`` names through transformers' model skeleton, reads the same. A multimodal checkpoint's language model
(Gemma 3) is the text family over its text config and its text weights (``LanguageModelOf``)."""

from __future__ import annotations

import copy
from collections.abc import MutableMapping

from .dims import Dims
from .family import GEMMA_NORMS, POST_NORMS, Family
from .llama import DecoderVerify, DescribedArchitecture
from .registry import register

QWEN3 = Family("qwen3", ("qwen3",), qk_norm="head")
GEMMA2 = Family("gemma2", ("gemma2",), norms=GEMMA_NORMS, norm_offset=1.0, scaled_embedding=True,
                query_pre_attn_scalar=True, attention_softcap=True, final_softcap=True)
# transformers' Gemma 3 reads no attn_logit_softcapping (its attention is never passed one): neither do we
GEMMA3 = Family("gemma3", ("gemma3_text",), norms=GEMMA_NORMS, norm_offset=1.0, qk_norm="head", scaled_embedding=True,
                query_pre_attn_scalar=True, final_softcap=True)
PHI3 = Family("phi3", ("phi3",), fused_projections=True)
GRANITE = Family("granite", ("granite",), multipliers=True)
OLMO2 = Family("olmo2", ("olmo2",), norms=POST_NORMS, qk_norm="projection")
SMOLLM3 = Family("smollm3", ("smollm3",), rope_layers=True)

for family in (QWEN3, GEMMA2, GEMMA3, PHI3, GRANITE, OLMO2, SMOLLM3):
    register(DescribedArchitecture(family))


class LanguageModelOf:
    """The language model of a multimodal checkpoint (Gemma 3's Gemma3ForConditionalGeneration, model_type "gemma3"),
    as the registry's ``Architecture``: its text config (``config.text_config``) and its text weights under the
    decoder's own names; image inputs are not exported (the vision tower and projector are left unread)."""

    # the checkpoint's prefixes of the language model's weights: transformers 5's, then the hub's original files'
    PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))

    def __init__(self, text: DescribedArchitecture, model_types: tuple[str, ...]):
        self.text, self.name, self.model_types = text, text.name, model_types

    def dims(self, config) -> Dims:
        return self.text.dims(self.text_config(config))

    def features(self, config) -> tuple[str, ...]:
        return (*self.text.features(self.text_config(config)), "language model only: image inputs are not exported")

    def build(self, config, weights, capacity: int, streamed: bool = False) -> DecoderVerify:
        return self.text.build(self.text_config(config), TextWeights(weights, self.PREFIXES), capacity, streamed)

    @staticmethod
    def text_config(config):
        """The text config as the multimodal model computes it: transformers' Gemma3ForConditionalGeneration applies
        no final_logit_softcapping (its text-only Gemma3ForCausalLM does; Gemma 3's own configs set none)."""
        text = copy.copy(config.text_config)
        text.final_logit_softcapping = None
        return text


class TextWeights(MutableMapping):
    """``weights`` (a checkpoint's, read as taken) under the names ``prefixes`` map them to; the others are hidden
    and never read. Deleting a name deletes (releases) the checkpoint's tensor."""

    def __init__(self, weights, prefixes: tuple[tuple[str, str], ...]):
        self.weights, self.names = weights, {}
        for name in weights:
            for theirs, ours in prefixes:
                if name.startswith(theirs):
                    self.names[ours + name[len(theirs) :]] = name
                    break

    def __getitem__(self, name: str):
        return self.weights[self.names[name]]

    def __delitem__(self, name: str) -> None:
        del self.weights[self.names.pop(name)]

    def __setitem__(self, name, value) -> None:
        raise TypeError("checkpoint weights are read-only")

    def __contains__(self, name) -> bool:  # without reading the tensor, as Mapping's own would
        return name in self.names

    def __iter__(self):
        return iter(list(self.names))

    def __len__(self) -> int:
        return len(self.names)


register(LanguageModelOf(DescribedArchitecture(GEMMA3), ("gemma3",)))
