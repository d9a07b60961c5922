"""What a model declares of itself, checked before any value of it is used: one table of rules, whatever the source.

A Hugging Face ``config.json``, a GGUF file's metadata (under transformers' names for its keys) and an imported
folder's config (onnxruntime-genai's ``genai_config.json``, optimum's ``config.json``) each declare sizes, epsilons,
bases, factors, windows and per-layer lists. A rule names a field and what a good value is; ``findings`` walks a table
of rules over a source and returns, for each field that breaks its rule, what it got and what it expects, which the
reader turns into one line naming its file (``refusal``). Nothing is computed from a value before its rule passed: a
head count of 0 is refused by name, never met as a ZeroDivisionError, and a layer count of 10^9 never sizes a list.

A source is checked as declared (a mapping read from the file: fields it leaves out pass, since the reader's defaults
fill them) and, for a Hugging Face config, once more as transformers built it (``complete``: every field present,
defaults included, so a required field that is missing or null breaks its rule).

The tables: ``DECODER`` for every described decoder family (exporter/family.py), which a family's description
extends through ``FEATURES`` (a ``Family`` field that is set adds the rules of the config fields that feature reads)
and ``MIXERS`` (each recurrent mixer kind of its mixer slot adds the rules of the fields that mixer reads);
``GPT2``; ``GENAI`` and ``OPTIMUM`` for imported folders. A family that reads a new field adds its rule here, and the
property test (tests/exporter/test_declared_settings.py) feeds random values to it with the rest.

A leaf (standard library and ``values``): the importer runs without torch or transformers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .values import is_integer, short

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP's activations the block builder computes
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "longrope")  # exporter/rope.py computes these
LAYER_TYPES = ("full_attention", "sliding_attention")
MAX_NAME = 256  # characters of a declared name (an architecture): ours are a few


class _Missing:
    def __repr__(self) -> str:
        return "missing"


MISSING = _Missing()  # a field the source does not declare
Getter = Callable[[str], object]  # a field's value in the source (dotted names walk nested objects), or MISSING


@dataclass(frozen=True)
class Finding:
    """A field that breaks its rule: its (dotted) name, the value it holds, and what a good value is, in words."""

    field: str
    got: object
    expected: str


def is_number(value) -> bool:
    """A finite real number (an int or a float; not a bool, not NaN or infinite, not an int too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class Field:
    """One field's rule: ``test(value, get)`` says whether a declared value is good (``get`` reads the others).
    ``required``: the field must be there once defaults are in (``complete``), and may never be null. ``expected``
    says what a good value is; ``{name}`` in it is filled with the source's value of field ``name``."""

    name: str
    expected: str
    test: Callable[[object, Getter], bool]
    required: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.name,)

    def findings(self, get: Getter, complete: bool) -> list[Finding]:
        value = get(self.name)
        if value is MISSING or value is None:
            if self.required and (complete or value is None):
                return [Finding(self.name, value, _filled(self.expected, get))]
            return []
        return [] if self.test(value, get) else [Finding(self.name, value, _filled(self.expected, get))]


REFERENCE = re.compile(r"\{([\w.]+)\}")  # ``{field}`` in a rule's words: that field's value in the source


def _filled(expected: str, get: Getter) -> str:
    return REFERENCE.sub(lambda match: short(get(match.group(1)), 40), expected)


def _int_of(get: Getter, name: str) -> int | None:
    value = get(name)
    return value if is_integer(value) and value >= 1 else None


def count(name: str, required: bool = True) -> Field:
    """A positive integer: a size, a count of layers or heads."""
    return Field(name, "an integer >= 1", lambda v, get: is_integer(v) and v >= 1, required)


def at_least(name: str, least: int, why: str = "") -> Field:
    """An integer >= ``least`` (a convolution's kernel: one of 1 keeps no state), required."""
    return Field(name, f"an integer >= {least}{why}", lambda v, get: is_integer(v) and v >= least, required=True)


def whole(name: str) -> Field:
    """An integer >= 0 (an index: the first windowed layer)."""
    return Field(name, "an integer >= 0", lambda v, get: is_integer(v) and v >= 0)


def number(name: str, required: bool = False) -> Field:
    """A finite number > 0: an epsilon, a base, a factor, a multiplier, a soft-cap (null: none, where not
    ``required``)."""
    expected = "a finite number > 0" + ("" if required else ", or null")
    return Field(name, expected, lambda v, get: is_number(v) and v > 0, required)


def choice(name: str, options: tuple, required: bool = False) -> Field:
    """One of ``options``, of their type (``True`` is not 1, ``"1"`` not 1)."""
    words = " or ".join(_json(o) for o in options)
    return Field(name, f"one of {words}" if len(options) > 1 else words,
                 lambda v, get: any(type(v) is type(o) and v == o for o in options), required)


def text(name: str, required: bool = True) -> Field:
    """A name: a string of 1 to MAX_NAME characters."""
    return Field(name, f"a string of 1 to {MAX_NAME} characters",
                 lambda v, get: isinstance(v, str) and 0 < len(v) <= MAX_NAME, required)


def divisor(name: str, of: str) -> Field:
    """A positive integer that divides field ``of`` (key/value heads: the query heads)."""
    def test(value, get) -> bool:
        whole_of = _int_of(get, of)
        return is_integer(value) and value >= 1 and (whole_of is None or whole_of % value == 0)

    return Field(name, f"an integer >= 1 that divides {of} ({{{of}}})", test)


class Heads(Field):
    """Attention heads: a positive integer; where no ``head_dim`` is declared (or the family has none), one that divides
    ``hidden``, since each head is then hidden / heads wide."""

    def __init__(self, name: str, hidden: str, head_dim: str | None):
        super().__init__(name, "an integer >= 1", lambda v, get: is_integer(v) and v >= 1, required=True)
        object.__setattr__(self, "hidden", hidden)
        object.__setattr__(self, "head_dim", head_dim)

    def findings(self, get: Getter, complete: bool) -> list[Finding]:
        found = super().findings(get, complete)
        value, size = get(self.name), _int_of(get, self.hidden)
        declared = get(self.head_dim) if self.head_dim else None
        if found or size is None or (declared is not MISSING and declared is not None) or value in (MISSING, None):
            return found
        if size % value:
            also = f" (no {self.head_dim} is given, so each head is {self.hidden} / {self.name} wide)" if self.head_dim else ""
            return [Finding(self.name, value, f"an integer >= 1 that divides {self.hidden} ({size}){also}")]
        return []


class PerLayer(Field):
    """A list with one entry per layer (``layers``: the field counting them), each one of ``options``."""

    def __init__(self, name: str, options: tuple, layers: str = "num_hidden_layers"):
        def test(value, get) -> bool:
            size = _int_of(get, layers)
            return (isinstance(value, list) and (size is None or len(value) == size)
                    and all(any(type(v) is type(o) and v == o for o in options) for v in value))

        super().__init__(name, f"a list with one entry per layer, each {' or '.join(map(_json, options))}", test)
        object.__setattr__(self, "layers", layers)

    def findings(self, get: Getter, complete: bool) -> list[Finding]:
        found = super().findings(get, complete)
        size = _int_of(get, self.layers)
        if found and size is not None:  # the number of entries expected, said
            return [Finding(f.field, f.got, f.expected.replace("one entry per layer", f"{size} entries (one per layer, "
                                                                                   f"{self.layers})")) for f in found]
        return found


class Window(Field):
    """A sliding window: a positive integer, or null for none; required where ``types`` has a sliding layer (transformers
    refuses such a layer without a window)."""

    def __init__(self, name: str, types: str = "layer_types"):
        super().__init__(name, "an integer >= 1, or null (no window)", lambda v, get: is_integer(v) and v >= 1)
        object.__setattr__(self, "types", types)

    def findings(self, get: Getter, complete: bool) -> list[Finding]:
        value, kinds = get(self.name), get(self.types)
        if isinstance(kinds, list) and "sliding_attention" in kinds and (value is None or (complete and value is MISSING)):
            return [Finding(self.name, value, f"an integer >= 1: {self.types} has sliding_attention layers")]
        return super().findings(get, complete)


def token_ids(name: str, vocab: str) -> Field:
    """A token id or a list of them (EOS), each in [0, vocab): a model has no logit for another."""
    def test(value, get) -> bool:
        ids = value if isinstance(value, list) else [value]
        size = _int_of(get, vocab)
        return all(is_integer(i) and 0 <= i and (size is None or i < size) for i in ids) and len(ids) <= 64

    return Field(name, f"a token id or a list of at most 64, each in [0, {vocab} = {{{vocab}}})", test)


class WindowSwitch(Field):
    """Whether sliding windows are used (Qwen, SmolLM3): true or false, and true where ``types`` has a sliding layer
    (transformers then drops the window, and refuses the sliding layer when it runs)."""

    def __init__(self, name: str, types: str = "layer_types"):
        super().__init__(name, "true or false", lambda v, get: isinstance(v, bool))
        object.__setattr__(self, "types", types)

    def findings(self, get: Getter, complete: bool) -> list[Finding]:
        found = super().findings(get, complete)
        kinds = get(self.types)
        if not found and get(self.name) is False and isinstance(kinds, list) and "sliding_attention" in kinds:
            return [Finding(self.name, False, f"true: {self.types} has sliding_attention layers")]
        return found


class FirstOf(Field):
    """A setting some families name otherwise: the first of ``names`` the source declares is the one read (Gemma's
    hidden_activation wins over hidden_act, as transformers reads it; LFM2 calls its epsilon norm_eps), and it must
    pass ``test``. ``required``: one of them must be there once defaults are in."""

    def __init__(self, names: tuple[str, ...], expected: str, test: Callable[[object, Getter], bool],
                 required: bool = False):
        super().__init__(names[0], expected, test, required)
        object.__setattr__(self, "names", names)

    @property
    def fields(self) -> tuple[str, ...]:
        return self.names

    def findings(self, get: Getter, complete: bool) -> list[Finding]:
        for name in self.names:
            value = get(name)
            if value is not MISSING and value is not None:
                return [] if self.test(value, get) else [Finding(name, value, self.expected)]
            if value is None and self.required:
                return [Finding(name, value, self.expected)]
        return [Finding(self.name, MISSING, self.expected)] if self.required and complete else []


def activation(names: tuple[str, ...], options: tuple[str, ...]) -> FirstOf:
    """The MLP's activation, one of ``options``."""
    return FirstOf(names, f"one of {', '.join(options)}", lambda v, get: isinstance(v, str) and v in options)


class Rope:
    """The RoPE a config declares: ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older files), flat or
    keyed by layer type (Gemma 3), with ``rope_theta``, ``partial_rotary_factor`` and
    ``original_max_position_embeddings`` also read from the top level, as transformers reads them. Each type's
    numbers are the ones its frequencies divide by or take the logarithm of, so each must be finite and positive."""

    FACTORS = {  # rope type -> its fields beyond rope_theta and partial_rotary_factor: (name, kind, required)
        "default": (),
        "linear": (("factor", "number", True),),
        "llama3": (("factor", "number", True), ("low_freq_factor", "number", True), ("high_freq_factor", "number", True),
                   ("original_max_position_embeddings", "count", True)),
        "yarn": (("factor", "number", True), ("original_max_position_embeddings", "count", False),
                 ("attention_factor", "number", False), ("beta_fast", "number", False), ("beta_slow", "number", False),
                 ("mscale", "real", False), ("mscale_all_dim", "real", False), ("truncate", "flag", False)),
        "longrope": (("short_factor", "factors", True), ("long_factor", "factors", True), ("factor", "number", False),
                     ("attention_factor", "number", False), ("original_max_position_embeddings", "count", False)),
    }
    KINDS = {"number": "a finite number > 0", "count": "an integer >= 1", "real": "a finite number",
             "flag": "true or false"}
    name = "rope_parameters"
    fields = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "original_max_position_embeddings")
    # the keys a RoPE dict may hold (the property test sets each)
    keys = ("rope_type", "rope_theta", "partial_rotary_factor", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
            "short_factor", "long_factor")

    def __init__(self, head_dim: str = "head_dim", hidden: str = "hidden_size", heads: str = "num_attention_heads"):
        self.head_dim, self.hidden, self.heads = head_dim, hidden, heads

    def findings(self, get: Getter, complete: bool) -> list[Finding]:
        name, params = "rope_parameters", get("rope_parameters")
        if params is MISSING or params is None:
            name, params = "rope_scaling", get("rope_scaling")
        if params is MISSING or params is None:
            params = {}
        if not isinstance(params, dict):
            return [Finding(name, params, "an object of RoPE settings (rope_type, rope_theta, factor, ...), or null")]
        found = [f for f in (_checked(get, "rope_theta", "number"), _checked(get, "partial_rotary_factor", "share"),
                             _checked(get, "original_max_position_embeddings", "count")) if f]
        types = get("layer_types")
        nested = [k for k, v in params.items() if isinstance(v, dict) and isinstance(types, list) and k in types]
        if nested:  # one RoPE per layer type
            for key in nested:
                found += self._one(get, params[key], f"{name}.{key}")
            return found
        return found + self._one(get, params, name)

    def _one(self, get: Getter, params: dict, where: str) -> list[Finding]:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE:
            return [Finding(f"{where}.rope_type", rope_type, f"one of {', '.join(SUPPORTED_ROPE)}")]
        found = []
        for key, kind, required in (("rope_theta", "number", False), ("partial_rotary_factor", "share", False),
                                    *self.FACTORS[rope_type]):
            value = params.get(key, MISSING)  # null is a value here: transformers computes with it, and fails
            if value is MISSING:
                top = get(key) if key in ("original_max_position_embeddings",) else MISSING
                if required and top in (MISSING, None):
                    found.append(Finding(f"{where}.{key}", value, f"{self._kind(kind)} (rope_type {rope_type!r} needs it)"))
                continue
            if kind == "factors":
                finding = self._factors(get, params, key, value, where)
            else:
                finding = _judged(f"{where}.{key}", value, kind)
            if finding:
                found.append(finding)
        low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
        if rope_type == "llama3" and is_number(low) and is_number(high) and high <= low:
            found.append(Finding(f"{where}.high_freq_factor", high, f"a number > low_freq_factor ({low:g})"))
        return found

    def _factors(self, get: Getter, params: dict, key: str, value, where: str) -> Finding | None:
        """Long-RoPE's per-frequency factors: positive numbers, one per rotated pair of the head's dims."""
        head_dim, source = _int_of(get, self.head_dim), self.head_dim
        if head_dim is None and _int_of(get, self.hidden) and _int_of(get, self.heads):
            head_dim, source = _int_of(get, self.hidden) // _int_of(get, self.heads), f"{self.hidden} / {self.heads}"
        share = params.get("partial_rotary_factor", get("partial_rotary_factor"))
        share = share if is_number(share) and 0 < share <= 1 else 1.0
        pairs = len(range(0, int(head_dim * share), 2)) if head_dim else None
        fine = isinstance(value, list) and all(is_number(f) and f > 0 for f in value) and (
            pairs is None or len(value) == pairs)
        if fine:
            return None
        rotated = f"{head_dim} dims a head ({source})" + (f", a share of {share:g} rotated" if share != 1 else "")
        return Finding(f"{where}.{key}", value, "a list of finite numbers > 0" + (
            f", one per rotated pair of dims ({pairs}: {rotated})" if pairs is not None else ""))

    @classmethod
    def _kind(cls, kind: str) -> str:
        return "a finite number in (0, 1]" if kind == "share" else cls.KINDS[kind]


def _judged(field: str, value, kind: str) -> Finding | None:
    fine = {"number": lambda v: is_number(v) and v > 0, "count": lambda v: is_integer(v) and v >= 1,
            "real": is_number, "flag": lambda v: isinstance(v, bool),
            "share": lambda v: is_number(v) and 0 < v <= 1}[kind]
    return None if fine(value) else Finding(field, value, Rope._kind(kind))


def _checked(get: Getter, field: str, kind: str) -> Finding | None:
    value = get(field)
    return None if value is MISSING or value is None else _judged(field, value, kind)


def _json(value) -> str:
    return {True: "true", False: "false"}.get(value, repr(value)) if isinstance(value, bool) else repr(value)


Rule = Field | Rope

# What every described decoder family reads of its config (DescribedArchitecture.dims, Family.settings, rope.ropes)
SIZES: tuple[Rule, ...] = (
    count("vocab_size"), count("hidden_size"), count("num_hidden_layers"),
    Heads("num_attention_heads", "hidden_size", "head_dim"),
    divisor("num_key_value_heads", of="num_attention_heads"),
    count("head_dim", required=False),
    count("max_position_embeddings", required=False),
    token_ids("eos_token_id", vocab="vocab_size"),
)
DECODER: tuple[Rule, ...] = SIZES + (
    count("intermediate_size"),
    FirstOf(("rms_norm_eps", "norm_eps"), "a finite number > 0", lambda v, get: is_number(v) and v > 0, required=True),
    activation(("hidden_activation", "hidden_act"), ACTIVATIONS),
    Window("sliding_window"),
    whole("max_window_layers"),
    WindowSwitch("use_sliding_window"),
    choice("tie_word_embeddings", (True, False)),
    Rope(),
)
# A Family field (exporter/family.py) that is set -> the rules of the config fields that feature reads
FEATURES: dict[str, tuple[Rule, ...]] = {
    "query_pre_attn_scalar": (number("query_pre_attn_scalar", required=True),),
    "attention_softcap": (number("attn_logit_softcapping"),),
    "final_softcap": (number("final_logit_softcapping"),),
    "multipliers": tuple(number(name, required=True) for name in
                         ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")),
    "rope_layers": (PerLayer("no_rope_layers", (0, 1)), count("no_rope_layer_interval", required=False)),
}
GPT2: tuple[Rule, ...] = (
    count("vocab_size"), count("n_embd"), count("n_layer"), Heads("n_head", "n_embd", None), count("n_positions"),
    count("n_inner", required=False), number("layer_norm_epsilon", required=True),
    choice("activation_function", ("gelu_new", "gelu_pytorch_tanh"), required=True),
    choice("scale_attn_weights", (True,)), choice("scale_attn_by_inverse_layer_idx", (False,)),
    choice("reorder_and_upcast_attn", (False,)),
    token_ids("eos_token_id", vocab="vocab_size"),
)
# An onnxruntime-genai folder's genai_config.json: what the importer reads of it
GENAI: tuple[Rule, ...] = (
    text("model.type"), count("model.vocab_size"), count("model.context_length"),
    count("model.decoder.num_hidden_layers"), count("model.decoder.num_attention_heads"),
    divisor("model.decoder.num_key_value_heads", of="model.decoder.num_attention_heads"),
    count("model.decoder.head_size"), token_ids("model.eos_token_id", vocab="model.vocab_size"),
)
# An optimum export's config.json: the sizes the importer reads
OPTIMUM: tuple[Rule, ...] = (text("model_type", required=False),) + SIZES[:-2] + (
    count("max_position_embeddings"), token_ids("eos_token_id", vocab="vocab_size"))


def _mamba_head(value, get) -> bool:
    heads, expand, hidden = (_int_of(get, name) for name in ("mamba_n_heads", "mamba_expand", "hidden_size"))
    return is_integer(value) and value >= 1 and (None in (heads, expand, hidden) or heads * value == expand * hidden)


# A recurrent mixer kind (exporter/recurrent.py, a family's ``mixers``) -> the rules of the config fields it reads
MIXERS: dict[str, tuple[Rule, ...]] = {
    "short_conv": (at_least("conv_L_cache", 2, " (the short convolution's kernel: one of 1 keeps no state)"),),
    "mamba2": (
        count("mamba_n_heads"), divisor("mamba_n_groups", of="mamba_n_heads"), count("mamba_d_state"),
        at_least("mamba_d_conv", 2, " (the convolution's kernel)"), count("mamba_expand"),
        Field("mamba_d_head", "an integer >= 1 with mamba_n_heads x mamba_d_head = mamba_expand x hidden_size "
                              "({mamba_expand} x {hidden_size})", _mamba_head, required=True),
    ),
}


def decoder_rules(features: Iterable[str], layer_types: tuple[str, ...] = LAYER_TYPES,
                  mixers: Iterable[str] = ()) -> tuple[Rule, ...]:
    """DECODER with the rules of each of ``features`` (the names of a family's Family fields that are set), its
    ``layer_types`` (each entry one of the family's: attention's two, or its mixer slot's layer types) and the fields
    each recurrent mixer kind of ``mixers`` reads."""
    rules = [*DECODER, PerLayer("layer_types", tuple(layer_types))]
    for feature in features:
        rules += FEATURES.get(feature, ())
    for kind in mixers:
        rules += MIXERS.get(kind, ())
    return tuple(rules)


def getter(source) -> Getter:
    """The values of ``source``, a mapping (nested ones walked by dotted names) or an object (its attributes)."""
    def get(name: str):
        value = source
        for part in name.split("."):
            if isinstance(value, Mapping):
                value = value.get(part, MISSING)
            elif value is MISSING or value is None or isinstance(value, (str, int, float, list)):
                return MISSING
            else:
                value = getattr(value, part, MISSING)
            if value is MISSING:
                return MISSING
        return value

    return get


def findings(source, rules: Iterable[Rule], complete: bool = False) -> list[Finding]:
    """Every field of ``source`` (a mapping or a config object) that breaks its rule in ``rules``. ``complete``: the
    source holds every field, defaults included (transformers' config), so a required field must be there."""
    get = getter(source)
    found = []
    for rule in rules:
        found += rule.findings(get, complete)
    return found


def refusal(where: str, finding: Finding, names: Mapping[str, str] | None = None, prefix: str = "",
            defaults: bool = False) -> str:
    """One line: ``where``, the field (as ``names`` calls it in the file: a GGUF key; ``prefix``: where its object sits
    in the file), what it got and what it expects. ``defaults``: the value is the reader's default, not the file's."""
    field = finding.field
    shown = (names or {}).get(field)
    label = f"{shown} ({field})" if shown else prefix + field
    if finding.got is MISSING:
        return f"{where}: {label}: missing; expected {finding.expected}"
    got = short(finding.got)
    if defaults:
        got += " (not in the file: its reader's default)"
    return f"{where}: {label}: got {got}; expected {finding.expected}"
