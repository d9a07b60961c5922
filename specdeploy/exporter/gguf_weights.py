"""A GGUF file's tensors under their Hugging Face names, dequantized one tensor at a time as they are asked for.

transformers' ``from_pretrained(gguf_file=...)`` dequantizes the whole model to fp32 before anything else
can run: 7.1 GB for the 1.5B, held while the graph is written. Here each tensor is dequantized when the
exporter takes it (gguf-py's ``dequantize`` and name table, as transformers uses them, and transformers'
own tensor processors, e.g. Llama's q/k un-permutation), so the values are the same bits, and it is
released when the exporter is done with it: the fused form then holds one layer at a time. Where the converter stored
a tensor in parts or another shape than the processors undo (Granite 4.0-H's Mamba-2 and shared MLP), gguf_layouts.py
says which tensors make it and how.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache
from math import prod

import numpy as np
import torch

from .errors import ExportError
from .gguf_config import GGUF_FAMILIES
from .gguf_layouts import GGUF_LAYOUTS, ONE_TO_ONE
from .lazy_weights import LazyWeights

ROWS_PER_CHUNK = 4096  # dequantize large tensors in slices: gguf-py's temporaries are several times the output
THREADS = min(4, os.cpu_count() or 1)  # slices dequantized at once: each holds ~100 MB of temporaries
# a mixture's router, experts and shared expert, as llama.cpp's converter names them for every architecture
EXPERT_TENSORS = re.compile(r"blk\.(\d+)\.(ffn_gate_inp(?:_shexp)?|ffn_(?:gate|up|down|gate_up)_(?:exps|shexp))\."
                            r"(weight|bias)$")


@cache
def reader_class():
    """gguf-py's ``GGUFReader`` over a plain ndarray view of its memory map. Parsing slices the map once per
    metadata value (450k slices for a 150k-token vocabulary), and ``np.memmap``'s bookkeeping on each slice
    is most of the time: 2.6 s instead of 9 s for Qwen2.5's metadata, the same fields and tensor views."""
    import gguf

    class PlainReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray)  # still backed by the map: nothing is read into memory

    return PlainReader


@contextmanager
def fast_gguf_parsing():
    """transformers parses a GGUF file's metadata with ``gguf.GGUFReader`` for its config and again for its
    tokenizer; within this block it gets ``reader_class()``'s (transformers imports the name at each call)."""
    import gguf

    original = gguf.GGUFReader
    gguf.GGUFReader = reader_class()
    try:
        yield
    finally:
        gguf.GGUFReader = original


class GgufWeights(LazyWeights):
    """``name -> fp32 torch.Tensor`` over a GGUF file, each dequantized when taken (``LazyWeights``)."""

    kind = "GGUF"

    def __init__(self, path, config, reader=None):
        """``reader``: the file's metadata already parsed (``reader_class()``'s), else parsed here."""
        import gguf
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        super().__init__()
        self._dequantize = gguf.dequantize
        self.reader = reader if reader is not None else reader_class()(str(path))
        architecture = bytes(self.reader.fields["general.architecture"].parts[-1]).decode()
        # the processors read the config's Hugging Face keys (Llama's q/k un-permutation: the head counts); the
        # config's own dict has them, without parsing the file's metadata again (~10 s for a 150k vocabulary). An
        # architecture we read ourselves names the processor its converter's tensors need (granite: Llama's)
        own = GGUF_FAMILIES.get(architecture)
        processor = own.processor if own is not None else architecture
        self.processor = TENSOR_PROCESSORS.get(processor, TensorProcessor)(config=config.to_dict())
        with torch.device("meta"):  # only the module's names are needed: no memory, no initialisation
            skeleton = AutoModelForCausalLM.from_config(config)
        # Hugging Face name -> the file's tensors: gguf-py's table, as transformers' get_gguf_hf_weights_map maps them
        # (which rebuilds the table for each of the model's 300 submodules: 4 s), or the layout's sources
        arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture), None)
        if arch is None:
            raise ValueError(f"general.architecture {architecture!r} is not one gguf-py knows")
        table = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
        self.layout = GGUF_LAYOUTS.get(architecture, ONE_TO_ONE)
        sources, self._expected = {}, {}
        for hf_name, parameter in skeleton.state_dict().items():
            found = self.layout.sources(hf_name)
            if found is None:
                stem, _, suffix = hf_name.rpartition(".")
                gguf_name = table.get_name(stem)
                found = None if gguf_name is None else (f"{gguf_name}.{suffix}",)
            if found is not None:
                sources[hf_name] = found
                self._expected[hf_name] = tuple(parameter.shape)  # what the file's own metadata makes of it
            elif (gguf_name := table.get_name(hf_name)) is not None:  # a bare parameter (gpt-oss's self_attn.sinks)
                sources[hf_name] = (f"{gguf_name}.weight",)
                self._expected[hf_name] = tuple(parameter.shape)
        # a mixture's router, experts and shared expert under llama.cpp's names below the layer, whatever the family
        # (experts.GgufStacked reads them; the slot checks their shapes against the config)
        experts = {t.name: f"model.layers.{m[1]}.{m[2]}.{m[3]}" for t in self.reader.tensors
                   if (m := EXPERT_TENSORS.match(t.name)) is not None}
        sources = {name: found for name, found in sources.items() if not set(found) & experts.keys()}
        sources |= {ours: (theirs,) for theirs, ours in experts.items()}
        stored = {t.name: t for t in self.reader.tensors}
        self._tensors = {name: [stored[s] for s in found] for name, found in sources.items()
                         if all(s in stored for s in found)}
        self._shapes = {name: self._expected.get(name) or tuple(int(n) for n in reversed(self._tensors[name][0].shape))
                        for name in self._tensors}
        self.path = path
        for name, shape in self._shapes.items():  # sizes the metadata declares against the values the file holds
            if prod(shape) != prod(self._expected.get(name, shape)):
                tensor = self._tensors[name][0]
                raise ExportError(f"{path}: tensor {tensor.name} ({name}) has shape {shape}; the file's metadata (heads, "
                                  f"sizes) makes it {self._expected[name]}")

    def _read(self, name: str) -> torch.Tensor:
        tensors = self._tensors[name]
        result = self.layout.put_back(name, [self._dequantized(tensor) for tensor in tensors])
        if result.shape != self._expected.get(name, result.shape):  # a file whose tensors disagree with its metadata
            stored = ", ".join(tensor.name for tensor in tensors)
            raise ExportError(f"{self.path}: tensor {stored} ({name}) has shape {tuple(result.shape)}; the file's "
                              f"metadata (heads, sizes) makes it {self._expected[name]}")
        return torch.from_numpy(np.ascontiguousarray(result, np.float32))

    def _dequantized(self, tensor) -> np.ndarray:
        """One of the file's tensors in fp32, through transformers' processor (its shape as the processor leaves it)."""
        data = tensor.data  # memory-mapped: [rows, bytes per row] for quantized types, the values otherwise
        rows = data.shape[0] if data.ndim > 1 else 1
        if rows <= ROWS_PER_CHUNK:
            array = np.array(self._dequantize(data, tensor.tensor_type), np.float32)
        else:  # in slices, on every core: NumPy releases the GIL inside the block arithmetic
            array = np.empty(tuple(int(n) for n in reversed(tensor.shape)), np.float32)

            def fill(start: int) -> None:
                array[start : start + ROWS_PER_CHUNK] = self._dequantize(data[start : start + ROWS_PER_CHUNK],
                                                                         tensor.tensor_type)

            with ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(fill, range(0, rows, ROWS_PER_CHUNK)))
        return self.processor.process(weights=array, name=tensor.name, tensor_key_mapping={},
                                      parsed_parameters={"tensors": {}}).weights
