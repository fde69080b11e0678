"""The JSON documents of `inspect` and `run`, with versioned schemas (docs/json.md)."""

from __future__ import annotations

from typing import Any

from ..format.bundle import BundleReader
from ..format.manifest import MethodSpec, TensorSpec

INSPECT_SCHEMA = "cuda-runner/inspect/1"
RUN_SCHEMA = "cuda-runner/run/1"
DEVICES_SCHEMA = "cuda-runner/devices/1"


def tensor_json(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape)}


def _segment_json(reader: BundleReader, name: str | None) -> dict[str, Any] | None:
    entry = reader.manifest.segment(name) if name else None
    return None if entry is None else {"segment": entry.name, "size": entry.size, "digest": entry.digest}


def method_json(reader: BundleReader, spec: MethodSpec, runnable_problem: str | None) -> dict[str, Any]:
    device = {"type": spec.device.type}
    if spec.device.compute_capability:
        device["compute_capability"] = spec.device.compute_capability
    if spec.device.cpu_isa:
        device["cpu_isa"] = spec.device.cpu_isa
    return {
        "device": device,
        "inputs": [tensor_json(tensor) for tensor in spec.inputs],
        "outputs": [tensor_json(tensor) for tensor in spec.outputs],
        "dims": {name: {"min": dim.min, "max": dim.max, "example": dim.example} for name, dim in spec.dims.items()},
        "library": _segment_json(reader, spec.library_segment),
        "weights": _segment_json(reader, spec.weights_segment),
        "samples": spec.has_samples,
        "torch_version": spec.torch_version,
        "compile_options": dict(spec.compile_options),
        "runnable_here": runnable_problem is None,
        "not_runnable_reason": runnable_problem,
    }


def inspect_document(reader: BundleReader, problems: dict[str, str | None], verified: dict[str, bool] | None) -> dict[str, Any]:
    manifest = reader.manifest
    segments = []
    for entry in manifest.segments:
        segment = {"name": entry.name, "offset": entry.offset, "size": entry.size, "digest": entry.digest}
        if verified is not None:
            segment["verified"] = verified[entry.name]
        segments.append(segment)
    return {
        "schema": INSPECT_SCHEMA,
        "path": str(reader.path),
        "format_version": reader.version,
        "file_size": reader.file_size,
        "build": dict(manifest.build),
        "metadata": dict(manifest.metadata),
        "required_features": list(manifest.required_features),
        "optional_features": list(manifest.optional_features),
        "methods": {name: method_json(reader, spec, problems[name]) for name, spec in manifest.methods.items()},
        "segments": segments,
        "runnable_here": all(problem is None for problem in problems.values()),
        "verified": None if verified is None else all(verified.values()),
    }


def run_document(result: Any, *, with_stats: bool = True) -> dict[str, Any]:
    """The `run` JSON document (schema cuda-runner/run/1) for a running.RunResult."""
    from .stats import array_stats

    outputs = []
    for spec in result.method.outputs:
        array = result.outputs[spec.name]
        entry = {"name": spec.name, "dtype": spec.dtype, "shape": list(array.shape), "file": _path_or_none(result.files.get(spec.name))}
        if with_stats:
            entry["stats"] = array_stats(array).to_json()
        outputs.append(entry)
    inputs = [
        {"name": source.name, "dtype": result.method.input(source.name).dtype, "shape": list(result.inputs.arrays[source.name].shape),
         "source": source.origin, "detail": source.detail}
        for source in result.inputs.sources
    ]
    return {
        "schema": RUN_SCHEMA,
        "bundle": str(result.bundle),
        "method": result.method.name,
        "device": result.device,
        "dims": dict(result.inputs.dims),
        "inputs": inputs,
        "outputs": outputs,
        "timings_s": {key: round(value, 6) for key, value in result.timings.items()},
        "comparison": None if result.comparison is None else result.comparison.to_json(),
        "verdict": result.verdict,
    }


def _path_or_none(path: Any) -> str | None:
    return None if path is None else str(path)
