"""The tiny model of every registered architecture (and variant) that parity and TensorRT tests use."""

from tests import tiny

# Llama-family head_dim 16: ONNX Runtime's GroupQueryAttention (the fused form) rotates only multiples of 16.
FUSED_READY = {"hidden_size": 64}

# name -> config factory; every registered model_type must appear (see test_parity's meta-test).
PARITY_CASES = {
    "llama": lambda: tiny.llama_config("llama", **FUSED_READY),
    "llama-rope-llama3": lambda: tiny.llama_config(
        "llama", **FUSED_READY, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16}),
    "llama-rope-linear": lambda: tiny.llama_config("llama", **FUSED_READY, rope_scaling={"rope_type": "linear",
                                                                                            "factor": 2.0}),
    "llama-tied": lambda: tiny.llama_config("llama", **FUSED_READY, tie_word_embeddings=True),
    "mistral": lambda: tiny.llama_config("mistral", **FUSED_READY, sliding_window=None),
    "qwen2": lambda: tiny.llama_config("qwen2", **FUSED_READY, tie_word_embeddings=True),
    "gpt2": lambda: tiny.gpt2_config(),
}
