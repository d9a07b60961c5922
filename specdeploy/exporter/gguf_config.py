"""The config and tokenizer of a GGUF file whose architecture transformers cannot load from GGUF (granite, olmo2,
smollm3, olmoe, granitemoe and Mixtral, which the converter writes as a llama with experts, in transformers 5.25), or
loads without the mixture's sizes (its qwen2moe, qwen3moe and gpt-oss readers drop the experts' width, which the
converter writes as ``expert_feed_forward_length``), read from the file's metadata under the key names llama.cpp's
converter (convert_hf_to_gguf.py) writes, one function per architecture, as transformers' own ``GGUF_CONFIG_ARCHS`` does.

What a file does not say is what llama.cpp assumes when it runs the file, not transformers' config defaults: a Granite
file without ``attention.scale`` scales scores by head_dim^-1/2 (GraniteConfig's default would be 1), SmolLM3's
rope-less layers are every fourth (llama.cpp's fixed ``n_no_rope_layer_step``; the converter writes no key for them),
a qwen3moe, Mixtral, GraniteMoE or gpt-oss file renormalizes its chosen experts' weights and a qwen2moe or OLMoE file
does not (llama.cpp's per-architecture choice; no key says it), gpt-oss's SwiGLU is clamped at 7 with alpha 1.702 and
its windowed layers alternate with full ones, and every sparse layer is sparse (llama.cpp builds these mixtures with no
dense layer between them).
What cannot be read back is refused in one line rather than exported as a different model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .errors import ExportError


@dataclass(frozen=True)
class GgufFamily:
    """An architecture we read ourselves: its transformers ``model_type``, the config fields its metadata gives beyond
    the common ones, and the transformers tensor processor its tensors need (``"llama"``: q and k rows un-permuted
    from llama.cpp's interleaved rotary order, for files converted as a Llama is)."""

    model_type: str
    extra: Callable[[dict, int, int], dict]  # (metadata, layers, head_dim) -> fields, which win over the common ones
    processor: str | None = None
    claims: Callable[[dict], bool] = lambda meta: True  # whether a file of the architecture is ours to read

    def model_type_of(self, fields: dict) -> str:
        """The model type a file's fields make (granitemoe with a shared expert: granitemoeshared)."""
        return fields.pop("model_type", self.model_type)


def _granite(meta: dict, layers: int, head_dim: int) -> dict:
    head_dim = meta["embedding_length"] // meta["attention.head_count"]  # llama.cpp's Granite ignores key_length
    # the converter writes each multiplier under a *_scale name, and only when it is set (non-zero)
    return {"head_dim": head_dim,
            "embedding_multiplier": meta.get("embedding_scale", 1.0), "residual_multiplier": meta.get("residual_scale", 1.0),
            "logits_scaling": meta.get("logit_scale", 1.0),
            "attention_multiplier": meta.get("attention.scale", head_dim ** -0.5)}


def _olmo2(meta: dict, layers: int, head_dim: int) -> dict:
    if meta.get("attention.sliding_window"):  # OLMo 3, converted as olmo2: a family we have not described
        raise ExportError(f"olmo2: attention.sliding_window {meta['attention.sliding_window']} (an OLMo 3 file) is not "
                          "supported; expected an OLMo 2 file, without sliding windows")
    return {}


NO_ROPE_LAYER_STEP = 4  # llama.cpp's SmolLM3: layer i does not rotate where (i + 1) % 4 == 0


def _smollm3(meta: dict, layers: int, head_dim: int) -> dict:
    return {"no_rope_layers": [int((i + 1) % NO_ROPE_LAYER_STEP != 0) for i in range(layers)], "use_sliding_window": False}


def _need(meta: dict, key: str):
    if key not in meta:
        raise ExportError(f"the GGUF metadata has no {key}; expected it of a mixture of experts converted by llama.cpp")
    return meta[key]


def _experts(count: str, normalized: bool | None, width: str = "intermediate_size"):
    """The fields of a mixture's experts: their count under the config field ``count``, top-k, each expert's width under
    ``width`` (from ``expert_feed_forward_length``, or the dense ``feed_forward_length``), renormalization where the
    config has a field for it (``normalized`` None: the family fixes it)."""

    def fields(meta: dict) -> dict:
        found = {count: _need(meta, "expert_count"), "num_experts_per_tok": _need(meta, "expert_used_count"),
                 width: meta.get("expert_feed_forward_length", meta.get("feed_forward_length"))}
        return found | ({} if normalized is None else {"norm_topk_prob": normalized})

    return fields


def _qwen3moe(meta: dict, layers: int, head_dim: int) -> dict:
    return _experts("num_experts", True, "moe_intermediate_size")(meta)


def _qwen2moe(meta: dict, layers: int, head_dim: int) -> dict:
    return _experts("num_experts", False, "moe_intermediate_size")(meta) | {
        "shared_expert_intermediate_size": meta.get("expert_shared_feed_forward_length", 0)}


def _olmoe(meta: dict, layers: int, head_dim: int) -> dict:
    return _experts("num_experts", False)(meta) | {"clip_qkv": meta.get("attention.clamp_kqv")}


def _granitemoe(meta: dict, layers: int, head_dim: int) -> dict:
    shared = meta.get("expert_shared_feed_forward_length", 0)
    return _granite(meta, layers, head_dim) | _experts("num_local_experts", None)(meta) | (
        {"model_type": "granitemoeshared", "shared_intermediate_size": shared} if shared else {})


def _mixtral(meta: dict, layers: int, head_dim: int) -> dict:
    return _experts("num_local_experts", None)(meta) | {"sliding_window": meta.get("attention.sliding_window")}


GPT_OSS_ROPE = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}  # gpt-oss's YaRN, which no key says


def _gpt_oss(meta: dict, layers: int, head_dim: int) -> dict:
    return _experts("num_local_experts", None)(meta) | {"sliding_window": _need(meta, "attention.sliding_window"),
                                                         "attention_bias": True}


GGUF_FAMILIES = {
    "granite": GgufFamily("granite", _granite, processor="llama"),
    "olmo2": GgufFamily("olmo2", _olmo2),
    "smollm3": GgufFamily("smollm3", _smollm3, processor="llama"),
    "qwen3moe": GgufFamily("qwen3_moe", _qwen3moe),
    "qwen2moe": GgufFamily("qwen2_moe", _qwen2moe),
    "olmoe": GgufFamily("olmoe", _olmoe),
    "granitemoe": GgufFamily("granitemoe", _granitemoe, processor="llama"),
    "gpt-oss": GgufFamily("gpt_oss", _gpt_oss),
    # Mixtral: a llama with experts (a llama without is transformers' to read)
    "llama": GgufFamily("mixtral", _mixtral, processor="llama", claims=lambda meta: bool(meta.get("llama.expert_count"))),
}
ROPE_SCALING = ("none", "linear", "yarn")


def architecture_of(reader) -> str:
    return reader.fields["general.architecture"].contents()


def peek_architecture(path) -> str | None:
    """A GGUF file's ``general.architecture`` when it is the file's first metadata entry (gguf-py's writer and
    llama.cpp's converter put it there), read without parsing the rest (seconds for a large vocabulary); None
    otherwise. The header is ``check_gguf_header``'s to vet first."""
    with open(path, "rb") as handle:
        header = handle.read(24 + 8 + 64)
    length = int.from_bytes(header[24:32], "little")
    if header[32 : 32 + length] != b"general.architecture":
        return None
    start = 32 + length
    kind, size = int.from_bytes(header[start : start + 4], "little"), int.from_bytes(header[start + 4 : start + 12], "little")
    if kind != 8 or size > 64:  # 8: a string
        return None
    with open(path, "rb") as handle:
        handle.seek(start + 12)
        return handle.read(size).decode("utf-8", "replace")


def claims(reader) -> bool:
    """Whether a GGUF file (``reader``: gguf-py's GGUFReader over it) is one ``read_config`` reads."""
    family = GGUF_FAMILIES.get(architecture_of(reader))
    return family is not None and family.claims({key: field.contents() for key, field in reader.fields.items()
                                                 if key.endswith(".expert_count")})


def read_config(reader):
    """The transformers config of a GGUF file (``reader``: gguf-py's GGUFReader over it) of an architecture in
    ``GGUF_FAMILIES``."""
    from transformers import AutoConfig

    arch = architecture_of(reader)
    family = GGUF_FAMILIES[arch]
    meta = {key[len(arch) + 1 :]: reader.fields[key].contents() for key in reader.fields if key.startswith(arch + ".")}
    names = {tensor.name for tensor in reader.tensors}

    def need(key: str):
        if key not in meta:
            raise ExportError(f"{arch}: the GGUF metadata has no {arch}.{key}; expected it of a file converted by "
                              "llama.cpp")
        return meta[key]

    if "rope_freqs.weight" in names:  # llama3-style scaling is stored as a tensor of factors, not as a config
        raise ExportError(f"{arch}: a rope_freqs tensor (Llama 3-style RoPE scaling) is not read back; expected a file "
                          "without it")
    hidden, heads, layers = need("embedding_length"), need("attention.head_count"), need("block_count")
    head_dim = meta.get("attention.key_length", hidden // heads)  # a family's ``extra`` may say otherwise (Granite)
    rope = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 10000.0))}
    scaling = meta.get("rope.scaling.type", "none")
    if scaling not in ROPE_SCALING:
        raise ExportError(f"{arch}: rope.scaling.type {scaling!r} is not supported; supported: {', '.join(ROPE_SCALING)}")
    if scaling != "none":
        rope |= {"rope_type": scaling, "factor": float(need("rope.scaling.factor"))}
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(need("rope.scaling.original_context_length"))
            if family.model_type == "gpt_oss":
                rope |= GPT_OSS_ROPE
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta.get("vocab_size", len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ExportError(f"{arch}: the GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")

    def token(key: str):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else int(field.contents())

    fields = {
        "max_position_embeddings": need("context_length"),
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": rope,
        "vocab_size": int(vocab),
        # llama.cpp's converters write the output projection only where it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": token("bos_token_id"),
        "eos_token_id": token("eos_token_id"),
        "pad_token_id": token("padding_token_id"),
        **family.extra(meta, layers, head_dim),
    }
    model_type = family.model_type_of(fields)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise ExportError(f"{arch}: the GGUF metadata makes no valid {model_type} config ({exc})") from exc


def read_tokenizer(path) -> tuple[object, dict]:
    """The tokenizer a GGUF file's metadata describes (a ``tokenizers.Tokenizer``) and its tokenizer_config (BOS/EOS
    tokens, chat template, add_bos_token), built by transformers' GGUF tokenizer converter, which does not depend on
    the model's architecture."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer, config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer)
    return backend, config
