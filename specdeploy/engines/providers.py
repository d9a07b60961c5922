"""Execution providers: which ONNX Runtime EP runs a graph, with which options, and the refusals that come first.

A provider is named by a word (``cpu``, ``cuda``, ``tensorrt``, ``openvino``) or given as a ``Provider`` with its
options: OpenVINO's device (CPU, GPU, NPU) and precision. Its word, device and precision are also what the cost table
is remembered under (``runtime/calibration.py``): what a K + 1-token call costs against one token is the provider's
kernels' property.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
}
OPENVINO_DEVICES = ("CPU", "GPU", "NPU")
# OpenVINO's inference precision: FP32 computes what the graph says (a CPU with bf16 units otherwise runs bf16);
# BF16 and FP16 trade accuracy for speed where the device has the units; ACCURACY keeps each node's own type
OPENVINO_PRECISIONS = ("FP32", "BF16", "FP16", "ACCURACY")
OPENVINO_DEFAULT_PRECISION = "FP32"
GPU_INSTALL = ("CUDA and TensorRT need onnxruntime-gpu in place of onnxruntime (the two overwrite each other's files): "
               "pip uninstall -y onnxruntime && pip install onnxruntime-gpu 'specdeploy[gpu]'")
OPENVINO_INSTALL = ("OpenVINO needs onnxruntime-openvino in place of onnxruntime (the two overwrite each other's "
                    "files): pip uninstall -y onnxruntime && pip install 'onnxruntime-openvino==1.24.1'")
REEXPORT_FOR_OPENVINO = "specdeploy export --provider openvino"
# under $SPECDEPLOY_CACHE: OpenVINO's compiled blobs for a GPU or an NPU, whose compiles are what a second process
# would wait for. Not for its CPU: there a blob holds the weights again (1.7 GB for the demo's 1.5B target) and loading
# it took longer than compiling from the graph, which maps the weights (docs/results/openvino/)
COMPILED_FOLDER = "openvino"


class ProviderError(RuntimeError):
    """A requested execution provider is missing, cannot run a graph whole, or silently fell back to another.
    ``problem`` and ``fix`` apart (``specdeploy doctor`` prints them so); the message is both."""

    def __init__(self, problem: str, fix: str | None = None):
        super().__init__(problem if fix is None else f"{problem}; {fix}")
        self.problem, self.fix = problem, fix


@dataclass(frozen=True)
class Provider:
    """An execution provider and its options. ``name``: one of PROVIDERS. ``device`` and ``precision``: OpenVINO's
    (None: CPU, FP32); another provider takes neither."""

    name: str = "cpu"
    device: str | None = None
    precision: str | None = None

    def __post_init__(self) -> None:
        if self.name not in PROVIDERS:
            raise ProviderError(f"provider {self.name!r} is unknown; expected one of {', '.join(PROVIDERS)}")
        for option, value, choices in (("device", self.device, OPENVINO_DEVICES),
                                       ("precision", self.precision, OPENVINO_PRECISIONS)):
            if value is None:
                continue
            if self.name != "openvino":
                raise ProviderError(f"provider {self.name!r}: {option} {value!r} is an option of provider 'openvino' "
                                    f"only; expected no {option}")
            if value not in choices:
                raise ProviderError(f"provider 'openvino': {option} {value!r} is unknown; expected one of "
                                    f"{', '.join(choices)}")

    @classmethod
    def of(cls, value: str | Provider) -> Provider:
        """``value`` as a Provider: a word (``"openvino"``) with its defaults, or a Provider as it is."""
        if isinstance(value, Provider):
            return value
        if not isinstance(value, str):
            raise ProviderError(f"provider: got {type(value).__name__} {value!r}; expected one of "
                                f"{', '.join(PROVIDERS)}, or a Provider")
        return cls(value)

    @property
    def ep(self) -> str:
        """ONNX Runtime's name of the EP."""
        return PROVIDERS[self.name]

    @property
    def on_host(self) -> bool:
        """Whether the session reads its inputs from host memory: the CPU's and OpenVINO's (whatever its device, the
        EP takes host buffers and moves them itself) do; CUDA's and TensorRT's read device memory."""
        return self.name in ("cpu", "openvino")

    @property
    def prepares_shapes(self) -> bool:
        """Whether the provider prepares each new input shape before running it (OpenVINO: its first call seconds,
        a new shape tens of milliseconds): the engine then keeps its shapes few and pays the first call at load."""
        return self.name == "openvino"

    @property
    def computes_rows_alike(self) -> bool:
        """Whether the provider's kernels compute a position alike in calls of any size (``Engine.rows_alike``):
        OpenVINO on its CPU at FP32, as measured; not at BF16 (a one-token call moved the 1.5B's logits by 0.25 from
        a verification's), nor on devices not measured."""
        return self.name == "openvino" and (self.device or "CPU") == "CPU" and self.precision in (None, "FP32")

    @property
    def caches_compiled(self) -> bool:
        """Whether compiled blobs are kept for the next process (``COMPILED_FOLDER``): OpenVINO on a GPU or an NPU."""
        return self.name == "openvino" and self.device in ("GPU", "NPU")

    @property
    def key(self) -> str:
        """What the provider and its options are called in a remembered cost table: ``cpu``, ``openvino/CPU/FP32``."""
        if self.name != "openvino":
            return self.name
        return f"openvino/{self.device or 'CPU'}/{self.precision or OPENVINO_DEFAULT_PRECISION}"

    def __str__(self) -> str:
        return self.key

    def ep_options(self, threads: int | None, compiled: Path | None) -> dict[str, str]:
        """The EP's own options (OpenVINO's: device, precision, threads, where compiled blobs are cached); {} for the
        others, whose device options the engine's memory gives."""
        if self.name != "openvino":
            return {}
        device, precision = self.device or "CPU", self.precision or OPENVINO_DEFAULT_PRECISION
        options = {"device_type": device}
        if precision == "BF16":  # not one of the EP's own precision words: asked of the device's plugin itself
            options["load_config"] = json.dumps({device: {"INFERENCE_PRECISION_HINT": "bf16"}})
        else:
            options["precision"] = precision
        if threads is not None:
            options["num_of_threads"] = str(threads)
        if compiled is not None:
            options["cache_dir"] = str(compiled)
        return options


def check_available(provider: Provider) -> None:
    """ProviderError, saying how to install it, where this onnxruntime build lacks ``provider``'s EP."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if provider.ep not in available:
        install = OPENVINO_INSTALL if provider.name == "openvino" else GPU_INSTALL
        raise ProviderError(f"provider {provider.name!r} ({provider.ep}) is not available in this onnxruntime build "
                            f"({ort.__version__}); available: {available}", install)


def check_graph(path: Path, spec, provider: Provider) -> None:
    """Refuse, before any session is made, a graph that cannot run on ``provider``: a fused float32 graph on CUDA,
    where ONNX Runtime's GroupQueryAttention kernel takes float16 or bfloat16 only (it would run on the CPU EP,
    with every layer's activations copied across); a fused graph on OpenVINO, whose EP takes no GroupQueryAttention
    that writes its cache in place (each layer's attention would run on the CPU EP, the graph in pieces)."""
    if provider.name == "cuda" and spec.graph == "fused" and spec.dtype == "float32":
        raise ProviderError(
            f"{path}: the {spec.role} model is a fused graph in float32; on CUDA, ONNX Runtime's GroupQueryAttention "
            "takes float16 or bfloat16 only (got float32, expected float16)",
            "re-export it with --dtype float16 --graph fused, or run it on the CPU")
    if provider.name == "openvino" and spec.graph == "fused":
        raise ProviderError(
            f"{path}: the {spec.role} model is a fused graph, which OpenVINO runs only in pieces (its EP takes no "
            "GroupQueryAttention that writes the cache in place: each layer's attention would run on the CPU provider)",
            _reexport(spec))


def assignment(session) -> dict[str, dict[str, int]]:
    """Where ONNX Runtime placed a session's nodes: EP -> {operator type: nodes}. Needs the session made with
    ``session.record_ep_graph_assignment_info`` (``record_placement``)."""
    placed: dict[str, dict[str, int]] = {}
    for subgraph in session.get_provider_graph_assignment_info():
        ops = placed.setdefault(subgraph.ep_name, {})
        for node in subgraph.get_nodes():
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return placed


def record_placement(options) -> None:
    """Ask ONNX Runtime to record where it places each node of sessions made with ``options`` (SessionOptions)."""
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")


def check_whole(session, path: Path, spec, provider: Provider) -> None:
    """Refuse a session in which ONNX Runtime placed nodes of the graph on another EP than ``provider``'s (OpenVINO
    takes a graph op by op; what it does not take runs on the CPU EP, each crossing a copy): the nodes named by
    operator type. Needs the session made with ``record_placement``."""
    elsewhere: dict[str, int] = {}
    for ep, ops in assignment(session).items():
        if ep != provider.ep:
            for op, count in ops.items():
                elsewhere[op] = elsewhere.get(op, 0) + count
    if elsewhere:
        ops = ", ".join(f"{op} x{count}" for op, count in sorted(elsewhere.items(), key=lambda item: -item[1]))
        raise ProviderError(
            f"{path}: the {spec.role} model's graph would run only in pieces on {provider.name}: ONNX Runtime places "
            f"{sum(elsewhere.values())} of its nodes on another provider ({ops})", _reexport(spec))


def _reexport(spec) -> str:
    """What to do about a graph a provider would run in pieces: export the checkpoint for it, or run it on the CPU
    (a draft alone: ``--draft-provider cpu``, its target staying where it is)."""
    on_cpu = "run the draft with --draft-provider cpu" if spec.role == "draft" else "run it with --provider cpu"
    if spec.imported is not None:
        return ("an imported graph is run as it was written: export its checkpoint with "
                f"`{REEXPORT_FOR_OPENVINO}`, or {on_cpu}")
    return f"re-export it with `{REEXPORT_FOR_OPENVINO}`, or {on_cpu}"
