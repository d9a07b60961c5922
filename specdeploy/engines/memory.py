"""Where an engine's buffers live: host memory (NumPy) or one GPU's (CuPy).

The engines' memory (``ort.HostMemory``, ``ort.CudaMemory``) allocates the buffers; the functions here work on either.
"""

from __future__ import annotations

import numpy as np

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}  # of the manifest's dtypes


class Transfers:
    """Bytes this process has copied between host and device memory through the engines (inputs in, outputs read):
    what a cycle moves across PCIe, for tools/gpu_check.py. K/V never crosses: no engine path copies a cache."""

    def __init__(self):
        self.to_device = self.to_host = 0


transfers = Transfers()


def address(array) -> int:
    """The address of an array's first element, host (``__array_interface__``) or device (``__cuda_array_interface__``)."""
    interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return interface["data"][0]


def on_host(array) -> np.ndarray:
    """``array`` in host memory: itself when it is a NumPy array, else a copy (a CuPy array's ``get``)."""
    if isinstance(array, np.ndarray):
        return array
    transfers.to_host += array.nbytes
    return array.get()


def settle(array) -> None:
    """Wait for copies queued on a device array's GPU (CuPy's stream) before a session reads it: ONNX Runtime's kernels
    run on a stream of their own. Host arrays are written at once."""
    if not isinstance(array, np.ndarray):
        array.device.synchronize()


def copy_prefixes(to: np.ndarray, to_rows, source: np.ndarray, rows, lengths) -> None:
    """Row ``to_rows[i]`` of ``to`` takes the first ``lengths[i]`` slots of row ``rows[i]`` of ``source``, every
    layer at once (the caches' [2 * layers, batch, kv_heads, capacity, head_dim] layout)."""
    for to_row, row, n in zip(to_rows, rows, np.asarray(lengths).tolist()):
        if n and not (to is source and to_row == row):
            to[:, to_row, :, :n] = source[:, row, :, :n]
    settle(to)


def copy_states(to, to_rows, source, rows, lengths) -> None:
    """Row ``to_rows[i]`` of a recurrent state's buffers ``to`` ([layers, batch, slots, *shape]) takes the states row
    ``rows[i]`` of ``source`` holds for its first ``lengths[i]`` positions: its first min(length, slots) slots (a ring
    full of positions, every slot; a positional buffer, the prefix)."""
    slots = source.shape[2]
    for to_row, row, n in zip(to_rows, rows, np.asarray(lengths).tolist()):
        n = min(n, slots)
        if n and not (to is source and to_row == row):
            to[:, to_row, :n] = source[:, row, :n]
    settle(to)


def write_states(group, new, first: list[int]) -> None:
    """Write a recurrent state's new states ``new`` [layers, batch, written, *shape] into its buffers ``group``
    [layers, batch, slots, *shape]: row b's j-th at the slot of position first[b] + j, that is (first[b] + j) mod slots."""
    slots, written = group.shape[2], new.shape[2]
    at = first[0] % slots
    if first.count(first[0]) == len(first) and at + written <= slots:  # every row at the same slots, unwrapped: one copy
        group[:, :, at : at + written] = new
    else:
        for b, start in enumerate(first):
            index = (start + np.arange(written)) % slots
            group[:, b, index] = new[:, b]
    settle(group)


def describe(value) -> str:
    """An array's dtype and shape, else a value's type name: what an input error says it received."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {value.shape}"
    return type(value).__name__
