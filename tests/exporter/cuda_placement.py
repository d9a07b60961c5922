"""Where ONNX Runtime's CUDA EP would run each node of a graph, worked out from the graph alone (no GPU).

Two rules of ONNX Runtime decide it:

- a node runs on the CUDA EP only if a CUDA kernel is registered for its (domain, op) and input types: ``KERNELS``
  below, as docs/OperatorKernels.md of microsoft/onnxruntime lists the CUDA EP's registrations (that file is
  generated from the registered kernels; rows checked against the 1.31 tree, the onnxruntime-gpu the GPU check runs);
- of the nodes it can run, ``GetCpuPreferredNodes`` (onnxruntime/core/framework/fallback_cpu_capability.cc) moves to
  the CPU EP the small non-float computations around host tensors: forward from the consumers of outputs a CUDA kernel
  writes on the host (Shape's), backward from the producers of inputs a CUDA kernel reads on the host (Slice's starts,
  GroupQueryAttention's total_sequence_length); ``cpu_preferred`` reimplements it.

A value that a CPU node computes and a CUDA node reads as a device input needs a host-to-device copy inside the graph
(a MemcpyFromHost node), and ONNX Runtime then refuses to capture the session as a CUDA graph ("all compute graph
nodes have not been partitioned to the CUDA EP": inference_session.cc allows CPU nodes only where no copy node
exists). ``placement`` reports both kinds of trouble.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

MS = "com.microsoft"
FLOATS = {"float", "float16", "bfloat16", "double"}
INTS = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
ANY = FLOATS | INTS | {"bool"}
INDEX = {"int32", "int64"}
NUMBERS = {"double", "float", "float16", "int32", "int64", "uint32", "uint64"}  # comparisons, CumSum
# (domain, op) -> {input index: element types a CUDA kernel takes there} (None: any); docs/OperatorKernels.md,
# "Operators implemented by CUDAExecutionProvider", at opset 18 (the exporter's)
KERNELS = {
    ("", "Add"): {0: FLOATS | {"int32", "int64", "uint32", "uint64"}, 1: FLOATS | {"int32", "int64", "uint32", "uint64"}},
    ("", "ArgMax"): {0: {"double", "float", "float16"}},
    ("", "Cast"): {0: ANY},
    ("", "Clip"): {i: {"double", "float", "float16", "int64", "int8", "uint64", "uint8"} for i in range(3)},
    ("", "Concat"): {i: ANY for i in range(8)},
    ("", "CumSum"): {0: NUMBERS, 1: INDEX},
    ("", "Exp"): {0: FLOATS},
    ("", "Expand"): {0: ANY, 1: {"int64"}},
    ("", "Gather"): {0: ANY, 1: INDEX},
    ("", "Greater"): {0: NUMBERS, 1: NUMBERS},
    ("", "GreaterOrEqual"): {0: NUMBERS, 1: NUMBERS},
    ("", "Less"): {0: NUMBERS, 1: NUMBERS},
    ("", "MatMul"): {0: {"bfloat16", "double", "float", "float16"}, 1: {"bfloat16", "double", "float", "float16"}},
    ("", "Max"): {0: NUMBERS | {"bfloat16"}, 1: NUMBERS | {"bfloat16"}},
    ("", "Min"): {0: NUMBERS | {"bfloat16"}, 1: NUMBERS | {"bfloat16"}},
    ("", "Mod"): {0: NUMBERS | {"bfloat16"}, 1: NUMBERS | {"bfloat16"}},
    ("", "Mul"): {0: FLOATS | {"int32", "int64", "uint32", "uint64"}, 1: FLOATS | {"int32", "int64", "uint32", "uint64"}},
    ("", "Neg"): {0: {"double", "float", "float16", "int16", "int32", "int64", "int8"}},
    ("", "Pad"): {0: {"bool", "double", "float", "float16"}, 1: {"int64"}, 2: {"bool", "double", "float", "float16"}},
    ("", "Range"): {i: {"double", "float", "int16", "int32", "int64"} for i in range(3)},
    ("", "Reshape"): {0: ANY, 1: {"int64"}},
    ("", "ScatterND"): {0: ANY, 1: {"int64"}, 2: ANY},
    ("", "Shape"): {0: ANY},
    ("", "Sigmoid"): {0: FLOATS},
    ("", "SimplifiedLayerNormalization"): {0: {"double", "float", "float16"}, 1: {"double", "float", "float16"}},
    ("", "Slice"): {0: ANY, 1: INDEX, 2: INDEX, 3: INDEX, 4: INDEX},
    ("", "Softplus"): {0: {"double", "float", "float16"}},
    ("", "Split"): {0: ANY, 1: {"int64"}},
    ("", "Squeeze"): {0: ANY, 1: {"int64"}},
    ("", "Sub"): {0: FLOATS | {"int32", "int64", "uint32", "uint64"}, 1: FLOATS | {"int32", "int64", "uint32", "uint64"}},
    ("", "Transpose"): {0: ANY},
    ("", "Unsqueeze"): {0: ANY, 1: {"int64"}},
    ("", "Where"): {0: {"bool"}, 1: {"bfloat16", "double", "float", "float16", "int32", "int64", "uint8"},
                    2: {"bfloat16", "double", "float", "float16", "int32", "int64", "uint8"}},
    ("", "ReduceMax"): {0: {"double", "float", "float16", "int32", "int64", "int8", "uint8"}, 1: {"int64"}},
    (MS, "GroupQueryAttention"): {0: {"bfloat16", "float16"}, 3: {"bfloat16", "float16", "int8"},
                                  4: {"bfloat16", "float16", "int8"}, 5: {"int32"}, 6: {"int32"},
                                  7: {"bfloat16", "float16"}, 8: {"bfloat16", "float16"}},
    (MS, "MatMulNBits"): {0: {"bfloat16", "float", "float16"}, 1: {"uint8"}, 2: {"bfloat16", "float", "float16"}},
    (MS, "SkipSimplifiedLayerNormalization"): {i: {"bfloat16", "float", "float16"} for i in range(4)},
}
# inputs a CUDA kernel reads in host memory (its KernelDefBuilder's InputMemoryType(OrtMemTypeCPUInput, i)) and outputs
# it writes there (OutputMemoryType(OrtMemTypeCPUOutput, i)): onnxruntime/core/providers/cuda/tensor/{slice,pad,split,
# squeeze,unsqueeze,reshape,expand,shape_op}.cc, generator/range.cc, math/{clip,cumsum}.cc, reduction_ops.cc,
# contrib_ops/cuda/bert/group_query_attention.cc
HOST_INPUTS = {("", "Slice"): {1, 2, 3, 4}, ("", "Pad"): {1, 2, 3}, ("", "Split"): {1}, ("", "Squeeze"): {1},
               ("", "Unsqueeze"): {1}, ("", "Reshape"): {1}, ("", "Expand"): {1}, ("", "Range"): {0, 1, 2},
               ("", "Clip"): {1, 2}, ("", "CumSum"): {1}, ("", "ReduceMax"): {1}, (MS, "GroupQueryAttention"): {6}}
HOST_OUTPUTS = {("", "Shape"): {0}}
SMALL_INITIALIZER = 100  # elements: fallback_cpu_capability.cc's kSmallInitializerThreshold


def placement(model: onnx.ModelProto) -> dict:
    """{"no_kernel": nodes without a CUDA kernel for their input types, "cpu": nodes ONNX Runtime would move to the CPU
    EP, "copies": (value, the CUDA node that reads it) pairs needing a host-to-device copy, "host_inputs": graph inputs
    read on the host only}; node names as "op:name"."""
    graph = model.graph
    types = _element_types(graph)
    nodes = list(graph.node)
    no_kernel = [f"{n.op_type}:{n.name}" for n in nodes if not _has_kernel(n, types)]
    cpu = cpu_preferred(graph, types)
    produced_on_host = {out for n in nodes if n.name in cpu for out in n.output}
    produced_on_host |= {n.output[i] for n in nodes if n.name not in cpu for i in HOST_OUTPUTS.get(_key(n), ())}
    copies = []
    for n in nodes:
        if n.name in cpu:
            continue
        host = HOST_INPUTS.get(_key(n), set())
        copies += [(value, f"{n.op_type}:{n.name}") for i, value in enumerate(n.input)
                   if value in produced_on_host and i not in host]
    consumers = {}
    for n in nodes:
        for i, value in enumerate(n.input):
            consumers.setdefault(value, []).append(n.name in cpu or i in HOST_INPUTS.get(_key(n), set()))
    host_inputs = [i.name for i in graph.input if consumers.get(i.name) and all(consumers[i.name])]
    return {"no_kernel": no_kernel, "cpu": sorted(f"{n.op_type}:{n.name}" for n in nodes if n.name in cpu),
            "copies": copies, "host_inputs": host_inputs}


def cpu_preferred(graph, types: dict[str, str]) -> set[str]:
    """Names of the nodes ``GetCpuPreferredNodes`` would place on the CPU EP (its forward and backward traces, in
    topological order; every node of these graphs has a CPU kernel)."""
    nodes = list(graph.node)
    order = {n.name: i for i, n in enumerate(nodes)}
    producer = {out: n for n in nodes for out in n.output}
    consumers: dict[str, list] = {}
    for n in nodes:
        for value in n.input:
            consumers.setdefault(value, []).append(n)
    graph_inputs = {i.name for i in graph.input}
    small = {t.name for t in graph.initializer if _elements(t) <= SMALL_INITIALIZER}
    cpu_args, forward, backward = set(), [], []
    for n in nodes:
        for i in HOST_OUTPUTS.get(_key(n), ()):
            cpu_args.add(n.output[i])
            forward += consumers.get(n.output[i], [])
        for i in HOST_INPUTS.get(_key(n), ()):
            if i < len(n.input) and n.input[i]:
                cpu_args.add(n.input[i])
                if n.input[i] in producer:
                    backward.append(producer[n.input[i]])
    cpu, seen = set(), set()
    while forward:
        forward.sort(key=lambda n: order[n.name])
        node = forward.pop(0)
        if node.name in seen:
            continue
        seen.add(node.name)
        place = True
        for i, value in enumerate(node.input):
            if types.get(value) in ("float16", "bfloat16"):
                place = False
                break
            if not value or value in small or value in graph_inputs:
                continue
            if value not in cpu_args or i in HOST_INPUTS.get(_key(node), ()):
                place = False
                break
        if place:
            cpu.add(node.name)
            cpu_args.update(node.output)
            forward += [c for out in node.output for c in consumers.get(out, [])]
    seen = set()
    while backward:
        backward.sort(key=lambda n: -order[n.name])
        node = backward.pop(0)
        if node.name in seen or node.name in cpu:
            continue
        seen.add(node.name)
        outputs_on_host = all(out in cpu_args and types.get(out) not in ("float16", "bfloat16")
                              and i not in HOST_OUTPUTS.get(_key(node), ()) for i, out in enumerate(node.output))
        if outputs_on_host and not any(types.get(v) in ("float16", "bfloat16") for v in node.input):
            cpu.add(node.name)
            cpu_args.update(v for v in node.input if v)
            backward += [producer[v] for v in node.input if v in producer]
    return cpu


def _key(node) -> tuple[str, str]:
    return (node.domain or "", node.op_type)


def _has_kernel(node, types: dict[str, str]) -> bool:
    allowed = KERNELS.get(_key(node))
    if allowed is None:
        return False
    return all(not value or i not in allowed or types.get(value) in allowed[i] for i, value in enumerate(node.input))


def _elements(tensor) -> int:
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count


def _element_types(graph) -> dict[str, str]:
    """value name -> element type name, from the graph's inputs and initializers through each node (outputs take the
    first input's type but for the ops that say otherwise: Cast, Shape and ArgMax, comparisons' bool, Where's values):
    ONNX's own inference does not know the contrib ops."""
    def name(elem: int) -> str:
        return helper.tensor_dtype_to_np_dtype(elem).name if elem != TensorProto.BFLOAT16 else "bfloat16"

    types = {i.name: name(i.type.tensor_type.elem_type) for i in graph.input}
    types |= {t.name: name(t.data_type) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Cast":
            out = name(next(a.i for a in node.attribute if a.name == "to"))
            types[node.output[0]] = out
        elif node.op_type in ("Shape", "ArgMax"):
            types[node.output[0]] = "int64"
        elif node.op_type in ("Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Equal", "Not", "And", "Or"):
            types[node.output[0]] = "bool"
        elif node.op_type == "Where":
            types[node.output[0]] = types.get(node.input[1])
        else:
            first = types.get(node.input[0])
            for out in node.output:
                if out:
                    types[out] = first
    return {k: ("float" if v == "float32" else v) for k, v in types.items()}
