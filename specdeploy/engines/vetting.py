"""Vetting a graph before ONNX Runtime reads it.

A graph may name files for ONNX Runtime to read: the external data of any tensor, wherever the tensor
sits (initializers, sparse tensors, node attributes, subgraphs, model-local functions and their default
attributes, training info), and a precompiled engine in an ``EPContext`` node. Each external-data file
must be a plain file of the artifact that the manifest hashes; otherwise editing that file after export
would change the output with every hash still matching (ONNX loaders have also had path-traversal bugs
here, CVE-2024-27318). The tensors are found by walking every message of the model, not a list of known
places, so a place a later ONNX version adds is walked too.

What a graph states of itself is compared with its manifest entry as well: the heads its attention
nodes declare, and how many positions its position tables (rotary caches, learned position embeddings)
cover, which bounds the capacity a request may use.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..contract import GRAPH_ROLE_KEY, ContractError, Manifest, ModelSpec
from ..files import FileRefused

FACTS = "graph_vetting.4"  # remembered per file identity (``digests``); raise the number whenever _facts changes
# The operator domains a graph we did not write may use: ONNX's own and ONNX Runtime's contrib ops (GroupQueryAttention,
# MatMulNBits, the fused norms). Any other names a custom-op library, code that is not ONNX Runtime's
KNOWN_DOMAINS = ("", "ai.onnx", "com.microsoft")
SINGULAR = {"functions": "function", "graphs": "graph", "tensors": "tensor", "sparse_tensors": "sparse tensor"}


def check_external_data(path: Path, manifest: Manifest) -> None:
    """Refuse a graph whose tensors read external data from anywhere but a plain file of the artifact that the
    manifest lists (absolute, climbing out with ``..``, through a link, unlisted), or that holds an
    ``EPContext`` node (a precompiled engine ONNX Runtime would load from a file)."""
    facts = _graph_facts(path)
    for location, owner in facts["external"].items():
        where = Path(location)
        target = path.parent / where
        if (where.is_absolute() or len(where.parts) != 1 or where.name in ("", ".", "..")
                or location not in manifest.files or target.is_symlink()):
            raise ContractError(
                f"{path.name}: {owner} points its external data at {location!r}; expected a plain file inside "
                f"the artifact dir that the manifest lists ({sorted(manifest.files)[:8]})"
            )
    if facts["engine_nodes"]:
        raise ContractError(f"{path.name}: {facts['engine_nodes'][0]} is an EPContext node (a precompiled engine that "
                            "ONNX Runtime loads from a file); expected none in a specdeploy graph")


def check_foreign_graph(path: Path, folder: Path | None = None) -> None:
    """Refuse a graph we did not write that holds what ours never do: operators of a custom domain (a custom-op
    library's), model-local functions, an ``EPContext`` node; and external data that is not a plain file beside the
    graph (``folder``: where it must be; default the graph's own directory) or that a tensor reads past the end of."""
    facts = _graph_facts(path)
    name = path.name
    foreign = sorted(set(facts["domains"]) - set(KNOWN_DOMAINS))
    if foreign:
        raise ContractError(f"{name}: operators of domain {foreign[0]!r} (custom ops); expected only {KNOWN_DOMAINS} "
                            "(ONNX's and ONNX Runtime's own)")
    if facts["functions"]:
        raise ContractError(f"{name}: {facts['functions']} model-local functions; expected none (their bodies are "
                            "graphs of their own, outside what is vetted here)")
    if facts["engine_nodes"]:
        raise ContractError(f"{name}: {facts['engine_nodes'][0]} is an EPContext node (a precompiled engine that ONNX "
                            "Runtime loads from a file); expected none")
    if facts["sizes"]:
        raise ContractError(f"{name}: {facts['sizes'][0]}")
    folder = path.parent if folder is None else folder
    for location, owner in facts["external"].items():
        where, target = Path(location), folder / location
        if (where.is_absolute() or len(where.parts) != 1 or where.name in ("", ".", "..") or target.is_symlink()
                or not target.is_file()):
            raise ContractError(f"{name}: {owner} points its external data at {location!r}; expected a plain file in "
                                f"{folder}")
        size, needed = target.stat().st_size, facts["extents"].get(location, 0)
        if needed > size:
            raise ContractError(f"{name}: its tensors read {location} up to byte {needed:,}; the file has {size:,}")


def check_graph_facts(path: Path, spec: ModelSpec) -> None:
    """Refuse a manifest entry that disagrees with what its graph states of itself: the role it was exported as
    (target and draft files swapped in the manifest, which carries no hash of itself), the heads its attention nodes
    declare (``num_heads``, ``kv_heads``, one node an attention layer; in the explicit form, the head counts its projections are
    reshaped into) and the positions its position tables cover (the capacity may not exceed them: a request would
    fail inside ONNX Runtime at the first position beyond)."""
    facts = _graph_facts(path)
    problems = []
    if facts["role"] is not None and facts["role"] != spec.role:  # stamped by the exporter since 0.3.4
        problems.append(f"it was exported as the {facts['role']} model, and the manifest lists it as the {spec.role}'s file")
    attention = facts["attention"]
    if attention:
        heads = sorted({(a["num_heads"], a["kv_heads"]) for a in attention})
        if heads != [(spec.num_heads, spec.kv_heads)]:
            problems.append(f"its attention nodes declare (num_heads, kv_heads) {heads}; the manifest says "
                            f"({spec.num_heads}, {spec.kv_heads})")
        if len(attention) != len(spec.kv_layers):  # a hybrid's recurrent layers have none
            problems.append(f"it has {len(attention)} attention nodes (one an attention layer); the manifest says "
                            f"{len(spec.kv_layers)} attention layers")
    heads = {h for h, d in facts.get("views", ()) if d == spec.head_dim}
    if not attention and heads and heads != {spec.num_heads, spec.kv_heads}:  # the explicit form: its head reshapes
        problems.append(f"it reshapes its projections into heads of {sorted(heads)}; the manifest says num_heads "
                        f"{spec.num_heads}, kv_heads {spec.kv_heads}")
    positions = facts["positions"]
    if positions is not None and spec.capacity > positions["rows"]:
        problems.append(f"capacity {spec.capacity} in the manifest, but its position table {positions['name']!r} covers "
                        f"{positions['rows']} positions; expected a capacity of at most {positions['rows']}")
    if problems:
        raise ContractError(f"{path.name}: the {spec.role} graph disagrees with the manifest: " + "; ".join(problems))


def _graph_facts(path: Path) -> dict:
    """What vetting needs of a graph, read once per file identity: parsing an 800 MB graph with its weights
    inline takes over a second."""
    from ..digests import remembered_fact

    try:
        return remembered_fact(path, FACTS, _facts)
    except FileRefused as exc:
        raise ContractError(str(exc)) from exc


def _facts(path: Path) -> dict:
    """external: each external-data location -> the first tensor naming it; engine_nodes: EPContext nodes; role: the
    role the exporter stamped; attention: heads of each GroupQueryAttention node; positions: the smallest position
    table (name, rows)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    external: dict[str, str] = {}
    extents: dict[str, int] = {}  # location -> the furthest byte a tensor reads (offset + length)
    sizes: list[str] = []  # tensors whose dims declare other than the data they hold
    for owner, tensor in _tensors(model):
        entries = {entry.key: entry.value for entry in tensor.external_data}
        location = entries.get("location")
        needed = _bytes_declared(tensor)
        if tensor.data_location == onnx.TensorProto.EXTERNAL or location is not None:
            external.setdefault(location or "", owner)
            length = entries.get("length")
            held = _int(length) if length is not None else needed or 0  # without a length, the dims say what is read
            extents[location or ""] = max(extents.get(location or "", 0), _int(entries.get("offset")) + held)
            if needed is not None and length is not None and held != needed:
                sizes.append(f"{owner} declares dims {list(tensor.dims)} ({needed:,} bytes); its external data is "
                             f"{held:,} bytes")
        elif needed is not None and (held := _held_differs(tensor, needed)) is not None:
            sizes.append(f"{owner} declares dims {list(tensor.dims)} ({needed:,} bytes); it holds {held}")
    nodes = list(_nodes(model))
    engine_nodes = [f"node {_node_name(node)}" for node in nodes if node.op_type == "EPContext"]
    role = next((entry.value for entry in model.metadata_props if entry.key == GRAPH_ROLE_KEY), None)
    domains = sorted({node.domain for node in nodes} | {entry.domain for entry in model.opset_import})
    return {"external": external, "extents": extents, "engine_nodes": engine_nodes, "role": role, "domains": domains,
            "functions": len(model.functions), "sizes": sizes[:1], **_shape_facts(model.graph)}


# TensorProto data types whose values are 4 bits: two to a byte
PACKED_4BIT = {"INT4", "UINT4", "FLOAT4E2M1"}
# where a tensor without raw_data keeps its values: the typed field of its data type (ONNX's rules), one value an entry
TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data")


def _bytes_declared(tensor) -> int | None:
    """The bytes a tensor's dims and data type say it holds; None for strings and types without a fixed size. A
    negative dim declares more than any file holds."""
    import onnx
    from onnx import helper

    elements = 1
    for dim in tensor.dims:
        elements *= dim if dim >= 0 else 2**63
    kind = onnx.TensorProto.DataType.Name(tensor.data_type) if tensor.data_type in onnx.TensorProto.DataType.values() \
        else None
    if kind is None or kind in ("UNDEFINED", "STRING"):
        return None
    if kind in PACKED_4BIT:
        return (elements + 1) // 2
    try:
        return elements * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return None


def _held_differs(tensor, needed: int) -> str | None:
    """What a tensor's inline data holds where that is not what its dims declare (``needed`` bytes): its raw_data's
    bytes, or the count of its typed values (one an element); None where they agree, or hold nothing to compare (a
    tensor of no elements)."""
    if tensor.HasField("raw_data"):
        return None if len(tensor.raw_data) == needed else f"{len(tensor.raw_data):,} bytes"
    elements = 1
    for dim in tensor.dims:
        elements *= dim
    for name in TYPED_FIELDS:
        values = len(getattr(tensor, name))
        if values and values != elements and tensor.data_type not in _packed_types():
            return f"{values:,} values"
    return None


def _packed_types() -> set[int]:
    import onnx

    return {getattr(onnx.TensorProto, name) for name in PACKED_4BIT if hasattr(onnx.TensorProto, name)}


def _int(text: str | None) -> int:
    """An external-data entry's offset or length (absent: 0; not a number: far beyond any file)."""
    try:
        return int(text) if text is not None else 0
    except ValueError:
        return 2**63


def _shape_facts(graph) -> dict:
    """Heads of the fused form's attention nodes, and the position tables of the main graph: a
    GroupQueryAttention's cos cache (input 7), or a 2-D initializer gathered by anything but the token ids or a
    mixture's chosen experts (a learned position embedding)."""
    from onnx import helper

    initializers = {tensor.name: list(tensor.dims) for tensor in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    attention, tables = [], []
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            attention.append({"num_heads": attributes.get("num_heads"), "kv_heads": attributes.get("kv_num_heads")})
            if len(node.input) > 7 and node.input[7] in initializers:
                tables.append((node.input[7], initializers[node.input[7]][0]))
        elif node.op_type == "Gather" and len(node.input) == 2 and node.input[1] != "input_ids":
            dims = initializers.get(node.input[0])
            if dims is not None and len(dims) == 2 and not _chosen_experts(node.input[1], producers):
                tables.append((node.input[0], dims[0]))
    name, rows = min(tables, key=lambda table: table[1], default=(None, None))
    return {"attention": attention, "positions": None if name is None else {"name": name, "rows": rows},
            "views": _head_views(graph)}


def _chosen_experts(index: str, producers: dict) -> bool:
    """Whether a Gather's index is a TopK's choice (a mixture's experts: their biases are gathered by it), reshaped."""
    node = producers.get(index)
    while node is not None and node.op_type in ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast"):
        node = producers.get(node.input[0])
    return node is not None and node.op_type == "TopK"


def _head_views(graph) -> list[tuple[int, int]]:
    """(heads, head_dim) of each Reshape into [batch, tokens, heads, head_dim] whose last two sizes are constants:
    how the explicit form splits its projections into heads (query heads, and key/value heads)."""
    from onnx import numpy_helper

    constants = {tensor.name: tensor for tensor in graph.initializer}
    producers = {}
    for node in graph.node:
        for output in node.output:
            producers[output] = node
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t

    def scalar(name):
        tensor = constants.get(name)
        if tensor is None or list(tensor.dims) not in ([], [1]):
            return None
        return int(numpy_helper.to_array(tensor).reshape(-1)[0])

    views = set()
    for node in graph.node:
        shape = producers.get(node.input[1]) if node.op_type == "Reshape" and len(node.input) > 1 else None
        if shape is not None and shape.op_type == "Concat" and len(shape.input) == 4:
            heads, size = scalar(shape.input[2]), scalar(shape.input[3])
            if heads is not None and size is not None and heads > 0 and size > 0:
                views.add((heads, size))
    return sorted(views)


def external_tensors(model) -> Iterator[object]:
    """Every TensorProto of ``model`` (a ModelProto) whose data lies in another file, wherever it sits."""
    import onnx

    for _, tensor in _tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL or any(e.key == "location" for e in tensor.external_data):
            yield tensor


def _tensors(message, where: str = "") -> Iterator[tuple[str, object]]:
    """(owner, TensorProto) for every tensor inside a protobuf message, at any depth."""
    import onnx

    for field, value in message.ListFields():
        if field.type != field.TYPE_MESSAGE:
            continue
        repeated = _is_repeated(field)
        for index, item in enumerate(value if repeated else [value]):
            if isinstance(item, onnx.TensorProto):
                name = SINGULAR.get(field.name, field.name)
                label = f"{name} {item.name!r}" if item.name else (f"{name}[{index}]" if repeated else "")
            else:
                label = _label(field.name, item, index if repeated else None)
            owner = " > ".join(part for part in (where, label) if part)
            if isinstance(item, onnx.TensorProto):
                yield owner or "a tensor", item
            else:
                yield from _tensors(item, owner)


def _nodes(message) -> Iterator[object]:
    """Every NodeProto inside a protobuf message, at any depth: graphs, subgraphs, functions."""
    import onnx

    for field, value in message.ListFields():
        if field.type != field.TYPE_MESSAGE:
            continue
        for item in value if _is_repeated(field) else [value]:
            if isinstance(item, onnx.TensorProto):
                continue
            if isinstance(item, onnx.NodeProto):
                yield item
            yield from _nodes(item)


def _label(field: str, item, index: int | None) -> str:
    import onnx

    field = SINGULAR.get(field, field)
    if isinstance(item, onnx.NodeProto):
        return f"{field} {_node_name(item)}"
    name = getattr(item, "name", "")
    if isinstance(name, str) and name:
        return f"{field} {name!r}"
    return field if index is None else f"{field}[{index}]"


def _node_name(node) -> str:
    return repr(node.name) if node.name else node.op_type


def _is_repeated(field) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf 6+; ``label`` before
    return repeated if repeated is not None else field.label == field.LABEL_REPEATED
