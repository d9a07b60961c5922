"""The decoder families besides Llama's, each a description of how it differs from Llama (``family.Family``) over
the one block builder (``llama.DecoderVerify``). Weight names are transformers' own, so a GGUF file, whose tensors
``GgufWeights`` names through transformers' model skeleton, reads the same."""

from __future__ import annotations

from .family import GEMMA_NORMS, POST_NORMS, Family
from .llama import DecoderFamily
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
    register(DecoderFamily(family))
