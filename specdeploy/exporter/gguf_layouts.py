"""Where llama.cpp's converter stores a tensor otherwise than transformers' own GGUF processors undo: which of a file's
tensors make each Hugging Face tensor, and how they are put back (``GgufWeights`` asks ``GGUF_LAYOUTS`` by the file's
architecture; an architecture without an entry maps one tensor to one through gguf-py's name table).

Granite 4.0-H (``granitehybrid``; convert_hf_to_gguf.py's GraniteHybridModel over its Mamba2Model and
GraniteMoeModel): Mamba-2's ``A_log`` is stored as A = -exp(A_log) and ``D`` as [heads, 1]; ``dt_bias`` under
``ssm_dt.bias``; the convolution's [channels, 1, kernel] squeezed to [channels, kernel]; the gated norm's [inner] as
[groups, inner / groups]; the shared MLP's ``input_linear`` (gate and up in one tensor) split into ``ffn_gate`` and
``ffn_up`` and its ``output_linear`` as ``ffn_down``, where the model has no routed experts (beside routed experts it is
the shared expert, ``ffn_*_shexp``, and the experts ``ffn_*_exps``: read under those names as every mixture's are,
``experts.GgufStacked``).
"""

from __future__ import annotations

import re

import numpy as np


class OneToOne:
    """A file whose tensors are transformers' one for one (what gguf-py's name table and transformers' processor give)."""

    def sources(self, name: str) -> tuple[str, ...] | None:
        """The file's tensors that make Hugging Face tensor ``name``, in order; None: the name table's one."""
        return None

    def put_back(self, name: str, arrays: list[np.ndarray]) -> np.ndarray:
        """Hugging Face tensor ``name`` from its sources' arrays (dequantized, each through transformers' processor)."""
        return arrays[0]


class GraniteHybrid(OneToOne):
    """Granite 4.0-H's tensors as the converter writes them (module docstring)."""

    SOURCES = {"mamba.A_log": ("ssm_a",), "mamba.D": ("ssm_d",), "mamba.dt_bias": ("ssm_dt.bias",),
               "shared_mlp.input_linear.weight": ("ffn_gate.weight", "ffn_up.weight"),
               "shared_mlp.output_linear.weight": ("ffn_down.weight",)}

    def sources(self, name: str) -> tuple[str, ...] | None:
        found = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if found is None or found[2] not in self.SOURCES:
            return None
        return tuple(f"blk.{found[1]}.{source}" for source in self.SOURCES[found[2]])

    def put_back(self, name: str, arrays: list[np.ndarray]) -> np.ndarray:
        if name.endswith("mamba.A_log"):
            return np.log(-arrays[0]).reshape(-1)  # the converter's A = -exp(A_log), [heads, 1]
        if name.endswith(("mamba.D", "mamba.norm.weight")):
            return arrays[0].reshape(-1)  # [heads, 1]; [groups, inner / groups]
        if name.endswith("mamba.conv1d.weight"):
            return arrays[0][:, None]  # [channels, kernel] -> [channels, 1, kernel]
        if name.endswith("shared_mlp.input_linear.weight"):
            return np.concatenate(arrays, axis=0)  # gate rows, then up rows, as the MLP chunks them
        return arrays[0]


GGUF_LAYOUTS = {"granitehybrid": GraniteHybrid()}
ONE_TO_ONE = OneToOne()
