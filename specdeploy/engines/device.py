"""Where an engine's buffers live: host memory (NumPy) or one GPU's (CuPy), behind the few operations the engines
need, so that the CPU and the GPU take one code path: caches, inputs and outputs are allocated where the session
computes, bound to it once by address through IOBinding, and only what the caller asks for comes to the host.

On the GPU, CuPy allocates the buffers and copies between them (rows joining and leaving a batch); ONNX Runtime's
CUDA EP computes on a CuPy stream it is handed (``user_compute_stream``), so the inputs copied there each call are
ordered before the kernels that read them without waiting on the host.
"""

from __future__ import annotations

import numpy as np


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


class HostMemory:
    """The CPU's: NumPy arrays, bound to ONNX Runtime by address; an upload is a copy into the bound buffer."""

    name = "cpu"  # ONNX Runtime's device name for IOBinding

    def zeros(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype)

    def empty(self, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def upload(self, buffer: np.ndarray, values: np.ndarray) -> None:
        """Copy host ``values`` into ``buffer`` (a bound input)."""
        np.copyto(buffer, values, casting="same_kind")

    def provider_options(self) -> dict[str, str]:
        return {}


class CudaMemory:
    """One GPU's, through CuPy: ``stream`` is the stream ONNX Runtime's CUDA EP computes on (its
    ``user_compute_stream``), and inputs are copied there."""

    name = "cuda"

    def __init__(self, device_id: int = 0, shared_stream: bool = True):
        try:
            import cupy
        except ImportError as exc:
            raise ImportError("caches on the GPU live in CuPy arrays, and CuPy is not installed: pip install "
                              "'specdeploy[gpu]' (cupy-cuda13x; cupy-cuda12x for CUDA 12)") from exc
        self.cupy, self.device_id = cupy, device_id
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.shared_stream = shared_stream  # else the EP computes on a stream of its own: uploads wait on the host

    def zeros(self, shape, dtype):
        with self.cupy.cuda.Device(self.device_id):
            return self.cupy.zeros(shape, dtype)

    def empty(self, shape, dtype):
        with self.cupy.cuda.Device(self.device_id):
            return self.cupy.empty(shape, dtype)

    def upload(self, buffer, values: np.ndarray) -> None:
        """Copy host ``values`` into device ``buffer`` on the session's stream (a few bytes a call: ids, lengths)."""
        buffer.set(np.ascontiguousarray(values, dtype=buffer.dtype), stream=self.stream)
        transfers.to_device += buffer.nbytes
        if not self.shared_stream:
            self.stream.synchronize()

    def provider_options(self) -> dict[str, str]:
        shared = {"user_compute_stream": str(self.stream.ptr)} if self.shared_stream else {}
        return {"device_id": str(self.device_id), **shared}
