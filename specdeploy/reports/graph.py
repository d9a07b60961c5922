"""What a graph is made of: nodes, nodes per layer and op counts (``specdeploy inspect``).

On a CPU or GPU a decode step of a small model costs a few microseconds per node before any memory
traffic, so the node count says how dispatch-bound a graph is (issue #13: 1,834 nodes ran as 1,725
kernels per call on an H200, against ~12 per layer in ONNX Runtime's fused form).
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from pathlib import Path

# an initializer of layer N: "layers.N.qkv", "layers.3.ln1", "model.layers.12.mlp...", "layers_4_..."
SUMMARY_VERSION = 1  # remembered summaries are keyed by it: raise it whenever _summarize changes
LAYER = re.compile(r"(?:^|[./_])layers[._](\d+)(?=[._/]|$)")


def graph_summary(path: Path) -> dict:
    """Nodes, nodes per layer (median) and op counts of the graph at ``path``, as stored (ONNX Runtime
    fuses some at load). Read once per file identity: an 800 MB graph with inline weights parses in ~1 s."""
    from ..digests import remembered_fact

    return remembered_fact(Path(path), f"graph_summary.{SUMMARY_VERSION}", _summarize)


def _summarize(path: Path) -> dict:
    """A layer's nodes run from the first node that reads one of its weights up to the next layer's first
    such node (the graph is stored in topological order and the layers run one after another). The first
    layer's span also holds what the exporter computes once for all layers (masks, rotary tables) and the
    last one's the head, so the median of the spans between is reported (of the first, with 2 layers)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    owner = {}
    for tensor in graph.initializer:
        found = LAYER.search(tensor.name)
        if found:
            owner[tensor.name] = int(found.group(1))
    starts: dict[int, int] = {}
    for index, node in enumerate(graph.node):
        for name in node.input:
            if name in owner:
                starts.setdefault(owner[name], index)
    bounds = [starts[layer] for layer in sorted(starts)]
    spans = [b - a for a, b in zip(bounds, bounds[1:])]
    spans = spans[1:] or spans
    return {
        "nodes": len(graph.node),
        "layers_found": len(starts),
        "nodes_per_layer": statistics.median(spans) if spans else None,
        "ops": dict(Counter(node.op_type for node in graph.node).most_common()),
    }
