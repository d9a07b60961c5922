"""CUDA graphs for ONNX Runtime sessions: one graph id per call shape and set of bound addresses.

ONNX Runtime's CUDA EP (``enable_cuda_graph``) captures a run into a CUDA graph under the ``gpu_graph_id`` run option
and later replays it for the same id without looking at the binding at all: a replay reads and writes the addresses
that were bound when it was captured. So an id stands for one (batch, tokens, kept) shape with its input and output
buffers, which the engine never reallocates while the shape is in use, and one cache's addresses. The first run
under a new id is its warm-up: ONNX Runtime runs it plainly, then captures it (the same call, run again, writes the
same K/V into the same slots), and every later call replays it. Id -1 runs plainly (prefill chunks, and any shape
past ``GRAPH_LIMIT``).

ONNX Runtime refuses a session capture when a compute node falls to the CPU EP (a host-to-device copy inside the
graph); the engine then runs without graphs and says so once (``open_session``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from ..values import short

PLAIN = -1  # ONNX Runtime's gpu_graph_id for "run without capturing or replaying"
GRAPH_LIMIT = 256  # captured graphs per engine: each keeps its own launch parameters (host memory) for the session's life


class GraphIds:
    """Hands out graph ids (1, 2, ...) up to ``limit``; past it, ``PLAIN``, said once."""

    def __init__(self, where: str, limit: int = GRAPH_LIMIT):
        self.where, self.limit, self.issued, self.refused = where, limit, 0, False

    def new(self) -> int:
        """A fresh graph id, or PLAIN once ``limit`` graphs are captured or a capture has failed."""
        if self.refused:
            return PLAIN
        if self.issued >= self.limit:
            if self.issued == self.limit:
                warnings.warn(f"{self.where}: {self.limit} CUDA graphs captured; calls of further shapes and caches "
                              "run without CUDA graphs", stacklevel=4)
                self.issued += 1
            return PLAIN
        self.issued += 1
        return self.issued

    def refuse(self, exc: Exception) -> None:
        """A capture failed while running: no further ids (the session's calls run plainly from now on), said once."""
        if not self.refused:
            warnings.warn(f"{self.where}: ONNX Runtime could not capture a CUDA graph ({type(exc).__name__}: "
                          f"{short(str(exc).strip(), 300, quoted=False)}); running without CUDA graphs", stacklevel=4)
        self.refused = True


def run_options(graph_id: int):
    """ONNX Runtime RunOptions that run (capture, replay) graph ``graph_id``."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options


def open_session(create: Callable[[bool], object], graphs: bool, where: str):
    """(session, whether it captures CUDA graphs): ``create(graphs)``, and where that fails (ONNX Runtime refuses to
    capture a graph with a node on the CPU EP or a control-flow node, or the EP takes no CUDA graphs with the options
    given), ``create(False)`` after one warning; an error of the session itself then comes from that second try."""
    if not graphs:
        return create(False), False
    try:
        return create(True), True
    except Exception as exc:
        session = create(False)
        warnings.warn(f"{where}: ONNX Runtime refuses CUDA graphs for this graph ({short(str(exc).strip(), 300, quoted=False)}); "
                      "running without them", stacklevel=3)
        return session, False
