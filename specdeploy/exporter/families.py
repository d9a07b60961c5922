"""The decoder families besides Llama's, each a description of how it differs from Llama (``family.Family``) over
the one block builder (``llama.DecoderVerify``). Weight names are transformers' own, so a GGUF file, whose tensors
``GgufWeights`` names through transformers' model skeleton, reads the same. A multimodal checkpoint's language model
(Gemma 3) is the text family over its text config and its text weights (``LanguageModelOf``)."""

from __future__ import annotations

import copy
from collections.abc import MutableMapping

from .dims import Dims
from .experts import Interleaved, PerExpert, RoutedExperts, SharedExpert, StackedHalves
from .family import GEMMA_NORMS, POST_NORMS, Family
from .feed_forward import DenseMLP
from .llama import DecoderVerify, DescribedArchitecture
from .registry import register

QWEN3 = Family("qwen3", ("qwen3",), qk_norm="head")
GEMMA2 = Family("gemma2", ("gemma2",), norms=GEMMA_NORMS, norm_offset=1.0, scaled_embedding=True,
                query_pre_attn_scalar=True, attention_softcap=True, final_softcap=True)
# transformers' Gemma 3 reads no attn_logit_softcapping (its attention is never passed one): neither do we
GEMMA3 = Family("gemma3", ("gemma3_text",), norms=GEMMA_NORMS, norm_offset=1.0, qk_norm="head", scaled_embedding=True,
                query_pre_attn_scalar=True, final_softcap=True)
PHI3 = Family("phi3", ("phi3",), fused_projections=True, feed_forward=DenseMLP(gate_up="gate_up_proj"))
GRANITE = Family("granite", ("granite",), multipliers=True)
OLMO2 = Family("olmo2", ("olmo2",), norms=POST_NORMS, qk_norm="projection")
SMOLLM3 = Family("smollm3", ("smollm3",), rope_layers=True)

# Mixtures of experts: a family's routed experts as its checkpoints store them (experts.RoutedExperts)
QWEN2_MOE = Family("qwen2_moe", ("qwen2_moe",), feed_forward=RoutedExperts(
    shared=SharedExpert(DenseMLP("mlp.shared_expert."), "shared_expert_intermediate_size", gate="mlp.shared_expert_gate")))
QWEN3_MOE = Family("qwen3_moe", ("qwen3_moe",), qk_norm="head", feed_forward=RoutedExperts())
MIXTRAL = Family("mixtral", ("mixtral",), feed_forward=RoutedExperts(
    "block_sparse_moe.", stored=PerExpert("w1", "w3", "w2"), count="num_local_experts", width="intermediate_size",
    normalized=True))
OLMOE = Family("olmoe", ("olmoe",), qk_norm="projection", feed_forward=RoutedExperts(width="intermediate_size"))
GRANITE_EXPERTS = dict(prefix="block_sparse_moe.", router="router.layer", stored=StackedHalves(),
                        count="num_local_experts", width="intermediate_size", normalized=True)  # softmax of the top-k
GRANITE_MOE = Family("granitemoe", ("granitemoe",), multipliers=True, feed_forward=RoutedExperts(**GRANITE_EXPERTS))
GRANITE_MOE_SHARED = Family("granitemoeshared", ("granitemoeshared",), multipliers=True, feed_forward=RoutedExperts(
    **GRANITE_EXPERTS, shared=SharedExpert(DenseMLP("shared_mlp.", gate_up="input_linear", down="output_linear"),
                                            "shared_intermediate_size")))
GPT_OSS = Family("gpt_oss", ("gpt_oss",), attention_sinks=True, feed_forward=RoutedExperts(
    router="router", stored=Interleaved(), count="num_local_experts", width="intermediate_size", normalized=True,
    clamped_swiglu=True))

for family in (QWEN3, GEMMA2, GEMMA3, PHI3, GRANITE, OLMO2, SMOLLM3, QWEN2_MOE, QWEN3_MOE, MIXTRAL, OLMOE, GRANITE_MOE,
               GRANITE_MOE_SHARED, GPT_OSS):
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


class WeightsView(MutableMapping):
    """A checkpoint's weights under other names, read only when taken: ``names`` maps ours to what a subclass's
    ``__getitem__`` and ``__delitem__`` read of ``weights``. Read-only; listing or testing a name reads no tensor."""

    names: dict

    def __setitem__(self, name, value) -> None:
        raise TypeError("checkpoint weights are read-only")

    def __contains__(self, name) -> bool:  # without reading the tensor, as Mapping's own would
        return name in self.names

    def __iter__(self):
        return iter(list(self.names))

    def __len__(self) -> int:
        return len(self.names)


class TextWeights(WeightsView):
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


register(LanguageModelOf(DescribedArchitecture(GEMMA3), ("gemma3",)))
