"""A checkpoint's declarations checked before anything is built from them: its config's settings by the rules of its
family (``specdeploy.declared``), and the counts and sizes it declares against the tensors it holds.

Three moments, each before the next reader could trust a value:

1. ``check_declared``: the config as the file declares it (config.json, or a GGUF file's metadata under transformers'
   names), before transformers builds a config from it: a head count of 0 is refused by name, not met as a
   ZeroDivisionError, and a layer count beyond the tensors the file holds never sizes a per-layer list.
2. ``check_config``: the config transformers built (its defaults in), by the same rules.
3. ``check_weights``: the sizes the config declares against the shapes the file holds, through transformers' own model
   of the config built on the meta device (no memory): a tensor of another shape, or layers the config does not
   declare, are refused as transformers refuses to load them; a missing hidden_size (transformers' default of 4096
   beside 32-wide weights) is refused here, where it used to export.

Each refusal is one ExportError line naming the file, the field (a GGUF key by its own name), what it got and what it
expects.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from ..declared import FEATURES, GPT2, LAYER_TYPES, MISSING, SIZES, Rule, decoder_rules, findings, getter, refusal
from .errors import ExportError

OWN_TABLES = {"gpt2": GPT2}  # architectures that are not described families: their own tables
LAYER_FIELDS = ("num_hidden_layers", "n_layer")  # what a table calls its layer count
SIZE_RULE = re.compile(r"an integer >= [1-9]")  # a size's rule (a count, a kernel), not an index's (>= 0)
LAYER = re.compile(r"\.(\d+)\.")  # a tensor name's first index: its layer's (model.layers.3.mlp... -> 3)


def rules_of(arch) -> tuple[tuple[Rule, ...], str]:
    """(the rules of ``arch``'s config, the attribute of the config they read: "" for the config itself, "text_config"
    for a multimodal checkpoint's language model). A described family's are DECODER with its features', its mixers' and
    its feed-forward slot's rules (routed experts: ``declared.experts``); an
    architecture that is not a described family brings its own table (``OWN_TABLES``, or its ``declared``
    attribute), else the sizes every decoder declares (SIZES)."""
    if arch.name in OWN_TABLES:
        return OWN_TABLES[arch.name], ""
    if getattr(arch, "declared", None) is not None:
        return tuple(arch.declared), ""
    text = getattr(arch, "text", None)  # LanguageModelOf: the text family over config.text_config
    family = getattr(text or arch, "family", None)
    if family is None:
        return SIZES, ""
    features = [f.name for f in dataclasses.fields(family) if f.name in FEATURES and getattr(family, f.name)]
    kinds = dict(family.mixers)  # a hybrid's layer types are its mixer slot's; attention's two otherwise
    rules = decoder_rules(features, tuple(kinds) or LAYER_TYPES, dict.fromkeys(kinds.values()), family.feed_forward.rules)
    return rules, "text_config" if text is not None else ""


def check_declared(declared: Mapping, arch, where: str, names: Mapping[str, str] | None = None,
                   tensors: int | None = None) -> None:
    """Refuse (ExportError) the first field ``declared`` (the file's own values, under transformers' names; ``names``:
    a field's name in the file where it differs) sets against its rule. ``tensors``: how many the file holds, which
    bounds the layers it may declare (each layer holds several)."""
    rules, part = rules_of(arch)
    source = declared.get(part, {}) if part else declared
    prefix = f"{part}." if part else ""
    if part and not isinstance(source, Mapping):
        raise ExportError(f"{where}: {part}: got {type(source).__name__}; expected an object (the language model's config)")
    found = findings(source, rules)
    if found:
        raise ExportError(refusal(where, found[0], names, prefix))
    layers = _layer_field(rules)
    count = source.get(layers, MISSING)
    if tensors is not None and isinstance(count, int) and count > tensors:
        label = f"{names[layers]} ({layers})" if names and layers in names else prefix + layers
        raise ExportError(f"{where}: {label}: got {count:,}; expected at most the {tensors:,} tensors the file holds "
                          "(each layer holds several)")


def check_config(config, arch, where: str, declared: Mapping | None = None,
                 names: Mapping[str, str] | None = None) -> None:
    """Refuse the first field of ``config`` (transformers' config, defaults in) that breaks its rule; ``declared``: the
    file's own values, so that a default is said to be one."""
    rules, part = rules_of(arch)
    source = getattr(config, part) if part else config
    found = findings(source, rules, complete=True)
    if found:
        own = getter((declared or {}).get(part, {}) if part else (declared or {}))
        default = declared is not None and own(found[0].field.split(".")[0]) is MISSING and not names
        raise ExportError(refusal(where, found[0], names, f"{part}." if part else "", defaults=default))


# What the block builder reads of any family's config, where transformers' model reads each only if its config class
# declares it: Llama's reads no sliding_window or layer_types (Mistral's does), Gemma's reads hidden_activation
READ_WHERE_DECLARED = ("sliding_window", "layer_types", "hidden_activation")


def unread_dropped(config, arch) -> None:
    """Set to None, in ``config`` (transformers' config, or its text config for a multimodal checkpoint's language
    model), each of READ_WHERE_DECLARED its class does not declare: transformers' model never reads such a value (a
    ``sliding_window`` in a Llama config), so neither does the export, which would otherwise compute another model."""
    _, part = rules_of(arch)
    source = getattr(config, part) if part else config
    declared = {f.name for f in dataclasses.fields(source)} if dataclasses.is_dataclass(source) else None
    if declared is None:
        return
    for name in READ_WHERE_DECLARED:
        if name not in declared and getattr(source, name, None) is not None:
            setattr(source, name, None)


def check_weights(arch, config, shapes: Mapping[str, tuple[int, ...]], where: str, declared: Mapping | None = None) -> None:
    """Refuse a config whose sizes disagree with the tensors held (``shapes``: name -> shape, as stored), as transformers
    refuses to load them: every tensor of transformers' model of the config that the file holds by its name must have
    its shape, and the file must hold the layers the config declares, no more and no fewer."""
    import torch
    from transformers import AutoModelForCausalLM

    rules, part = rules_of(arch)
    model_config = arch.text_config(config) if part else config
    held = _as_named(arch, shapes)
    try:
        with torch.device("meta"):  # only the names and shapes: no memory, no initialisation
            skeleton = AutoModelForCausalLM.from_config(model_config)
    except Exception as exc:  # transformers refuses to build a model of this config
        raise ExportError(f"{where}: transformers cannot build a model of this config ({type(exc).__name__}: "
                          f"{one_line(exc)})") from exc
    expected = {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}
    layered = {LAYER.sub(".#.", name, count=1) for name in expected if LAYER.search(name)}
    declared_layers = {_layer(name) for name in expected if LAYER.search(name)}
    held_layers = {_layer(name) for name in held if LAYER.search(name) and LAYER.sub(".#.", name, count=1) in layered}
    prefix = f"{part}." if part else ""
    source = getattr(config, part) if part else config
    if held_layers != declared_layers:
        field = _layer_field(rules)
        raise ExportError(f"{where}: {prefix}{field}: got {len(declared_layers)}; expected {len(held_layers)}, the layers "
                          f"its weights hold ({_layers(held_layers)})")
    for name, shape in expected.items():
        if name in held and tuple(held[name]) != shape:
            sizes, many = _sizes(rules, source, declared.get(part, {}) if part and declared else declared, shape,
                                 held[name])
            raise ExportError(f"{where} disagrees with its weights: {name} holds {list(held[name])}, and the config's "
                              f"{sizes} {'make' if many else 'makes'} it {list(shape)}")


def _as_named(arch, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The held shapes under the names the architecture reads them by (a multimodal checkpoint's language model under
    its own names; a GPT-2 saved without its ``transformer.`` prefix with it)."""
    prefixes = getattr(arch, "PREFIXES", None)
    if prefixes is not None:
        named = {}
        for name, shape in shapes.items():
            for theirs, ours in prefixes:
                if name.startswith(theirs):
                    named[ours + name[len(theirs):]] = shape
                    break
        return named
    if arch.name == "gpt2" and "transformer.wte.weight" not in shapes:
        return {(name if name.startswith("lm_head") else "transformer." + name): shape for name, shape in shapes.items()}
    return dict(shapes)


def _sizes(rules, config, declared: Mapping | None, shape: tuple, held: tuple) -> tuple[str, bool]:
    """The config's size fields, those whose values are the sizes that differ first (a product of several, heads times
    head_dim, matches none: every one is said), and whether there are several."""
    from ..declared import Field

    fields = [r.name for r in rules if isinstance(r, Field) and SIZE_RULE.match(r.expected)
              and r.name not in (*LAYER_FIELDS, "max_position_embeddings")]  # sizes no tensor's shape holds
    values = {name: getattr(config, name, None) for name in fields}
    values = {name: value for name, value in values.items() if isinstance(value, int) and not isinstance(value, bool)}
    differing = {e for e, h in zip(shape, held) if e != h} if len(shape) == len(held) else set(shape)
    named = sorted(values, key=lambda name: values[name] not in differing)
    own = getter(declared or {})

    def said(name: str) -> str:
        default = declared is not None and own(name) is MISSING
        return f"{name} {values[name]:,}" + (" (not in the file: transformers' default)" if default else "")

    return ", ".join(said(name) for name in named), len(named) > 1


def _layer(name: str) -> int:
    return int(LAYER.search(name).group(1))


def _layer_field(rules) -> str:
    names = {getattr(rule, "name", None) for rule in rules}
    return next((field for field in LAYER_FIELDS if field in names), LAYER_FIELDS[0])


def _layers(indices: set[int]) -> str:
    if not indices:
        return "no layers"
    ordered = sorted(indices)
    if ordered == list(range(len(ordered))):
        return f"layers 0 to {ordered[-1]}"
    return f"layers {', '.join(map(str, ordered[:8]))}{', ...' if len(ordered) > 8 else ''}"


def one_line(exc: BaseException, limit: int = 300) -> str:
    """A library's message in one line, cut short (transformers' strict fields span several lines)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
