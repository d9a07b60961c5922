"""A checkpoint's tensors read from their files when the exporter takes them, and released when it deletes them.

The fused form builds each layer from the checkpoint as it writes it (``arch.build(..., streamed=True)``), so
with weights read as taken no more than one layer's are ever in memory: a checkpoint larger than the
machine's memory exports. ``GgufWeights`` (gguf_weights.py) dequantizes a GGUF file's; ``SafetensorsWeights``
reads a Hugging Face folder's shards through safetensors' memory-mapped ``safe_open``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Mapping, MutableMapping
from math import prod
from pathlib import Path
from types import MappingProxyType

import torch


class LazyWeights(MutableMapping):
    """``name -> torch.Tensor``; a tensor taken is kept until deleted (a layer's builder may read it twice),
    and deleting or popping it releases it. Subclasses fill ``_shapes`` and implement ``_read``."""

    kind = "checkpoint"

    def __init__(self):
        self._shapes: dict[str, tuple[int, ...]] = {}  # every tensor not yet deleted, as stored
        self._taken: dict[str, torch.Tensor] = {}

    @abstractmethod
    def _read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as stored (dequantized to fp32 for GGUF)."""

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Every tensor not yet deleted and its shape as stored, read from the files' headers (no tensor read)."""
        return MappingProxyType(self._shapes)

    def parameter_count(self) -> int:
        """Elements in the file's tensors, without reading any (a tied head is stored once)."""
        return sum(prod(shape) for shape in self._shapes.values())

    def held(self) -> int:
        """How many tensors are held now (tests check that a streamed export keeps few)."""
        return len(self._taken)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._taken:
            if name not in self._shapes:
                raise KeyError(name)
            self._taken[name] = self._read(name)
        return self._taken[name]

    def __delitem__(self, name: str) -> None:
        del self._shapes[name]
        self._taken.pop(name, None)

    def __setitem__(self, name, value) -> None:
        raise TypeError(f"{self.kind} weights are read-only")

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._shapes))

    def __len__(self) -> int:
        return len(self._shapes)

    def __contains__(self, name) -> bool:
        return name in self._shapes


class SafetensorsWeights(LazyWeights):
    """The tensors of a folder's ``*.safetensors`` shards, read through ``safe_open`` (memory-mapped) as taken."""

    kind = "safetensors"

    def __init__(self, shards: list[Path]):
        from safetensors import safe_open

        super().__init__()
        self._where = {}  # name -> its shard's open handle
        for shard in shards:
            handle = safe_open(str(shard), framework="pt")
            for name in handle.keys():
                self._where[name] = handle
                self._shapes[name] = tuple(handle.get_slice(name).get_shape())

    def _read(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)
