"""A recording stand-in for an ONNX Runtime session: it checks how an engine calls the session, never what it computes.

``RecordingSession`` wraps a real (CPU) InferenceSession: every IOBinding it hands out records what is bound where
(name -> device, address, shape) and how often, every run records its binding and CUDA graph id (the ``gpu_graph_id``
run option), and then the real session runs, so every result comes from ONNX Runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class RecordingBinding:
    def __init__(self, binding):
        self.binding = binding
        self.bound: dict[str, tuple] = {}  # name -> (device, address, shape)
        self.binds = 0
        self.copied: list[str] = []  # names bound by copy from a host array (``bind_cpu_input``)

    def bind_input(self, name, device, device_id, dtype, shape, address):
        self.bound[name], self.binds = (device, address, tuple(shape)), self.binds + 1
        self.binding.bind_input(name, device, device_id, dtype, shape, address)

    def bind_output(self, name, device="cpu", device_id=0, dtype=None, shape=None, address=None):
        self.bound[name], self.binds = (device, address, tuple(shape or ())), self.binds + 1
        self.binding.bind_output(name, device, device_id, dtype, shape, address)

    def bind_cpu_input(self, name, array):
        self.copied.append(name)
        self.bound[name], self.binds = ("cpu-copy", array.ctypes.data, array.shape), self.binds + 1
        self.binding.bind_cpu_input(name, array)

    def __getattr__(self, name):
        return getattr(self.binding, name)


@dataclass
class Run:
    binding: RecordingBinding
    graph_id: int | None  # None: no run options at all
    bound: dict = field(default_factory=dict)  # what was bound at the time of the run
    binds: int = 0  # the binding's binds so far


class RecordingSession:
    def __init__(self, session, refuse_capture: str | None = None):
        """``refuse_capture``: raise this message (as ONNX Runtime's CUDA EP would) on the first run under a graph id."""
        self.session, self.refuse_capture = session, refuse_capture
        self.bindings: list[RecordingBinding] = []
        self.runs: list[Run] = []

    def io_binding(self):
        binding = RecordingBinding(self.session.io_binding())
        self.bindings.append(binding)
        return binding

    def run_with_iobinding(self, binding, run_options=None):
        graph_id = None if run_options is None else int(run_options.get_run_config_entry("gpu_graph_id"))
        self.runs.append(Run(binding, graph_id, dict(binding.bound), binding.binds))
        if self.refuse_capture and graph_id is not None and graph_id >= 0:
            message, self.refuse_capture = self.refuse_capture, None
            raise RuntimeError(message)
        self.session.run_with_iobinding(binding.binding, run_options)

    def __getattr__(self, name):
        return getattr(self.session, name)


def record(engine, graphs: bool = False, limit: int | None = None, refuse_capture: str | None = None) -> RecordingSession:
    """Put a recording session under ``engine`` (before its first call); ``graphs``: hand out CUDA graph ids as a CUDA
    engine would (the CPU session ignores them)."""
    from specdeploy.engines.graphs import GRAPH_LIMIT, GraphIds

    engine.session = RecordingSession(engine.session, refuse_capture)
    engine.graphs = GraphIds(engine.spec.file, limit or GRAPH_LIMIT) if graphs else None
    return engine.session
