"""TensorRT engines from the same verify-v1 ONNX: optimization profiles, builds, and build facts.

Works with NVIDIA's ``tensorrt`` module or with ``tensorrt_rtx`` (TensorRT for RTX GPUs, which
also builds ahead of time on a machine without a GPU) where their APIs agree. Imported lazily:
the CPU install never needs either.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..contract import PREFILL_CHUNK, Manifest, ModelSpec, sha256_file


class BuildError(RuntimeError):
    """A TensorRT build that cannot proceed; the message says what to change."""


def tensorrt():
    """The TensorRT Python module: ``tensorrt`` if installed, else ``tensorrt_rtx``."""
    try:
        import tensorrt as trt
    except ImportError:
        try:
            import tensorrt_rtx as trt
        except ImportError as exc:
            raise BuildError("neither tensorrt nor tensorrt_rtx is installed: pip install 'specdeploy[trt]' "
                             "(or tensorrt-rtx)") from exc
    return trt


@dataclass(frozen=True)
class Profile:
    """One optimization profile: [min, opt, max] of batch, tokens and capacity."""

    name: str
    batch: tuple[int, int, int]
    tokens: tuple[int, int, int]
    capacity: tuple[int, int, int]

    def shapes(self, spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """[min, opt, max] shape of every graph input."""
        out = {
            "input_ids": tuple((b, t) for b, t in zip(self.batch, self.tokens)),
            "past_len": tuple((b,) for b in self.batch),
        }
        for name in spec.cache_inputs:
            out[name] = tuple((b, spec.kv_heads, c, spec.head_dim) for b, c in zip(self.batch, self.capacity))
        for state in spec.states:  # a hybrid's recurrent states: [batch, slots (the capacity where positional), *shape]
            for layer in state.layers:
                out[f"cache_{state.name}.{layer}"] = tuple((b, state.slots or c, *state.shape)
                                                           for b, c in zip(self.batch, self.capacity))
        return out


def plan_profiles(spec: ModelSpec, max_batch: int, max_draft: int, capacity: int | None = None,
                  opt_capacity: int | None = None) -> list[Profile]:
    """A verify profile (tokens 1 .. K + 1) and, since prefill needs far longer inputs, a prefill profile."""
    capacity = capacity or spec.capacity
    if capacity > spec.capacity:
        raise BuildError(f"--capacity {capacity} exceeds the exported capacity {spec.capacity}")
    if max_batch < 1 or max_draft < 0 or capacity < 2:
        raise BuildError(f"need max_batch >= 1, max_draft >= 0, capacity >= 2; got {max_batch}, {max_draft}, {capacity}")
    opt = min(opt_capacity or max(2, capacity // 2), capacity)
    caps = (1, opt, capacity)
    verify = Profile("verify", (1, 1, max_batch), (1, max_draft + 1, max_draft + 1), caps)
    chunk = min(PREFILL_CHUNK, capacity)
    prefill = Profile("prefill", (1, 1, max_batch), (1, chunk, chunk), caps)
    return [verify] if chunk <= max_draft + 1 else [verify, prefill]


def build_engines(directory: Path, max_batch: int = 1, max_draft: int = 8, capacity: int | None = None,
                  opt_capacity: int | None = None, precision: str = "auto", log=print) -> Manifest:
    """Build a TensorRT plan next to each ONNX graph of an artifact and record the build in its manifest."""
    directory = Path(directory)
    manifest = Manifest.read(directory)
    fused = [spec.role for spec in manifest.models.values() if spec.graph != "explicit"]
    if fused:  # GroupQueryAttention and its kin are ONNX Runtime's own ops: TensorRT's parser has none of them
        raise BuildError(f"{', '.join(fused)}: a fused graph (ONNX Runtime's contrib ops) cannot be built with "
                         "TensorRT; export with --graph explicit for TensorRT")
    trt = tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)  # one for every role's build
    device = device_facts()
    for role, spec in manifest.models.items():
        profiles = plan_profiles(spec, max_batch, max_draft, capacity, opt_capacity)
        plan_file = f"{role}.plan"
        (directory / plan_file).write_bytes(_build_plan(trt, logger, directory, spec, profiles, precision, log))
        manifest.engines[role] = {
            "file": plan_file,
            "module": trt.__name__,
            "tensorrt_version": trt.__version__,
            **device,
            "precision": precision if precision != "auto" else spec.dtype,
            "profiles": [asdict(p) for p in profiles],
        }
    for name in [m["file"] for m in manifest.engines.values()] + ["timing.cache"]:
        manifest.files[name] = sha256_file(directory / name)
    manifest.write(directory)
    return manifest


def _build_plan(trt, logger, directory: Path, spec: ModelSpec, profiles: list[Profile], precision: str, log) -> bytes:
    """TensorRT's serialized plan of ``spec``'s graph over ``profiles``; the artifact's ``timing.cache`` is read
    before and written after, so that later builds reuse its timings."""
    cache_path = directory / "timing.cache"
    log(f"{spec.role}: parsing {spec.file}")
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT-RTX is always strongly typed; TensorRT takes precision flags
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(directory / spec.file)):
        errors = "; ".join(parser.get_error(i).desc() for i in range(parser.num_errors))
        raise BuildError(f"{spec.file}: TensorRT's ONNX parser refused the graph: {errors}")
    config = builder.create_builder_config()
    _set_precision(trt, config, precision, spec)
    for profile in profiles:
        optimization = builder.create_optimization_profile()
        for name, (low, opt, high) in profile.shapes(spec).items():
            optimization.set_shape(name, low, opt, high)
        config.add_optimization_profile(optimization)
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    log(f"{spec.role}: building ({', '.join(p.name for p in profiles)} profiles)")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(f"{spec.file}: TensorRT could not build an engine (see the log above)")
    cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    return bytes(plan)


def _is_rtx(trt) -> bool:
    return trt.__name__.startswith("tensorrt_rtx")


def _set_precision(trt, config, precision: str, spec: ModelSpec) -> None:
    if precision == "auto":
        return  # strongly typed: the graph's own dtypes
    if _is_rtx(trt):
        wanted = {"fp16": "float16", "bf16": "bfloat16"}[precision]
        if spec.dtype != wanted:
            raise BuildError(f"TensorRT-RTX builds strongly typed networks from the graph's dtypes: --{precision} needs "
                             f"an artifact exported with --dtype {wanted}, this one is {spec.dtype}")
        return
    config.set_flag({"fp16": trt.BuilderFlag.FP16, "bf16": trt.BuilderFlag.BF16}[precision])


def device_facts() -> dict:
    """The GPU this build targets, as far as this machine can tell."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return {"gpu": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}"}
    except ImportError:
        pass
    return {"gpu": "none (ahead-of-time build without a GPU)", "compute_capability": "any"}
