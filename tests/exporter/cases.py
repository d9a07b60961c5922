"""The tiny model of every registered architecture (and variant) that parity and TensorRT tests use."""

from tests import tiny

# Llama-family head_dim 16: ONNX Runtime's GroupQueryAttention (the fused form) rotates only multiples of 16.
FUSED_READY = {"hidden_size": 64}
# head_dim 16 apart from hidden / heads (32 / 4 = 8)
APART = {"head_dim": 16}
WINDOW = 4  # shorter than every text the parity tests run (7 to 14 tokens) and the greedy tests (40)
# each layer's kind: the first windowed, the second full
LAYER_TYPES = ["sliding_attention", "full_attention"]
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2}


def longrope(rotary_dim: int) -> dict:
    """Long-RoPE's parameters for ``rotary_dim`` rotated dims of each head: one short and one long factor per frequency."""
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(rotary_dim // 2)],
            "long_factor": [1.0 + 0.5 * i for i in range(rotary_dim // 2)]}


# Phi-4-mini's partial rotary (0.75 of each head) under long-RoPE, at head_dim 64: GroupQueryAttention (the fused form)
# rotates multiples of 16 dims, and 48 of 64 is one (Phi-4-mini's is 96 of 128). One head at hidden 64: Phi-3's
# config takes head_dim as hidden / heads, and two heads at hidden 128 amplify fp16 and int8 rounding past
# test_family_formats' tolerances on these untrained weights (the same with full rotary); test_families' long-RoPE
# test runs partial rotary over grouped heads.
PARTIAL = {"hidden_size": 64, "num_attention_heads": 1, "num_key_value_heads": 1, "partial_rotary_factor": 0.75,
           "rope_scaling": longrope(48)}


def gemma3_multimodal():
    """Gemma 3's multimodal config around the gemma3_text case's text config, with a one-layer vision tower (left out of
    the export); its head tied, as Gemma 3's is, in the text config and the outer one alike. The text config's logits
    soft-cap stays: transformers' multimodal model applies none, and parity holds only if the export does not either."""
    from transformers import Gemma3Config

    text = PARITY_CASES["gemma3_text"]().to_dict() | {"tie_word_embeddings": True}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=True)


# name -> config factory; every registered model_type must appear (see test_parity's meta-test).
PARITY_CASES = {
    "llama": lambda: tiny.llama_config("llama", **FUSED_READY),
    "llama-rope-llama3": lambda: tiny.llama_config(
        "llama", **FUSED_READY, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16}),
    "llama-rope-linear": lambda: tiny.llama_config("llama", **FUSED_READY, rope_scaling={"rope_type": "linear",
                                                                                            "factor": 2.0}),
    # YaRN's attention factor (0.1 ln(factor) + 1 = 1.14) scales cos and sin
    "llama-rope-yarn": lambda: tiny.llama_config("llama", **FUSED_READY, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-tied": lambda: tiny.llama_config("llama", **FUSED_READY, tie_word_embeddings=True),
    "mistral": lambda: tiny.llama_config("mistral", **FUSED_READY, sliding_window=None),
    "mistral-window": lambda: tiny.llama_config("mistral", **FUSED_READY, sliding_window=WINDOW),
    "qwen2": lambda: tiny.llama_config("qwen2", **FUSED_READY, tie_word_embeddings=True),
    # per-head q/k norms; the second layer windowed (Qwen windows the layers from max_window_layers on)
    "qwen3": lambda: tiny.llama_config("qwen3", **APART, use_sliding_window=True, sliding_window=WINDOW,
                                       max_window_layers=1),
    "gemma2": lambda: tiny.llama_config("gemma2", **APART, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                                        final_logit_softcapping=4.0, sliding_window=WINDOW, layer_types=LAYER_TYPES,
                                        tie_word_embeddings=True),
    # a local RoPE base for windowed layers, a global one (linear-scaled) for full ones; per-head q/k norms
    "gemma3_text": lambda: tiny.llama_config("gemma3_text", **APART, query_pre_attn_scalar=24, final_logit_softcapping=6.0,
                                             sliding_window=WINDOW, layer_types=LAYER_TYPES, rope_parameters={
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
    # fused q/k/v and gate/up; long-RoPE (attention factor sqrt(1 + ln 4 / ln 64) = 1.15), texts within its 64 positions
    "gemma3": gemma3_multimodal,  # the multimodal checkpoint's language model
    "phi3": lambda: tiny.llama_config("phi3", **FUSED_READY, rope_scaling=longrope(16), original_max_position_embeddings=64,
                                      sliding_window=None, pad_token_id=0),
    # three quarters of each head rotated, with long-RoPE (texts within its 64 positions; test_families crosses them)
    "phi3-partial": lambda: tiny.llama_config("phi3", **PARTIAL, original_max_position_embeddings=64, sliding_window=None,
                                              pad_token_id=0),
    # half of each head rotated: 8 dims, which GroupQueryAttention cannot rotate (it takes multiples of 16)
    "phi3-partial8": lambda: tiny.llama_config("phi3", **FUSED_READY, partial_rotary_factor=0.5, sliding_window=None,
                                               pad_token_id=0),
    "granite": lambda: tiny.llama_config("granite", **APART, embedding_multiplier=6.0, attention_multiplier=0.05,
                                         residual_multiplier=0.3, logits_scaling=4.0),
    "olmo2": lambda: tiny.llama_config("olmo2", **APART),
    # the second layer without RoPE, and windowed (SmolLM3 windows only rope-less layers)
    "smollm3": lambda: tiny.llama_config("smollm3", **APART, no_rope_layers=[1, 0], use_sliding_window=True,
                                         sliding_window=WINDOW, pad_token_id=None),
    "gpt2": lambda: tiny.gpt2_config(),
    # mixtures of experts: 4 experts, top-2, experts as wide as head_dim 16's fused form needs
    # unrenormalized weights; layer 1 of 3 dense (mlp_only_layers); every layer windowed
    "qwen3_moe": lambda: tiny.llama_config("qwen3_moe", **APART, num_hidden_layers=3, mlp_only_layers=[1], **EXPERTS,
                                           moe_intermediate_size=32, use_sliding_window=True, sliding_window=WINDOW),
    # renormalized; a sigmoid-gated shared expert; layer 0 dense (decoder_sparse_step 2); q/k/v biases; the first
    # layer windowed
    "qwen2_moe": lambda: tiny.llama_config("qwen2_moe", **FUSED_READY, **EXPERTS, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=2,
                                           use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "mixtral": lambda: tiny.llama_config("mixtral", **FUSED_READY, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=WINDOW),
    "olmoe": lambda: tiny.llama_config("olmoe", **FUSED_READY, **EXPERTS, pad_token_id=0),  # q/k norms per projection
    "granitemoe": lambda: tiny.llama_config("granitemoe", **FUSED_READY, num_local_experts=4, num_experts_per_tok=2,
                                            embedding_multiplier=6.0, attention_multiplier=0.05, residual_multiplier=0.3,
                                            logits_scaling=4.0),
    "granitemoeshared": lambda: tiny.llama_config("granitemoeshared", **FUSED_READY, num_local_experts=4,
                                                  num_experts_per_tok=2, shared_intermediate_size=32,
                                                  residual_multiplier=0.3, attention_multiplier=0.25),
    # attention sinks, windowed and full layers alternating, YaRN (attention factor 1.14), router bias, expert biases,
    # SwiGLU clamped at 1 (alpha 1.702, up + 1)
    "gpt_oss": lambda: tiny.llama_config("gpt_oss", **FUSED_READY, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                         intermediate_size=32, sliding_window=WINDOW, swiglu_limit=1.0,
                                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                          "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                          "beta_slow": 1.0, "truncate": False}),
    # hybrids (recurrent layers beside attention): a short convolution before an attention layer with per-head q/k norms
    "lfm2": lambda: tiny.llama_config("lfm2", **APART, layer_types=["conv", "full_attention"], conv_L_cache=3,
                                      norm_eps=1e-5, tie_word_embeddings=True),
    # Mamba-2 (2 groups of 2 heads) before attention without RoPE, as Granite 4.0-H has it; Granite's multipliers
    "granitemoehybrid": lambda: tiny.llama_config(
        "granitemoehybrid", **APART, layer_types=["mamba", "attention"], num_local_experts=0, mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, shared_intermediate_size=48,
        position_embedding_type=None, embedding_multiplier=6.0, attention_multiplier=0.05, residual_multiplier=0.3,
        logits_scaling=4.0),
    # the same with Granite MoE's routed experts beside the shared MLP on every layer (4, top-2, 32 wide)
    "granitemoehybrid-experts": lambda: tiny.llama_config(
        "granitemoehybrid", **APART, layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, shared_intermediate_size=48, position_embedding_type=None, embedding_multiplier=6.0,
        attention_multiplier=0.05, residual_multiplier=0.3, logits_scaling=4.0),
}
MIXTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "granitemoeshared", "gpt_oss")

# cases one graph form refuses, with why (tests/exporter/test_families.py checks the refusal)
REFUSED = {("phi3-partial8", "fused"): "rotary dimension to be a multiple of 16"}
