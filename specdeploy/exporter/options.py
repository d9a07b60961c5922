"""What an export writes: one validated options object, shared by ``specdeploy export`` and ``export_artifact``."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import DTYPES, GRAPH_FORMS, WEIGHT_FORMATS
from ..values import is_integer
from .errors import ExportError

BLOCK_SIZES = (16, 32, 64, 128, 256)  # MatMulNBits block sizes
# The providers an export can be written for: the form each runs whole and fast (``ExportOptions.provider``)
EXPORT_PROVIDERS = ("cpu", "openvino")
# OpenVINO's form reads the cache up to the filled length rounded up to this many slots: few shapes for it to prepare,
# at most 63 slots read past the filled ones (1, 64 and 256 cost alike a call on the 1.5B: docs/results/openvino/)
OPENVINO_FILLED_SLOTS = 64
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # MatMulNBits compute types (4: int8 activations)


@dataclass(frozen=True)
class ExportOptions:
    """How an artifact is exported, checked when made: ExportError names the option and says got versus expected.

    ``dtype``: the weights' and the caches' dtype. ``weights``: the target's weight format ("full", "int4", "int8");
    ``draft_weights`` the draft's (None: as ``weights``). ``capacity``: cache slots a request may use (None: the
    model's max_position_embeddings, at most 2048). ``graph``: "explicit" (standard ops, traced by torch.onnx) or
    "fused" (ONNX Runtime's fused LLM ops with the cache written in place, written straight from the weights; int4
    weights quantized as they are written). ``block_size`` and ``accuracy_level`` tune ONNX Runtime's MatMulNBits
    quantizer (int4 only). ``draft_vocab``: the draft scores only tokens 0 .. draft_vocab - 1 (fused graphs; byte-level
    BPE ids come in merge order, so the first ids are the most common ones): a smaller head, a faster draft step.
    ``isolate``: trace each model in a child process (None: for GGUF files and large checkpoints). ``force``: replace
    an existing artifact directory. ``provider``: the execution provider the graphs are written for: "cpu" (the forms
    above, which CUDA and TensorRT take too) or "openvino": the explicit form whose attention reads only the filled
    slots (``exporter.filled``) and whose head runs over the kept positions only (``num_logits``), which OpenVINO runs
    whole; it runs on the CPU provider too. ``draft_provider``: the draft's, where it differs (None: ``provider``):
    OpenVINO's form for the target beside a draft for the CPU provider, whose one-token calls are quicker there
    (docs/results/openvino/). ``graph`` is the form of the models written for the CPU provider; OpenVINO's is its own.
    """

    dtype: str = "float32"
    weights: str = "full"
    draft_weights: str | None = None
    capacity: int | None = None
    graph: str = "explicit"
    block_size: int = 32
    accuracy_level: int = 4
    draft_vocab: int | None = None
    isolate: bool | None = None
    force: bool = False
    provider: str = "cpu"
    draft_provider: str | None = None

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("weights", self.weights, WEIGHT_FORMATS)
        if self.draft_weights is not None:
            _one_of("draft_weights", self.draft_weights, WEIGHT_FORMATS, ", or None (as weights)")
        _one_of("graph", self.graph, GRAPH_FORMS)
        _one_of("block_size", self.block_size, BLOCK_SIZES)
        _one_of("accuracy_level", self.accuracy_level, ACCURACY_LEVELS)
        _one_of("provider", self.provider, EXPORT_PROVIDERS)
        if self.draft_provider is not None:
            _one_of("draft_provider", self.draft_provider, EXPORT_PROVIDERS, ", or None (as provider)")
        if self.graph != "explicit" and "cpu" not in (self.provider, self.provider_of("draft")):
            raise ExportError(f"graph: got {self.graph!r} with provider 'openvino'; expected 'explicit': OpenVINO runs the "
                              "fused form only in pieces (its EP takes no GroupQueryAttention that writes the cache in "
                              "place); leave --graph out, or write the draft for the CPU provider (--draft-provider cpu)")
        if self.capacity is not None and (not is_integer(self.capacity) or self.capacity < 2):
            raise ExportError(f"capacity: got {self.capacity!r}; expected an integer >= 2, or None (the model's "
                              "max_position_embeddings, at most 2048)")
        if self.draft_vocab is not None and (not is_integer(self.draft_vocab) or self.draft_vocab < 1):
            raise ExportError(f"draft_vocab: got {self.draft_vocab!r}; expected a positive integer, or None (the whole "
                              "vocabulary)")
        for name, value, expected in (("isolate", self.isolate, (True, False, None)), ("force", self.force, (True, False))):
            if not any(value is choice for choice in expected):
                raise ExportError(f"{name}: got {value!r}; expected {' or '.join(map(str, expected))}")

    def check_draft(self, draft) -> None:
        """Refuse a ``draft_vocab`` without a draft model to trim (``draft`` None), or with the explicit graph form:
        checked with the models given, the missing draft said first."""
        if self.draft_vocab is None:
            return
        if draft is None:
            raise ExportError(f"draft_vocab: got {self.draft_vocab} and no draft; expected a draft: there is no draft "
                              "model to trim (give a draft)")
        if self.form("draft").graph != "fused":
            raise ExportError(f"draft_vocab: got {self.draft_vocab} with the draft's graph "
                              f"{self.form('draft').graph!r}; expected graph 'fused': draft_vocab needs the fused graph "
                              "form")

    def weights_of(self, role: str) -> str:
        """The weight format of ``role`` ("target" or "draft")."""
        return self.weights if role == "target" else (self.draft_weights or self.weights)

    def provider_of(self, role: str) -> str:
        """The execution provider ``role``'s graph is written for."""
        return self.provider if role == "target" else (self.draft_provider or self.provider)

    def form(self, role: str) -> Form:
        """How ``role``'s graph is written: for OpenVINO its own form (explicit, reading the filled slots alone), for
        the CPU provider ``graph``. A fused graph is written in its dtype (float16 from the start: no fp32 copy of the
        model, and no converter's casts), but for int8, whose rewrite reads fp32 graphs."""
        openvino = self.provider_of(role) == "openvino"
        graph = "explicit" if openvino else self.graph
        fmt, fused = self.weights_of(role), graph == "fused"
        return Form(graph=graph, int4=(self.block_size, self.accuracy_level) if fused and fmt == "int4" else None,
                    vocab_kept=self.draft_vocab if role == "draft" else None,
                    dtype=self.dtype if fused and fmt != "int8" else "float32",
                    int8=fused and fmt == "int8",
                    filled_slots=OPENVINO_FILLED_SLOTS if openvino else 0)


@dataclass(frozen=True)
class Form:
    """Which graph a model is written as: "explicit" or "fused", and for a fused int4 graph the quantizer's
    (block_size, accuracy_level), applied as the weights are written; ``int8``: a fused int8 graph, whose experts are
    written as int8 (its MatMuls are rewritten after)."""

    graph: str = "explicit"
    int4: tuple[int, int] | None = None
    vocab_kept: int | None = None  # a draft's head cut to the first tokens (``draft_vocab``)
    dtype: str = "float32"  # what a fused graph is written in (an explicit graph is traced in float32)
    int8: bool = False
    # an explicit graph whose attention reads its filled slots alone, rounded up to this many (``exporter.filled``),
    # and whose head runs over the kept positions only: OpenVINO's form; 0: every slot, every position
    filled_slots: int = 0


def _one_of(name: str, value, choices: tuple, also: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, type(choices[0])) or value not in choices:
        raise ExportError(f"{name}: got {value!r}; expected one of {', '.join(map(str, choices))}{also}")
