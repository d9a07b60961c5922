"""The config and tokenizer of a GGUF file whose architecture transformers cannot load from GGUF (granite, olmo2,
smollm3, Granite 4.0-H's granitehybrid, olmoe, granitemoe and Mixtral, which the converter writes as a llama with
experts, in transformers 5.25), or loads without the mixture's sizes (its qwen2moe, qwen3moe and gpt-oss readers drop
the experts' width, which the converter writes as ``expert_feed_forward_length``), read from the file's metadata under
the key names llama.cpp's converter (convert_hf_to_gguf.py) writes, one function per architecture, as transformers' own
``GGUF_CONFIG_ARCHS`` does. (Their tensors: gguf_weights.py, with gguf_layouts.py where the converter reshaped them.)

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

import re
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ExportError


@dataclass(frozen=True)
class GgufReader:
    """How we read an architecture's config from GGUF metadata ourselves: its transformers ``model_type``, the config
    fields its metadata gives beyond the common ones, and the transformers tensor processor its tensors need
    (``"llama"``: q and k rows un-permuted from llama.cpp's interleaved rotary order, for files converted as a Llama
    is)."""

    model_type: str
    # (metadata, the file's tensor names, layers, head_dim) -> fields, which win over the common ones
    extra: Callable[[dict, set, int, int], dict]
    processor: str | None = None
    keys: tuple[tuple[str, str], ...] = ()  # (metadata key, config field) ``extra`` reads beyond KEYS, for the checks
    claims: Callable[[dict], bool] = lambda meta: True  # whether a file of the architecture is ours to read

    def model_type_of(self, fields: dict) -> str:
        """The model type a file's fields make (granitemoe with a shared expert: granitemoeshared)."""
        return fields.pop("model_type", self.model_type)


def _granite(meta: dict, names: set, layers: int, head_dim: int) -> dict:
    head_dim = meta["embedding_length"] // meta["attention.head_count"]  # llama.cpp's Granite ignores key_length
    # the converter writes each multiplier under a *_scale name, and only when it is set (non-zero)
    return {"head_dim": head_dim,
            "embedding_multiplier": meta.get("embedding_scale", 1.0), "residual_multiplier": meta.get("residual_scale", 1.0),
            "logits_scaling": meta.get("logit_scale", 1.0),
            "attention_multiplier": meta.get("attention.scale", head_dim ** -0.5)}


def _granite_hybrid(meta: dict, names: set, layers: int, head_dim: int) -> dict:
    """Granite 4.0-H (the converter's GraniteHybridModel, over its Mamba2Model and GraniteMoeModel): Granite's
    multipliers; which layers are Mamba-2 and which attention, from the K/V head count it writes per layer (0: Mamba-2);
    Mamba-2's sizes from its ssm.* keys (heads as ``ssm.time_step_rank``, head size = inner size / heads); RoPE only
    where ``rope.scaling.finetuned`` says the model uses it (Granite 4.0-H: no position embedding); biases where the
    file has their tensors; the shared MLP's width; routed experts as GraniteMoE's where ``expert_count`` > 0 (the
    converter writes their count, top-k and width as GraniteMoeModel does: Granite 4.0-H Tiny's and Small's files,
    mixtures beside the shared MLP)."""
    kv = meta.get("attention.head_count_kv")
    if not isinstance(kv, list) or len(kv) != layers or not all(isinstance(n, int) and n >= 0 for n in kv):
        raise ExportError(f"granitehybrid: attention.head_count_kv: got {kv!r}; expected one K/V head count a layer "
                          f"({layers}; 0 for a Mamba-2 layer)")
    ssm = {key: _need(meta, "granitehybrid", f"ssm.{key}") for key in ("inner_size", "time_step_rank", "group_count",
                                                                       "state_size", "conv_kernel")}
    hidden, inner, heads = meta["embedding_length"], ssm["inner_size"], ssm["time_step_rank"]
    if heads < 1 or inner % heads or inner % hidden:
        raise ExportError(f"granitehybrid: ssm.inner_size {inner}: expected a multiple of ssm.time_step_rank ({heads}, "
                          f"Mamba-2's heads) and of embedding_length ({hidden})")
    return _granite(meta, names, layers, head_dim) | {
        "layer_types": ["attention" if n else "mamba" for n in kv],
        "num_key_value_heads": max(kv) or meta["attention.head_count"],
        "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_expand": inner // hidden,
        "mamba_n_groups": ssm["group_count"], "mamba_d_state": ssm["state_size"], "mamba_d_conv": ssm["conv_kernel"],
        "mamba_conv_bias": any(n.endswith(".ssm_conv1d.bias") for n in names),
        "mamba_proj_bias": any(n.endswith(".ssm_in.bias") for n in names),
        "attention_bias": any(n.endswith(".attn_q.bias") for n in names),
        "shared_intermediate_size": _need(meta, "granitehybrid", "expert_shared_feed_forward_length"),
        "num_local_experts": 0, "num_experts_per_tok": 0,
        "position_embedding_type": "rope" if meta.get("rope.scaling.finetuned") else "nope",
    } | (_experts("granitehybrid", "num_local_experts", None)(meta) if meta.get("expert_count") else {})


def _olmo2(meta: dict, names: set, layers: int, head_dim: int) -> dict:
    if meta.get("attention.sliding_window"):  # OLMo 3, converted as olmo2: a family we have not described
        raise ExportError(f"olmo2: attention.sliding_window {meta['attention.sliding_window']} (an OLMo 3 file) is not "
                          "supported; expected an OLMo 2 file, without sliding windows")
    return {}


NO_ROPE_LAYER_STEP = 4  # llama.cpp's SmolLM3: layer i does not rotate where (i + 1) % 4 == 0


def _smollm3(meta: dict, names: set, layers: int, head_dim: int) -> dict:
    return {"no_rope_layers": [int((i + 1) % NO_ROPE_LAYER_STEP != 0) for i in range(layers)], "use_sliding_window": False}


def _experts(arch: str, count: str, normalized: bool | None, width: str = "intermediate_size"):
    """The fields of a mixture's experts (``arch``: the file's architecture): their count under the config field
    ``count``, top-k, each expert's width under ``width`` (from ``expert_feed_forward_length``, or the dense
    ``feed_forward_length``), renormalization where the config has a field for it (``normalized`` None: the family fixes
    it)."""

    def fields(meta: dict) -> dict:
        found = {count: _need(meta, arch, "expert_count"), "num_experts_per_tok": _need(meta, arch, "expert_used_count"),
                 width: meta.get("expert_feed_forward_length", meta.get("feed_forward_length"))}
        return found | ({} if normalized is None else {"norm_topk_prob": normalized})

    return fields


def _expert_keys(count: str, width: str = "intermediate_size", shared: str | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata keys a mixture's reader reads beyond KEYS, and the config fields they become (the checks name the
    key)."""
    keys = (("expert_count", count), ("expert_used_count", "num_experts_per_tok"))
    keys += (("expert_feed_forward_length", width),) if width != "intermediate_size" else ()
    return keys + ((("expert_shared_feed_forward_length", shared),) if shared else ())


def _qwen3moe(meta: dict, names: set, layers: int, head_dim: int) -> dict:
    return _experts("qwen3moe", "num_experts", True, "moe_intermediate_size")(meta)


def _qwen2moe(meta: dict, names: set, layers: int, head_dim: int) -> dict:
    return _experts("qwen2moe", "num_experts", False, "moe_intermediate_size")(meta) | {
        "shared_expert_intermediate_size": meta.get("expert_shared_feed_forward_length", 0)}


def _olmoe(meta: dict, names: set, layers: int, head_dim: int) -> dict:
    return _experts("olmoe", "num_experts", False)(meta) | {"clip_qkv": meta.get("attention.clamp_kqv")}


def _granitemoe(meta: dict, names: set, layers: int, head_dim: int) -> dict:
    shared = meta.get("expert_shared_feed_forward_length", 0)
    return _granite(meta, names, layers, head_dim) | _experts("granitemoe", "num_local_experts", None)(meta) | (
        {"model_type": "granitemoeshared", "shared_intermediate_size": shared} if shared else {})


def _mixtral(meta: dict, names: set, layers: int, head_dim: int) -> dict:
    return _experts("llama", "num_local_experts", None)(meta) | {"sliding_window": meta.get("attention.sliding_window")}


GPT_OSS_ROPE = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}  # gpt-oss's YaRN, which no key says


def _gpt_oss(meta: dict, names: set, layers: int, head_dim: int) -> dict:
    return _experts("gpt-oss", "num_local_experts", None)(meta) | {
        "sliding_window": _need(meta, "gpt-oss", "attention.sliding_window"), "attention_bias": True}


GRANITE_KEYS = (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                ("logit_scale", "logits_scaling"), ("attention.scale", "attention_multiplier"))
GGUF_FAMILIES = {
    "granite": GgufReader("granite", _granite, processor="llama", keys=GRANITE_KEYS),
    "olmo2": GgufReader("olmo2", _olmo2),
    "smollm3": GgufReader("smollm3", _smollm3, processor="llama"),
    # the converter permutes attention's q and k as for a Llama (its undo_permute), though Granite 4.0-H rotates nothing
    "granitehybrid": GgufReader("granitemoehybrid", _granite_hybrid, processor="llama",
                                keys=GRANITE_KEYS + _expert_keys("num_local_experts", shared="shared_intermediate_size")),
    "qwen3moe": GgufReader("qwen3_moe", _qwen3moe, keys=_expert_keys("num_experts", "moe_intermediate_size")),
    "qwen2moe": GgufReader("qwen2_moe", _qwen2moe, keys=_expert_keys("num_experts", "moe_intermediate_size",
                                                                    "shared_expert_intermediate_size")),
    "olmoe": GgufReader("olmoe", _olmoe, keys=_expert_keys("num_experts")),
    "granitemoe": GgufReader("granitemoe", _granitemoe, processor="llama",
                             keys=GRANITE_KEYS + _expert_keys("num_local_experts", shared="shared_intermediate_size")),
    "gpt-oss": GgufReader("gpt_oss", _gpt_oss, keys=_expert_keys("num_local_experts")),
    # Mixtral: a llama with experts (a llama without is transformers' to read)
    "llama": GgufReader("mixtral", _mixtral, processor="llama", keys=_expert_keys("num_local_experts"),
                        claims=lambda meta: bool(meta.get("llama.expert_count"))),
}
ROPE_SCALING = ("none", "linear", "yarn")


def architecture_of(reader) -> str:
    return reader.fields["general.architecture"].contents()


# llama.cpp's key (under the architecture's name) -> the transformers config field ``read_config`` makes of it
KEYS = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
        "feed_forward_length": "intermediate_size", "block_count": "num_hidden_layers",
        "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
        "attention.key_length": "head_dim", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
        "rope.freq_base": "rope_theta", "vocab_size": "vocab_size"}
MODEL_TYPES = {"gemma3": "gemma3_text"}  # a GGUF architecture transformers reads as another model_type (text only)
BLOCK = re.compile(r"^blk\.(\d+)\.")


def declared(reader) -> tuple[str, dict, dict[str, str]]:
    """What a GGUF file's metadata declares of its model, before any config is built from it: (its transformers
    model_type, the values under the config fields they become, each field's key in the file). The keys are the ones
    its reader reads: ours (``KEYS`` and a family's own), or transformers' ``GGUF_CONFIG_MAPPING`` for the
    architectures transformers reads."""
    arch = architecture_of(reader)
    own = ours(reader)
    if own is not None:
        keys, model_type = {**KEYS, **dict(own.keys)}, own.model_type
    else:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        keys = {key: field for key, field in GGUF_CONFIG_MAPPING.get(arch, {}).items() if isinstance(field, str)}
        model_type = MODEL_TYPES.get(arch, arch)
    values, names = {}, {}
    for key, field in keys.items():
        if f"{arch}.{key}" in reader.fields:
            values[field], names[field] = reader.fields[f"{arch}.{key}"].contents(), f"{arch}.{key}"
    kv_heads = values.get("num_key_value_heads")
    if isinstance(kv_heads, list):  # a hybrid's, per layer (llama.cpp's converter writes 0 on its recurrent layers)
        counts = set(kv_heads) - {0}
        values["num_key_value_heads"] = counts.pop() if len(counts) == 1 else kv_heads  # one attention size, or refused
    scaling = reader.fields.get(f"{arch}.rope.scaling.type")
    if own is not None and scaling is not None and scaling.contents() in ("linear", "yarn"):  # read back: its numbers
        rope = {"rope_type": scaling.contents()}
        for key, field in (("factor", "factor"), ("original_context_length", "original_max_position_embeddings")):
            if f"{arch}.rope.scaling.{key}" in reader.fields:
                rope[field] = reader.fields[f"{arch}.rope.scaling.{key}"].contents()
                names[f"rope_scaling.{field}"] = names[f"rope_parameters.{field}"] = f"{arch}.rope.scaling.{key}"
        values["rope_scaling"] = rope
    if "rope_theta" in names:  # where the built config keeps it
        names["rope_parameters.rope_theta"] = names["rope_theta"]
    names["eos_token_id"] = "tokenizer.ggml.eos_token_id"
    return model_type, values, names


def check_blocks(reader, path) -> None:
    """Refuse a file whose block count disagrees with the blocks its tensors hold (``blk.N.``): llama.cpp refuses such a
    file; read by its metadata alone, it would export a model of fewer layers, or look for tensors it does not hold."""
    arch = architecture_of(reader)
    field = reader.fields.get(f"{arch}.block_count")
    count = field.contents() if field is not None else None
    held = {int(match.group(1)) for tensor in reader.tensors if (match := BLOCK.match(tensor.name))}
    if isinstance(count, int) and (len(held) != count or (held and max(held) != count - 1)):  # held: 0 .. count - 1
        shown = sorted(held)
        blocks = (f"{len(shown)} blocks (blk.0 to blk.{shown[-1]})" if shown == list(range(len(shown))) else
                  f"blocks {shown[:8]}{' ...' if len(shown) > 8 else ''}") if shown else "no blocks"
        raise ExportError(f"{path}: {arch}.block_count (num_hidden_layers): got {count:,}; the file's tensors hold "
                          f"{blocks}: expected one per block held")


def ours(reader) -> GgufReader | None:
    """The reader of a GGUF file (``reader``: gguf-py's GGUFReader over it) where ``read_config`` reads it (its
    architecture is in GGUF_FAMILIES and claims the file: a llama with experts is Mixtral, one without transformers'),
    else None."""
    family = GGUF_FAMILIES.get(architecture_of(reader))
    claimed = family is not None and family.claims({key: field.contents() for key, field in reader.fields.items()
                                                    if key.endswith(".expert_count")})
    return family if claimed else None


def claims(reader) -> bool:
    """Whether a GGUF file (``reader``: gguf-py's GGUFReader over it) is one ``read_config`` reads."""
    return ours(reader) is not None


def read_config(reader):
    """The transformers config of a GGUF file (``reader``: gguf-py's GGUFReader over it) of an architecture in
    ``GGUF_FAMILIES``."""
    from transformers import AutoConfig

    arch = architecture_of(reader)
    family = GGUF_FAMILIES[arch]
    meta = {key[len(arch) + 1 :]: reader.fields[key].contents() for key in reader.fields if key.startswith(arch + ".")}
    names = {tensor.name for tensor in reader.tensors}

    def need(key: str):
        return _need(meta, arch, key)

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
        **family.extra(meta, names, layers, head_dim),
    }
    model_type = family.model_type_of(fields)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise ExportError(f"{arch}: the GGUF metadata makes no valid {model_type} config ({exc})") from exc


def _need(meta: dict, arch: str, key: str):
    """``meta[key]``, refused in one line where the file has no such key."""
    if key not in meta:
        raise ExportError(f"{arch}: the GGUF metadata has no {arch}.{key}; expected it of a file converted by llama.cpp")
    return meta[key]


def read_tokenizer(path) -> tuple[object, dict]:
    """The tokenizer a GGUF file's metadata describes (a ``tokenizers.Tokenizer``) and its tokenizer_config (BOS/EOS
    tokens, chat template, add_bos_token), built by transformers' GGUF tokenizer converter, which does not depend on
    the model's architecture."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer, config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer)
    return backend, config
