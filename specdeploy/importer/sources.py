"""The folders we import, told apart by their files: what each declares of its graph, read before ONNX Runtime is.

An onnxruntime-genai folder holds ``genai_config.json`` (its decoder's file and tensor names, the model's sizes and its
generation settings) beside ``model.onnx``; an optimum export holds a transformers ``config.json`` beside
``model.onnx``. Each is one small reader of that folder's declarations (``SOURCES``), which the graph's own inputs and
outputs must then match name for name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..artifact_checks import compile_template, read_tokenizer_config
from ..contract import DTYPES, ContractError, ImportedIO
from ..declared import GENAI, OPTIMUM, findings, refusal, token_ids
from ..files import MAX_JSON_BYTES, FileMissing, FileRefused, read_regular

ONNX_TYPES = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32"}


class ImportRefused(ValueError):
    """A folder that cannot be imported, in one line naming what is missing or wrong."""


@dataclass
class Source:
    """What a folder declares of its decoder: the graph, its contract (``io``), the model's sizes, and the files to
    keep beside it (tokenizer, chat template, generation settings)."""

    folder: Path
    graph: Path
    io: ImportedIO
    facts: dict  # ModelSpec fields: architecture, num_layers, num_heads, kv_heads, head_dim, vocab_size, capacity, eos
    kept: list[str] = field(default_factory=list)  # files of the folder the artifact keeps as they are
    declared_as: dict[str, str] = field(default_factory=dict)  # a fact -> the config's file and field it comes from


def read_source(folder: Path) -> Source:
    """The ``Source`` of an onnxruntime-genai or optimum folder; ImportRefused for anything else."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ImportRefused(f"{folder}: not a directory; expected an onnxruntime-genai model folder or an optimum export")
    for marker, reader in SOURCES:
        if (folder / marker).is_file():
            return reader(folder)
    raise ImportRefused(f"{folder}: neither genai_config.json (an onnxruntime-genai model folder) nor config.json beside "
                        "model.onnx (an optimum export); expected one of them")


def _json(path: Path) -> dict:
    try:
        data = json.loads(read_regular(path, MAX_JSON_BYTES).decode("utf-8"))
    except FileMissing as exc:
        raise ImportRefused(f"{path}: missing") from exc
    except FileRefused as exc:
        raise ImportRefused(str(exc)) from exc
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ImportRefused(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ImportRefused(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _checked(config: dict, rules, where: Path) -> None:
    """Refuse the first field of ``config`` that breaks its rule (``specdeploy.declared``), in one line naming it."""
    found = findings(config, rules)
    if found:
        raise ImportRefused(refusal(str(where), found[0]))


def _eos(value) -> tuple[int, ...]:
    """EOS ids, as ``declared.token_ids`` checked them: one id or a list."""
    return tuple(value if isinstance(value, list) else [] if value is None else [value])


def _kept_configs(folder: Path) -> None:
    """Refuse a tokenizer config the artifact would keep but its loader refuse (malformed, a template that does not
    compile, a string flag), or a chat_template.jinja too large to fold into one: now, naming the folder's file."""
    config, template = folder / "tokenizer_config.json", folder / "chat_template.jinja"
    try:
        settings = read_tokenizer_config(config) if _is_plain(config) else {}
        if _is_plain(template):
            text = read_regular(template, MAX_JSON_BYTES).decode("utf-8")
            compile_template(text, str(template))
            folded = len(json.dumps({**settings, "chat_template": text}, indent=2).encode())
            if settings.get("chat_template") is None and folded > MAX_JSON_BYTES:  # as the import writes it
                raise ImportRefused(f"{template}: makes a tokenizer_config.json of {folded:,} bytes; expected at most "
                                    f"{MAX_JSON_BYTES:,} (the loader's bound)")
    except (ContractError, FileRefused) as exc:
        raise ImportRefused(str(exc)) from exc
    except UnicodeDecodeError as exc:
        raise ImportRefused(f"{template}: not UTF-8 text ({exc.reason})") from exc


def _is_plain(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _existing(folder: Path, names) -> list[str]:
    return [name for name in names if (folder / name).is_file() and not (folder / name).is_symlink()]


def read_genai(folder: Path) -> Source:
    """An onnxruntime-genai folder: genai_config.json's ``model.decoder`` names the graph and its tensors."""
    where = folder / "genai_config.json"
    config = _json(where)
    model = config.get("model")
    decoder = model.get("decoder") if isinstance(model, dict) else None
    if not isinstance(decoder, dict):
        raise ImportRefused(f"{where}: no model.decoder; expected the decoder's file and tensor names there")
    if "pipeline" in decoder:
        raise ImportRefused(f"{where}: model.decoder.pipeline (a decoder split over several graphs); expected one graph")
    inputs, outputs = decoder.get("inputs", {}), decoder.get("outputs", {})
    if not isinstance(inputs, dict) or not isinstance(outputs, dict):
        raise ImportRefused(f"{where}: model.decoder.inputs and .outputs must be objects (role -> tensor name)")
    known_in = {"input_ids", "attention_mask", "past_key_names", "past_value_names"}
    known_out = {"logits", "present_key_names", "present_value_names"}
    unknown = sorted(set(inputs) - known_in) + sorted(set(outputs) - known_out)
    if unknown:
        raise ImportRefused(f"{where}: decoder inputs/outputs {unknown} are not ones we drive; expected "
                            f"{sorted(known_in)} and {sorted(known_out)}")
    names = {key: value for key, value in {**inputs, **outputs}.items() if isinstance(value, str)}
    io = ImportedIO(source="onnxruntime-genai", cache="shared", input_ids=names.get("input_ids", "input_ids"),
                    attention_mask=names.get("attention_mask", "attention_mask"),
                    past_key=names.get("past_key_names", "past_key_values.%d.key"),
                    past_value=names.get("past_value_names", "past_key_values.%d.value"),
                    logits=names.get("logits", "logits"), present_key=names.get("present_key_names", "present.%d.key"),
                    present_value=names.get("present_value_names", "present.%d.value"))
    search = config.get("search", {})
    if isinstance(search, dict) and search.get("past_present_share_buffer") is False:
        raise ImportRefused(f"{where}: search.past_present_share_buffer is false; expected a graph over one shared "
                            "buffer (the builder's GroupQueryAttention graphs)")
    _checked(config, GENAI, where)
    _kept_configs(folder)
    facts = {"architecture": model["type"], "num_layers": decoder["num_hidden_layers"],
             "num_heads": decoder["num_attention_heads"], "kv_heads": decoder["num_key_value_heads"],
             "head_dim": decoder["head_size"], "vocab_size": model["vocab_size"], "capacity": model["context_length"],
             "eos_token_ids": _eos(model.get("eos_token_id"))}
    graph = decoder.get("filename", "model.onnx")
    declared_as = {fact: f"{where.name}: model.decoder.{name}" for fact, name in (
        ("num_layers", "num_hidden_layers"), ("kv_heads", "num_key_value_heads"), ("head_dim", "head_size"))}
    return Source(folder, _graph_path(folder, graph, where), io, facts,
                  _existing(folder, ("genai_config.json", "tokenizer_config.json", "chat_template.jinja")), declared_as)


def read_optimum(folder: Path) -> Source:
    """An optimum export: transformers' config.json gives the sizes; the graph's tensor names are optimum's."""
    where = folder / "config.json"
    config = _json(where)
    if not (folder / "model.onnx").is_file():
        raise ImportRefused(f"{folder}: config.json but no model.onnx; expected an optimum export "
                            "(optimum-cli export onnx --task text-generation-with-past)")
    generation_path = folder / "generation_config.json"
    generation = _json(generation_path) if generation_path.is_file() else {}
    _checked(config, OPTIMUM, where)
    eos = generation.get("eos_token_id", config.get("eos_token_id"))  # generation_config.json's wins, as in optimum
    _checked({"vocab_size": config["vocab_size"], "eos_token_id": eos}, (token_ids("eos_token_id", vocab="vocab_size"),),
             generation_path if "eos_token_id" in generation else where)
    _kept_configs(folder)
    heads = config["num_attention_heads"]
    facts = {"architecture": config.get("model_type", "unknown"), "num_layers": config["num_hidden_layers"],
             "num_heads": heads, "kv_heads": config.get("num_key_value_heads") or heads,
             "head_dim": config.get("head_dim") or config["hidden_size"] // heads, "vocab_size": config["vocab_size"],
             "capacity": config["max_position_embeddings"],
             "eos_token_ids": _eos(eos)}
    io = ImportedIO(source="optimum", cache="concatenated", position_ids="position_ids")
    declared_as = {"num_layers": "config.json: num_hidden_layers", "kv_heads": "config.json: num_key_value_heads",
                   "head_dim": "config.json: " + ("head_dim" if config.get("head_dim") else "hidden_size / num_attention_heads")}
    return Source(folder, _graph_path(folder, "model.onnx", where), io, facts,
                  _existing(folder, ("config.json", "generation_config.json", "tokenizer_config.json",
                                     "special_tokens_map.json", "chat_template.jinja")), declared_as)


def _graph_path(folder: Path, name, where: Path) -> Path:
    path = Path(name) if isinstance(name, str) else None
    if path is None or path.is_absolute() or len(path.parts) != 1 or name in ("", ".", ".."):
        raise ImportRefused(f"{where}: graph file {name!r}; expected a plain file name inside {folder}")
    if not (folder / path).is_file() or (folder / path).is_symlink():
        raise ImportRefused(f"{folder / path}: missing or not a regular file; expected the decoder's graph")
    return folder / path


SOURCES = (("genai_config.json", read_genai), ("config.json", read_optimum))  # a genai folder may hold config.json too


def graph_io(source: Source, model) -> dict:
    """Check the graph's declared inputs and outputs (``model``: its ModelProto, weights not loaded) against what the
    folder declares; return its cache dtype and, for an optimum graph, whether it takes position_ids. ImportRefused
    names an input we do not drive, a past without its present, or a count of layers that differs."""
    io, layers = source.io, source.facts["num_layers"]
    declared = {value.name: value for value in [*model.graph.input, *model.graph.output]}
    got_in = [value.name for value in model.graph.input]
    got_out = [value.name for value in model.graph.output]
    where = source.graph
    pattern = {kind: re.compile("^" + re.escape(name).replace("%d", r"(\d+)") + "$")
               for kind, name in (("past_key", io.past_key), ("past_value", io.past_value),
                                  ("present_key", io.present_key), ("present_value", io.present_value))}
    layer_of = {kind: {int(m.group(1)) for n in (got_in if kind.startswith("past") else got_out)
                       if (m := p.match(n))} for kind, p in pattern.items()}
    plain_in = {io.input_ids, io.attention_mask} | ({io.position_ids} if io.position_ids else set())
    unknown = [n for n in got_in if n not in plain_in and not any(pattern[k].match(n) for k in ("past_key", "past_value"))]
    if unknown:
        raise ImportRefused(f"{where.name}: inputs {unknown[:4]} are not ones we drive; expected "
                            f"{sorted(plain_in)} and {io.past_key} / {io.past_value}")
    missing = [n for n in (io.input_ids, io.attention_mask) if n not in got_in] + (
        [io.logits] if io.logits not in got_out else [])
    if missing:
        raise ImportRefused(f"{where.name}: no tensor {missing[0]!r}; {source.io.source} graphs have one")
    for kind, found in layer_of.items():  # layers 0 .. layers - 1, compared without a set of the declared count
        if len(found) != layers or max(found, default=-1) != layers - 1:
            other = {"past_key": "present_key", "present_key": "past_key", "past_value": "present_value",
                     "present_value": "past_value"}[kind]
            said = source.declared_as.get("num_layers", "the folder's config")
            raise ImportRefused(f"{where.name}: {getattr(io, kind)} exists for layers {sorted(found)[:8]} and "
                                f"{getattr(io, other)} for {sorted(layer_of[other])[:8]}; expected each of the "
                                f"{layers} layers ({said}) once, past and present paired")
    facts = source.facts
    for name in (io.past_key % 0, io.past_value % 0):  # the sizes the config declares, where the graph fixes them
        dims = [d.dim_value if d.HasField("dim_value") else None for d in declared[name].type.tensor_type.shape.dim]
        for axis, size in ((1, "kv_heads"), (3, "head_dim")):
            if len(dims) == 4 and dims[axis] is not None and dims[axis] != facts[size]:
                said = source.declared_as.get(size, f"the folder's config: {size}")
                raise ImportRefused(f"{where.name}: {name} has {dims[axis]} {'heads' if axis == 1 else 'dims a head'}; "
                                    f"{said} declares {facts[size]}")
    elem = declared[io.past_key % 0].type.tensor_type.elem_type
    dtype = ONNX_TYPES.get(elem, str(elem))
    if dtype not in DTYPES:
        raise ImportRefused(f"{where.name}: cache dtype {dtype}; expected one of {DTYPES}")
    takes_positions = bool(io.position_ids) and io.position_ids in got_in
    return {"dtype": dtype, "takes_positions": takes_positions}
