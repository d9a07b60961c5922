"""The verify-v1 contract and the artifact manifest, as data.

Every exported decoder (draft or target) has one signature, declared here once and written
into ``manifest.json``; engines and the runtime read names and sizes from the manifest, never
from constants.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .files import MAX_JSON_BYTES, MAX_TOKENIZER_BYTES, FileMissing, FileRefused, read_regular, sha256_file
from .values import is_integer, short

CONTRACT = "verify-v1"
MANIFEST = "manifest.json"
ROLES = ("target", "draft")
DTYPES = ("float32", "float16")
WEIGHT_FORMATS = ("full", "int4", "int8")
# explicit: standard ops, new K/V as outputs staged by the runtime (the reference; what TensorRT parses).
# fused: ONNX Runtime's fused LLM ops, the new K/V written into the cache in place.
GRAPH_FORMS = ("explicit", "fused")
# int8 weights use 7 bits from this exporter on: full-range ones saturate MLAS's int8 GEMM on CPUs without
# VNNI (specdeploy/exporter/int8.py).
INT8_REDUCED_RANGE_SINCE = (0, 3, 3)
REEXPORT_INT8 = "re-export with specdeploy 0.3.3 or later (7-bit weights, same speed)"
# The runtime prefills prompts in calls of at most this many tokens; TensorRT profiles cover it.
# The ONNX IR version every exported graph declares: what the oldest onnxruntime the core admits (1.20) reads. onnx
# 1.23 writes IR 14 unless told otherwise, and onnxruntime(-gpu) 1.31.1 refused such fused graphs on an H200
# ("Unsupported model IR version: 14, max supported IR version: 13"; tools/gpu_check.py); traced graphs carry 10.
IR_VERSION = 10
PREFILL_CHUNK = 512
# Each exported graph's metadata_props name the role it was exported as: a manifest whose target and draft files
# are swapped (it carries no hash of itself) is told from the graphs even where their shapes agree.
GRAPH_ROLE_KEY = "specdeploy.role"
# How a graph we did not write (``specdeploy import``) keeps its cache: "shared", one buffer of capacity slots fed as
# past and bound as present, the new tokens' K/V written in place, each row's length read off its attention mask
# (onnxruntime-genai's builder); "concatenated", present = past followed by the new tokens (optimum's export)
CACHE_LAYOUTS = ("shared", "concatenated")
IMPORT_SOURCES = ("onnxruntime-genai", "optimum")


class ContractError(ValueError):
    """An artifact or manifest that does not satisfy the verify contract."""


@dataclass(frozen=True)
class StateSpec:
    """One kind of recurrent state a model keeps beside its K/V (docs/architecture.md, "Recurrent state"): cache too,
    held by position as K/V is, so that rollback moves a length.

    ``name``: the graph's tensors are ``cache_{name}.{layer}`` (input), ``new_{name}.{layer}`` (explicit form: the
    states of the call's last ``min(tokens, slots)`` positions, staged by the engine) or ``present_{name}.{layer}``
    (fused form: the buffer itself, written in place). ``layers``: the layers that keep it (a layer no state names is
    an attention layer, with K/V). ``shape``: one position's state. ``lookback``: how many positions before a call's
    first token it reads (a convolution's kernel - 1; a state-space scan's 1). ``slots``: 0, one per cache slot
    (positional, as K/V: rollback and prefix reuse at any length); W > 0, a ring of W positions, position p at slot
    p mod W: rollback within ``max_drafts``, a prefix reused only where its text ended."""

    name: str
    layers: tuple[int, ...]
    shape: tuple[int, ...]
    lookback: int
    slots: int = 0

    def buffer_shape(self, batch: int, capacity: int) -> tuple[int, ...]:
        """One layer's buffer: [batch, slots (capacity where positional), *shape]."""
        return (batch, self.slots or capacity, *self.shape)

    def written(self, tokens: int) -> int:
        """How many positions' states a call of ``tokens`` tokens writes: its last min(tokens, slots)."""
        return min(tokens, self.slots) if self.slots else tokens

    @property
    def max_drafts(self) -> int | None:
        """The most drafts a cycle may verify over a ring (None: positional, no bound): a verification of k + 1 tokens
        (k + 2 in exact mode) must leave the states it may roll back to, ``lookback`` positions before its first token
        included, in the ring."""
        return self.slots - self.lookback - 2 if self.slots else None


def kv_layers(num_layers: int, states: tuple[StateSpec, ...] = ()) -> list[int]:
    """The layers with K/V: every layer that no recurrent state names (all of them in a plain transformer)."""
    recurrent = {i for state in states for i in state.layers}
    return [i for i in range(num_layers) if i not in recurrent]


def state_names(states: tuple[StateSpec, ...], kind: str) -> list[str]:
    """``{kind}_{name}.{layer}`` of every state, kind by kind in declared order, layers in order (the buffers' order)."""
    return [f"{kind}_{state.name}.{i}" for state in states for i in state.layers]


def input_names(num_layers: int, states: tuple[StateSpec, ...] = ()) -> list[str]:
    """Graph inputs in order: input_ids, past_len, cache_key.i / cache_value.i per attention layer, then
    cache_{state}.i per recurrent state (``StateSpec``)."""
    names = ["input_ids", "past_len"]
    for i in kv_layers(num_layers, states):
        names += [f"cache_key.{i}", f"cache_value.{i}"]
    return names + state_names(states, "cache")


def slot_input_names(states: tuple[StateSpec, ...]) -> list[str]:
    """The fused form's state slot inputs (``ModelSpec.takes_state_slots``), per kind of state in declared order:
    ``read_slots_{name}`` int64 [batch, lookback], the slots of the positions before a call's first token (-1 for a
    position before 0, whose state is zeros), and ``write_slots_{name}`` int64 [batch, written], the slots of the
    call's last ``StateSpec.written(tokens)`` positions, where their states go: position p at slot p mod slots."""
    return [f"{kind}_slots_{state.name}" for state in states for kind in ("read", "write")]


def output_names(num_layers: int, graph: str = "explicit", states: tuple[StateSpec, ...] = ()) -> list[str]:
    """Graph outputs in order: logits, then per attention layer new_key.i / new_value.i (explicit form: the new tokens'
    K/V) or present_key.i / present_value.i (fused form: the cache itself, bound to the input buffers), then the
    recurrent states' new_{state}.i or present_{state}.i alike."""
    kind = "new" if graph == "explicit" else "present"
    names = ["logits"]
    for i in kv_layers(num_layers, states):
        names += [f"{kind}_key.{i}", f"{kind}_value.{i}"]
    return names + state_names(states, kind)


@dataclass(frozen=True)
class ImportedIO:
    """The contract of a graph we did not write, as its folder declares it: which tensor means what, the cache
    layout, and what the import changed in its files. Layer tensors are %-patterns of the layer index."""

    source: str  # IMPORT_SOURCES: the tool that wrote the folder
    cache: str  # CACHE_LAYOUTS
    input_ids: str = "input_ids"
    attention_mask: str = "attention_mask"
    position_ids: str = ""  # "" where the graph computes positions from the attention mask
    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    logits: str = "logits"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"
    origin: str = ""  # the graph's file name in the source folder
    origin_sha256: str = ""  # and its sha256 there, before the rewrites
    rewrites: tuple[str, ...] = ()  # each change made to the graph's own file, in words

    def cache_names(self, num_layers: int, kind: str) -> list[str]:
        """past (``kind`` "past") or present ("present") key.i / value.i per layer, in the cache's buffer order."""
        key, value = (self.past_key, self.past_value) if kind == "past" else (self.present_key, self.present_value)
        return [name % i for i in range(num_layers) for name in (key, value)]


@dataclass(frozen=True)
class ModelSpec:
    """One exported decoder: what engines and the runtime need to drive it."""

    role: str
    file: str
    architecture: str
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str
    weights: str
    capacity: int
    tokenizer_fingerprint: str
    eos_token_ids: tuple[int, ...] = ()
    parameters: int = 0
    graph: str = "explicit"
    # A draft may score only tokens 0 .. vocab_kept - 1 (its logits for the rest are -inf): None, all of them
    vocab_kept: int | None = None
    # The graph takes ``num_logits`` (int64 [1]) and returns the logits of each row's last num_logits new tokens
    # only: a prefill chunk or a draft's catch-up needs one position's, and the head over every position was a
    # quarter of a 128-token prefill's time on the real pair (exporter 0.3.2's fused form)
    trims_logits: bool = False
    # The fused graph takes GroupQueryAttention's own ``seqlens_k`` (int32 [batch]: past_len + tokens - 1, filled by
    # the engine) in place of ``past_len``, and reads total_sequence_length off the cache's capacity: no length
    # arithmetic in the graph, so every node runs on the CUDA EP and each shape can be captured as a CUDA graph
    # (older fused graphs, whose manifests lack the field, compute the lengths from past_len: on the CPU EP)
    takes_seqlens_k: bool = False
    # The graph also outputs ``ids`` (int64 [batch, kept]): each position's argmax token, so that greedy acceptance
    # reads a few integers instead of [batch, kept, vocab] logits (fused graphs; absent from older manifests: false)
    argmax_ids: bool = False
    # The fused hybrid graph takes each recurrent state's slots as inputs the engine fills (``slot_input_names``), as it
    # fills seqlens_k: no slot arithmetic in the graph, so every node runs on the CUDA EP. Fused hybrids exported before
    # (manifests without the field) compute them from seqlens_k and the call's shape: int64 nodes ONNX Runtime places on
    # the CPU EP, whose values are copied to the device inside the call, which rules out CUDA-graph capture
    takes_state_slots: bool = False
    # The explicit graph's attention writes the new tokens' K/V at their own slots of a copy of the cache and runs one
    # MatMul and softmax over every slot (``exporter.layers.cached_attention``), so a position's logits do not depend
    # on which call wrote its keys: exact mode can run on it. Absent from older manifests (their attention scored a
    # call's own keys apart from the cache's): false, and exact mode refuses them
    slot_attention: bool = False
    # The explicit graph's attention reads only each cache's first slots: the longest row's past_len + tokens, rounded
    # up to a multiple of this many (at most the capacity), instead of every slot (``exporter.filled``; 0: every slot,
    # as older manifests, which lack the field). What ``specdeploy export --provider openvino`` writes
    filled_slots: int = 0
    # A graph we did not write (``specdeploy import``): its own tensor names and cache layout; None for our exports.
    # Its graph form says how calls run: "fused" for a shared buffer written in place, "explicit" for new K/V returned
    imported: ImportedIO | None = None
    # The exporter's family description this model was built from (exporter/families.py; "" in manifests from before
    # families were descriptions) and what sets it apart from a plain Llama, in words ("sliding window 4096 on 13 of
    # 26 layers", "logits soft-cap 30"): shown by inspect and doctor, read by nothing that runs the model
    family: str = ""
    features: tuple[str, ...] = ()
    # Recurrent state beside K/V (hybrid families: LFM2's short convolutions, Granite 4's Mamba-2), one entry a kind;
    # empty for a plain transformer and in manifests from before recurrent families
    states: tuple[StateSpec, ...] = ()

    @property
    def inputs(self) -> list[str]:
        io = self.imported
        if io is not None:
            return ([io.input_ids, io.attention_mask] + ([io.position_ids] if io.position_ids else [])
                    + io.cache_names(self.num_layers, "past") + (["num_logits"] if self.trims_logits else []))
        names = input_names(self.num_layers, self.states)
        if self.takes_seqlens_k:
            names[1] = "seqlens_k"
        return names + self.slot_inputs + (["num_logits"] if self.trims_logits else [])

    @property
    def slot_inputs(self) -> list[str]:
        """The state slot inputs the engine fills (``takes_state_slots``; ``slot_input_names``), else none."""
        return slot_input_names(self.states) if self.takes_state_slots else []

    @property
    def lengths_input(self) -> str:
        """The graph input that says where each row's new tokens go: ``past_len``, ``seqlens_k`` or an imported
        graph's attention mask."""
        if self.imported is not None:
            return self.imported.attention_mask
        return "seqlens_k" if self.takes_seqlens_k else "past_len"

    @property
    def cache_inputs(self) -> list[str]:
        """cache_key.i / cache_value.i per layer (an imported graph's past names), in the order of the cache's buffers."""
        if self.imported is not None:
            return self.imported.cache_names(self.num_layers, "past")
        return input_names(self.num_layers)[2:] if not self.states else [
            name for i in self.kv_layers for name in (f"cache_key.{i}", f"cache_value.{i}")]

    @property
    def kv_layers(self) -> list[int]:
        """The layers with K/V (``kv_layers``): every layer but the recurrent ones."""
        return kv_layers(self.num_layers, self.states)

    @property
    def state_inputs(self) -> list[str]:
        """cache_{state}.i of every recurrent state, in the order of the cache's state buffers."""
        return state_names(self.states, "cache")

    @property
    def state_outputs(self) -> list[str]:
        """new_{state}.i (explicit form) or present_{state}.i (fused form) of every recurrent state."""
        return state_names(self.states, "new" if self.graph == "explicit" else "present")

    @property
    def max_drafts(self) -> int | None:
        """The most drafts a cycle may verify (``StateSpec.max_drafts`` of its rings), None where nothing bounds it."""
        bounds = [state.max_drafts for state in self.states if state.slots]
        return min(bounds) if bounds else None

    @property
    def keeps_ring(self) -> bool:
        """A recurrent state is kept in a ring (``StateSpec.slots``): only the last positions' states are there."""
        return any(state.slots for state in self.states)

    @property
    def outputs(self) -> list[str]:
        if self.imported is not None:
            return [self.imported.logits] + self.cache_outputs
        return output_names(self.num_layers, self.graph, self.states) + (["ids"] if self.argmax_ids else [])

    @property
    def cache_outputs(self) -> list[str]:
        """new_key.i / new_value.i (explicit form) or present_key.i / present_value.i (fused form) per layer; an
        imported graph's present names."""
        if self.imported is not None:
            return self.imported.cache_names(self.num_layers, "present")
        kind = "new" if self.graph == "explicit" else "present"
        return [name for i in self.kv_layers for name in (f"{kind}_key.{i}", f"{kind}_value.{i}")]

    @property
    def writes_cache(self) -> bool:
        """The graph writes the new tokens' K/V into the bound cache itself (fused form): nothing to stage."""
        return self.graph == "fused"

    def cache_shape(self, batch: int, capacity: int) -> tuple[int, int, int, int]:
        """Shape of one layer's key (or value) cache: [batch, kv_heads, capacity, head_dim]."""
        return (batch, self.kv_heads, capacity, self.head_dim)

    def cache_bytes(self, batch: int, capacity: int) -> int:
        """Bytes of all keys and values (and recurrent states) of this model for ``batch`` rows of ``capacity`` slots."""
        itemsize = 4 if self.dtype == "float32" else 2
        kv = 2 * len(self.kv_layers) * batch * self.kv_heads * capacity * self.head_dim
        states = sum(len(state.layers) * math.prod(state.buffer_shape(batch, capacity)) for state in self.states)
        return (kv + states) * itemsize


@dataclass
class Manifest:
    """The content of ``manifest.json``: contract version, models, tokenizer and file hashes."""

    models: dict[str, ModelSpec]
    tokenizer: str = "tokenizer.json"
    files: dict[str, str] = field(default_factory=dict)
    contract: str = CONTRACT
    exporter_version: str = ""
    opset: int = 0
    engines: dict[str, dict] = field(default_factory=dict)  # role -> TensorRT build facts (specdeploy build)

    @property
    def target(self) -> ModelSpec:
        return self.models["target"]

    @property
    def draft(self) -> ModelSpec | None:
        return self.models.get("draft")

    def to_json(self) -> str:
        data = asdict(self)
        for spec in data["models"].values():
            spec["eos_token_ids"] = list(spec["eos_token_ids"])
            spec["features"] = list(spec["features"])
        return json.dumps(data, indent=2, sort_keys=True)

    def write(self, directory: Path) -> Path:
        path = Path(directory) / MANIFEST
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        """Read and validate ``directory/manifest.json``; raise ContractError naming what is wrong."""
        path = Path(directory) / MANIFEST
        try:
            data = json.loads(read_regular(path, MAX_JSON_BYTES).decode("utf-8"))
        except FileMissing as exc:
            raise ContractError(f"{path}: no manifest; is this an artifact dir written by `specdeploy export`?") from exc
        except FileRefused as exc:
            raise ContractError(str(exc)) from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ContractError(f"{path}: not valid JSON ({exc})") from exc
        except RecursionError as exc:
            raise ContractError(f"{path}: nested too deeply to be a manifest") from exc
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: object, where: str = MANIFEST) -> Manifest:
        if not isinstance(data, dict):
            raise ContractError(f"{where}: expected a JSON object, got {type(data).__name__}")
        contract = _field(data, "contract", str, where)
        if contract != CONTRACT:
            raise ContractError(f"{where}: contract {contract!r} is not supported; expected {CONTRACT!r}")
        models_data = _field(data, "models", dict, where)
        if "target" not in models_data:
            raise ContractError(f"{where}: models has no 'target' entry")
        models = {}
        for role, spec in models_data.items():
            if role not in ROLES:
                raise ContractError(f"{where}: models.{role}: unknown role; expected one of {ROLES}")
            models[role] = _spec_from_dict(spec, f"{where}: models.{role}")
        files = _field(data, "files", dict, where)
        for name, digest in files.items():
            if len(name) > MAX_TEXT or not isinstance(digest, str) or len(digest) != 64:
                raise ContractError(f"{where}: files.{short(name)}: expected a sha256 hex digest, got {short(digest)}")
            _check_relative(name, f"{where}: files")  # an absolute or climbing name is no file of the artifact
        engines = data.get("engines", {})
        if not isinstance(engines, dict) or not all(isinstance(v, dict) for v in engines.values()):
            raise ContractError(f"{where}: engines must map roles to objects, got {engines!r}")
        return cls(
            models=models,
            tokenizer=_field(data, "tokenizer", str, where),
            files=files,
            contract=contract,
            exporter_version=_field(data, "exporter_version", str, where, default=""),
            opset=_field(data, "opset", int, where, default=0),
            engines=engines,
        )


_SPEC_TYPES = {
    "role": str, "file": str, "architecture": str, "num_layers": int, "num_heads": int,
    "kv_heads": int, "head_dim": int, "vocab_size": int, "dtype": str, "weights": str,
    "capacity": int, "tokenizer_fingerprint": str,
}


MAX_TEXT = 256  # characters in a manifest string: names, versions, digests (a longer one is not ours)
MAX_SIZE = 2**31 - 1  # layers, heads, dims, vocabulary, capacity, opset


def saturating_int8(manifest: Manifest) -> dict[str, str]:
    """Role -> what is wrong, for int8 weights an exporter before 0.3.3 wrote at full range (wrong logits on AVX2
    without VNNI); ``REEXPORT_INT8`` says what to do."""
    try:
        version = tuple(int(part) for part in manifest.exporter_version.split(".")[:3])
    except ValueError:  # no version recorded, or not a release's: older than any that records one
        version = ()
    return {role: f"{role}: int8 weights at full range (exporter {manifest.exporter_version or 'unknown'}): CPUs "
                  "without VNNI (AVX2) saturate them in ONNX Runtime's int8 GEMM and compute wrong logits"
            for role, spec in manifest.models.items() if spec.weights == "int8" and version < INT8_REDUCED_RANGE_SINCE}


def _field(data: dict, name: str, kind: type, where: str, default=None):
    """``data[name]``, checked: its type, and its size (strings of at most MAX_TEXT characters, integers
    in [0, MAX_SIZE]; parameters may be larger). ``default``: the value of an optional field."""
    if name not in data:
        if default is not None:
            return default
        raise ContractError(f"{where}: missing field {name!r}")
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ContractError(f"{where}: field {name!r} must be {kind.__name__}, got {type(value).__name__} {short(value)}")
    if kind is str and len(value) > MAX_TEXT:
        raise ContractError(f"{where}: field {name!r} is {len(value):,} characters; expected at most {MAX_TEXT}")
    if kind is int and not 0 <= value <= (2**63 - 1 if name == "parameters" else MAX_SIZE):
        raise ContractError(f"{where}: field {name!r} is {value}; expected an integer in [0, {MAX_SIZE}]")
    return value


def _spec_from_dict(data: object, where: str) -> ModelSpec:
    if not isinstance(data, dict):
        raise ContractError(f"{where}: expected an object, got {type(data).__name__}")
    values = {name: _field(data, name, kind, where) for name, kind in _SPEC_TYPES.items()}
    for name in ("num_layers", "num_heads", "kv_heads", "head_dim", "vocab_size", "capacity"):
        if values[name] <= 0:
            raise ContractError(f"{where}: {name} must be positive, got {values[name]}")
    if values["dtype"] not in DTYPES:
        raise ContractError(f"{where}: dtype {values['dtype']!r} not in {DTYPES}")
    if values["weights"] not in WEIGHT_FORMATS:
        raise ContractError(f"{where}: weights {values['weights']!r} not in {WEIGHT_FORMATS}")
    if values["num_heads"] % values["kv_heads"]:
        raise ContractError(f"{where}: num_heads {values['num_heads']} is not a multiple of kv_heads {values['kv_heads']}")
    _check_relative(values["file"], where)
    eos = data.get("eos_token_ids", [])
    if (not isinstance(eos, list) or len(eos) > 64
            or not all(is_integer(t) and 0 <= t <= MAX_SIZE for t in eos)):
        raise ContractError(f"{where}: eos_token_ids must be a list of at most 64 token ids, got {short(eos)}")
    if any(t >= values["vocab_size"] for t in eos):
        raise ContractError(f"{where}: eos_token_ids {eos} reach outside the vocabulary [0, {values['vocab_size']})")
    graph = _field(data, "graph", str, where, default="explicit")
    if graph not in GRAPH_FORMS:
        raise ContractError(f"{where}: graph {graph!r} not in {GRAPH_FORMS}")
    kept = data.get("vocab_kept")
    if kept is not None:
        if not is_integer(kept) or not 1 <= kept < values["vocab_size"]:
            raise ContractError(f"{where}: vocab_kept must be an integer in [1, {values['vocab_size']}), got {short(kept)}")
        if values["role"] != "draft":
            raise ContractError(f"{where}: vocab_kept {kept} on the {values['role']} model; only a draft may leave tokens "
                                "out (the target's distribution is the one decoding must follow)")
    flags = {}
    for name in ("trims_logits", "takes_seqlens_k", "argmax_ids", "slot_attention", "takes_state_slots"):  # absent
        # from older manifests: false
        flags[name] = data.get(name, False)
        if not isinstance(flags[name], bool):
            raise ContractError(f"{where}: {name} must be true or false, got {short(flags[name])}")
    if flags["takes_seqlens_k"] and graph != "fused":
        raise ContractError(f"{where}: takes_seqlens_k on a {graph} graph; only the fused form takes seqlens_k")
    if flags["slot_attention"] and graph != "explicit":
        raise ContractError(f"{where}: slot_attention on a {graph} graph; only the explicit form declares it")
    filled = data.get("filled_slots", 0)
    if not is_integer(filled) or filled < 0 or (filled and graph != "explicit"):
        raise ContractError(f"{where}: filled_slots must be an integer >= 0, and 0 on a {graph} graph (only the explicit "
                            f"form's attention reads its filled slots alone); got {short(filled)}")
    imported = data.get("imported")
    if imported is not None:
        imported = _imported_from_dict(imported, graph, flags, f"{where}: imported")
    features = data.get("features", [])
    if (not isinstance(features, list) or len(features) > 64
            or not all(isinstance(f, str) and len(f) <= MAX_TEXT for f in features)):
        raise ContractError(f"{where}: features must be a list of at most 64 strings, got {short(features)}")
    states = _states_from_list(data.get("states", []), values["num_layers"], f"{where}: states")
    if states and imported is not None:
        raise ContractError(f"{where}: states on an imported graph; only our own exports declare recurrent state")
    if flags["takes_state_slots"] and (graph != "fused" or not states):
        graph_said = "an explicit graph" if graph != "fused" else "a fused graph without recurrent states"
        raise ContractError(f"{where}: takes_state_slots on {graph_said}; only a fused graph with recurrent states takes "
                            "their slots")
    return ModelSpec(**values, eos_token_ids=tuple(eos), parameters=_field(data, "parameters", int, where, default=0),
                     graph=graph, vocab_kept=kept, imported=imported, **flags, filled_slots=filled,
                     family=_field(data, "family", str, where, default=""), features=tuple(features), states=states)


MAX_STATE_DIMS = 4  # a position's state: [hidden] (a convolution's input), [heads, head_dim, state] (Mamba-2's)


def _states_from_list(data: object, num_layers: int, where: str) -> tuple[StateSpec, ...]:
    """The recurrent states a manifest declares, each checked: a name of letters, its own layers within the model's,
    positive dims, a lookback of at least 1, and a ring (``slots`` > 0) long enough for one draft at least."""
    if not isinstance(data, list) or len(data) > 8:
        raise ContractError(f"{where}: expected a list of at most 8 objects, got {short(data)}")
    states, names = [], set()
    for n, entry in enumerate(data):
        at = f"{where}[{n}]"
        if not isinstance(entry, dict):
            raise ContractError(f"{at}: expected an object, got {type(entry).__name__}")
        name = _field(entry, "name", str, at)
        if not name.isalpha() or not name.islower() or name in ("key", "value") or name in names:
            raise ContractError(f"{at}: name {short(name)} must be lower-case letters, not key, value or another "
                                "state's name")
        names.add(name)
        layers, shape = entry.get("layers"), entry.get("shape")
        if (not isinstance(layers, list) or not layers or len(set(map(repr, layers))) != len(layers)
                or not all(is_integer(i) and 0 <= i < num_layers for i in layers)):
            raise ContractError(f"{at}: layers must be distinct layer indices in [0, {num_layers}), got {short(layers)}")
        if (not isinstance(shape, list) or not 1 <= len(shape) <= MAX_STATE_DIMS
                or not all(is_integer(d) and 1 <= d <= MAX_SIZE for d in shape)):
            raise ContractError(f"{at}: shape must be 1 to {MAX_STATE_DIMS} positive dims, got {short(shape)}")
        lookback, slots = _field(entry, "lookback", int, at), _field(entry, "slots", int, at, default=0)
        if lookback < 1:
            raise ContractError(f"{at}: lookback must be at least 1, got {lookback}")
        state = StateSpec(name, tuple(int(i) for i in layers), tuple(int(d) for d in shape), lookback, slots)
        if slots and state.max_drafts < 1:
            raise ContractError(f"{at}: a ring of {slots} slots holds no draft (lookback {lookback}); expected at least "
                                f"{lookback + 3}")
        states.append(state)
    return tuple(states)


# the graph form each cache layout runs as: a shared buffer is written in place, a concatenated cache's new K/V returned
LAYOUT_FORMS = {"shared": "fused", "concatenated": "explicit"}


def _imported_from_dict(data: object, graph: str, flags: dict, where: str) -> ImportedIO:
    if not isinstance(data, dict):
        raise ContractError(f"{where}: expected an object, got {type(data).__name__}")
    names = [f.name for f in dataclasses.fields(ImportedIO) if f.name != "rewrites"]
    values = {name: _field(data, name, str, where, default="") for name in names}
    if values["source"] not in IMPORT_SOURCES:
        raise ContractError(f"{where}: source {short(values['source'])} not in {IMPORT_SOURCES}")
    if values["cache"] not in CACHE_LAYOUTS:
        raise ContractError(f"{where}: cache {short(values['cache'])} not in {CACHE_LAYOUTS}")
    if LAYOUT_FORMS[values["cache"]] != graph:
        raise ContractError(f"{where}: a {values['cache']} cache runs as the {LAYOUT_FORMS[values['cache']]} graph "
                            f"form, got graph {graph!r}")
    for name in ("past_key", "past_value", "present_key", "present_value"):
        if values[name].count("%d") != 1 or values[name].count("%") != 1:
            raise ContractError(f"{where}: {name} {short(values[name])} must hold the layer index as one %d")
    for name in ("input_ids", "attention_mask", "logits"):
        if not values[name]:
            raise ContractError(f"{where}: missing field {name!r}")
    # trims_logits is a rewrite an import makes (importer/rewrites.py: the head's input sliced, input num_logits)
    set_flags = [name for name, value in flags.items() if value and name != "trims_logits"]
    if set_flags:
        raise ContractError(f"{where}: {set_flags} describe our own graphs; an imported graph has none of them")
    rewrites = data.get("rewrites", [])
    if not isinstance(rewrites, list) or len(rewrites) > 16 or not all(isinstance(r, str) and len(r) <= MAX_TEXT
                                                                       for r in rewrites):
        raise ContractError(f"{where}: rewrites must be a list of at most 16 strings, got {short(rewrites)}")
    return ImportedIO(**values, rewrites=tuple(rewrites))


def _check_relative(name: str, where: str) -> None:
    path = Path(name)
    if path.is_absolute() or ".." in path.parts or len(path.parts) != 1 or name in ("", ".", MANIFEST):
        raise ContractError(f"{where}: file {short(name)} must be a plain file name inside the artifact dir, other "
                            f"than {MANIFEST}")


def tokenizer_problems(tokenizer, manifest: Manifest, facts: dict | None = None) -> list[str]:
    """Where an artifact's tokenizer does not fit its models: another tokenizer at export, or token ids beyond
    the vocabulary (the model has no logit, no embedding for them). ``facts``: ``tokenizer_facts``, when known."""
    problems = []
    facts = facts or tokenizer_facts(tokenizer)
    fingerprint = facts["fingerprint"]
    for spec in manifest.models.values():
        if spec.tokenizer_fingerprint != fingerprint:
            problems.append(f"the {spec.role} model was exported with another tokenizer than {manifest.tokenizer} "
                            f"(fingerprint {spec.tokenizer_fingerprint[:12]}…, artifact tokenizer {fingerprint[:12]}…)")
    vocab = manifest.target.vocab_size
    if facts["largest_id"] >= vocab:  # ids, not counts: one word mapped to id 10**6 is one token, and out of range
        problems.append(f"{manifest.tokenizer}: token ids up to {facts['largest_id']} ({facts['tokens']} tokens), outside "
                        f"the models' vocabulary [0, {vocab})")
    return problems


def read_tokenizer(path: Path, name: str | None = None):
    """The ``tokenizers.Tokenizer`` saved at ``path``: a regular file of at most MAX_TOKENIZER_BYTES, refused
    with a ContractError naming it (as ``name``, default its path) and what is wrong with it otherwise."""
    from tokenizers import Tokenizer

    name = name or str(path)
    try:
        text = read_regular(path, MAX_TOKENIZER_BYTES).decode("utf-8")
        return Tokenizer.from_str(text)
    except FileRefused as exc:
        raise ContractError(f"{name}: {exc.reason}") from exc
    except Exception as exc:  # the tokenizers library raises a bare Exception for a malformed file
        raise ContractError(f"{name}: not a readable tokenizer ({type(exc).__name__}: {short(str(exc), 200)})") from exc


def io_problems(spec: ModelSpec, declared: dict[str, tuple[str, list]]) -> list[str]:
    """Where a graph's declared tensor types and fixed dims disagree with what ``spec`` says of it.

    ``declared`` maps tensor name -> (NumPy dtype name, dims: ints, or names / None where dynamic).
    A dynamic dim agrees with anything; a fixed one must be the manifest's (kv_heads, head_dim, vocab_size).
    """
    kv = [None, spec.kv_heads, None, spec.head_dim]
    expected = {"input_ids": ("int64", [None, None]), "past_len": ("int64", [None]), "seqlens_k": ("int32", [None]),
                spec.outputs[0]: ("float32", [None, None, spec.vocab_size]), "ids": ("int64", [None, None])}
    expected |= {name: (spec.dtype, kv) for name in spec.cache_inputs + spec.cache_outputs}
    for state in spec.states:  # [batch, slots, *shape]; the explicit form's new states: [batch, written, *shape]
        slots = [None, state.slots or None, *state.shape]
        expected |= {f"cache_{state.name}.{i}": (spec.dtype, slots) for i in state.layers}
        written = slots if spec.graph == "fused" else [None, None, *state.shape]
        kind = "new" if spec.graph == "explicit" else "present"
        expected |= {name: (spec.dtype, written) for name in state_names((state,), kind)}
        expected |= {f"read_slots_{state.name}": ("int64", [None, state.lookback]),
                     f"write_slots_{state.name}": ("int64", [None, None])}
    expected["num_logits"] = ("int64", [1])
    states = set(spec.state_inputs + spec.state_outputs + slot_input_names(spec.states))
    problems = []
    for name, (dtype, dims) in expected.items():
        if name not in declared:
            continue  # names are checked apart
        got_type, got_dims = declared[name]
        fixed_differ = any(isinstance(g, int) and e is not None and g != e for g, e in zip(got_dims, dims))
        if got_type != dtype or len(got_dims) != len(dims) or fixed_differ:
            want = ["?" if e is None else e for e in dims]
            sizes = "its state's slots and shape" if name in states else "kv_heads, head_dim, vocab_size"
            problems.append(f"{name}: the graph declares {got_type} {list(got_dims)}; the manifest says {dtype} {want} "
                            f"(dtype, {sizes} of the {spec.role} model)")
    return problems


def verify_files(directory: Path, manifest: Manifest, remembered: bool = False) -> list[str]:
    """Compare every file the manifest lists with its sha256; return one problem per line (empty: all good).
    ``remembered``: a file unchanged since it was last hashed (``digests``) is not hashed again."""
    from .digests import remembered_sha256  # only here: the contract alone loads no record of the user's cache

    digest_of = remembered_sha256 if remembered else sha256_file
    problems = []
    directory = Path(directory)
    for name, expected in sorted(manifest.files.items()):
        try:
            _check_relative(name, "files")
        except ContractError as exc:
            problems.append(str(exc))
            continue
        path = directory / name
        if path.is_symlink() or not path.is_file():
            problems.append(f"{name}: missing or not a regular file")
            continue
        try:
            got = digest_of(path)
        except (FileRefused, OSError) as exc:  # no permission to read it; swapped for a FIFO since the check
            problems.append(f"{name}: {exc.reason}" if isinstance(exc, FileRefused) else f"{name}: cannot be read ({exc})")
            continue
        if got != expected:
            problems.append(f"{name}: sha256 {got[:16]}… does not match the manifest's {expected[:16]}…")
    for spec in manifest.models.values():
        if spec.file not in manifest.files:
            problems.append(f"{spec.file}: the {spec.role} graph is not listed in the manifest's files")
    if manifest.tokenizer not in manifest.files:
        problems.append(f"{manifest.tokenizer}: the tokenizer is not listed in the manifest's files")
    return problems


def special_tokens(tokenizer) -> dict[str, int]:
    """The special added tokens of a ``tokenizers.Tokenizer``: content -> id."""
    return {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


def tokenizer_fingerprint(tokenizer, vocab: dict[str, int] | None = None) -> str:
    """sha256 over a ``tokenizers.Tokenizer``'s full vocabulary (token -> id) and special tokens."""
    vocab = tokenizer.get_vocab(with_added_tokens=True) if vocab is None else vocab
    payload = json.dumps([sorted(vocab.items()), sorted(special_tokens(tokenizer).items())])
    return hashlib.sha256(payload.encode()).hexdigest()


def tokenizer_facts(tokenizer) -> dict:
    """What the load checks need of a tokenizer, from one pass over its vocabulary (0.2 s for Qwen's 151k
    tokens, so it is remembered per file): its fingerprint, its largest token id and its number of tokens."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return {"fingerprint": tokenizer_fingerprint(tokenizer, vocab), "largest_id": max(vocab.values(), default=-1),
            "tokens": len(vocab)}
