"""`cuda-runner run` as a library call: resolve inputs, load, run, compare, write outputs.

Everything that can be checked is checked before the library is loaded: the
output destinations, the bundle, the inputs against the signature, and the
reference. The inputs are saved (`save_inputs`) before the model runs, so a
run that crashes the process can still be replayed; outputs are written
all-or-none after it ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..format.manifest import MethodSpec, choose_method
from ..format.signing import TrustedKey
from ..format.source import ModelReader, open_model
from ..io.inputs import GivenInputs, InputPlan, ResolvedInputs, StoredSamples, resolve_inputs
from ..io.npy import NpzArchive, save_archive
from ..io.outputs import OutputPlan, write_outputs
from ..report.schema import SCHEMAS
from ..report.stats import ArrayStats, array_stats
from ..runtime.method import LoadProgress
from ..runtime.model import load_model, prepare_device
from ..runtime.options import LoadOptions
from ..verify.compare import Comparison, Tolerances, compare_outputs
from ..verify.reference import load_reference, stored_sample_outputs

Progress = Callable[[str], None]


@dataclass(frozen=True)
class RunRequest:
    """A run, fully parsed. `inputs=StoredSamples()` is a self-test: the stored
    eager outputs become the reference."""

    bundle: Path
    inputs: InputPlan = field(default_factory=GivenInputs)
    data: Path | None = None  # an ExecuTorch program's data file (.ptd)
    method: str | None = None
    device: str | None = None
    outputs: OutputPlan = field(default_factory=OutputPlan)
    save_inputs: Path | None = None  # a folder: inputs.npz is written there
    expected: Path | None = None
    tolerances: Tolerances = field(default_factory=Tolerances)
    allow_missing: bool = False  # outputs without a reference are not a failure
    # How to load; the warm-up is never done for one run (it only helps later calls).
    load: LoadOptions = field(default_factory=LoadOptions)


@dataclass
class RunResult:
    bundle: Path
    method: MethodSpec
    device: str
    inputs: ResolvedInputs
    outputs: dict[str, np.ndarray]
    files: dict[str, list[Path]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    load_timings: dict[str, float] = field(default_factory=dict)
    comparison: Comparison | None = None
    # Outputs written in another dtype than the model gave them (--bf16-as): {name: dtype in the files}.
    written_dtypes: dict[str, str] = field(default_factory=dict)
    # The signature that was checked before anything loaded: {signer, method, shards}; None without trusted keys.
    signature: dict[str, Any] | None = None
    provider: str = ""  # whose shim functions the library ran on

    def output_dtype(self, name: str) -> str:
        """The dtype of an output as reported: as written, where it was written converted."""
        spec = next(spec for spec in self.method.outputs if spec.name == name)
        return self.written_dtypes.get(name, spec.dtype)

    @property
    def verdict(self) -> str:
        return "FAILED" if self.comparison is not None and not self.comparison.passed else "PASSED"

    def stats(self) -> dict[str, ArrayStats]:
        return {name: array_stats(array) for name, array in self.outputs.items()}

    def to_json(self) -> dict[str, Any]:
        stats = self.stats()
        outputs = [
            {"name": spec.name, "dtype": self.output_dtype(spec.name), "model_dtype": spec.dtype, "shape": list(self.outputs[spec.name].shape),
             "files": [str(path) for path in self.files.get(spec.name, [])],
             # bfloat16 widens to float32 exactly: the statistics are those of the values written
             "stats": {**stats[spec.name].to_json(), "dtype": self.output_dtype(spec.name)}}
            for spec in self.method.outputs
        ]
        inputs = [
            {"name": source.name, "dtype": self.method.input(source.name).dtype,  # type: ignore[union-attr]
             "shape": list(self.inputs.arrays[source.name].shape), "source": source.origin, "detail": source.detail}
            for source in self.inputs.sources
        ]
        return {
            "schema": SCHEMAS["run"],
            "bundle": str(self.bundle),
            "method": self.method.name,
            "device": self.device,
            "dims": dict(self.inputs.dims),
            "inputs": inputs,
            "outputs": outputs,
            "timings_s": {key: round(value, 6) for key, value in self.timings.items()},
            "load_s": {key: round(value, 6) for key, value in self.load_timings.items()},
            "comparison": None if self.comparison is None else self.comparison.to_json(),
            "signature": self.signature,
            "provider": self.provider,
            "verdict": self.verdict,
        }


@dataclass
class OpenedModel:
    """A model file opened for one command: its signature checked (where keys
    were given) and the method to run chosen, nothing loaded yet."""

    reader: ModelReader
    method: MethodSpec
    seconds: float  # opening and the signature check, for the load timings
    signature: dict[str, Any] | None  # the checked signature as reported (SignedFile.to_json), or None

    def close(self) -> None:
        self.reader.close()


def open_for_run(path: Path, data: Path | None, method: str | None, trusted_keys: Sequence[TrustedKey] = (),
                 device: str | None = None, *, prepare: bool = True) -> OpenedModel:
    """Open a bundle or program, check its signature against `trusted_keys`
    before anything in it is used, and choose the method (the only one, or
    'forward', where `method` is None). With `prepare`, the method's CUDA
    context (on `device`, or the bundle's) starts being made meanwhile."""
    started = time.perf_counter()
    reader = open_model(path, data)
    try:
        if trusted_keys:
            reader.require_signature(trusted_keys)
        seconds = time.perf_counter() - started
        methods = reader.manifest.methods
        spec = methods[choose_method(list(methods), method)]
        if prepare:
            prepare_device([spec], device)
    except BaseException:
        reader.close()
        raise
    checked = reader.signature
    return OpenedModel(reader, spec, seconds, checked.to_json() if checked is not None else None)


def prepare_inputs(reader: ModelReader, method: MethodSpec, plan: InputPlan) -> tuple[ResolvedInputs, dict[str, np.ndarray] | None]:
    """The inputs, and for stored samples the eager outputs stored with them."""
    if not isinstance(plan, StoredSamples):
        return resolve_inputs(method, plan), None
    if method.sample_inputs_segment is None or method.sample_outputs_segment is None:
        raise InputError(f"method {method.name!r} has no stored samples", subject="samples")
    with NpzArchive(reader.segment(method.sample_inputs_segment), "stored sample inputs") as samples:
        inputs = resolve_inputs(method, plan, samples)
    with NpzArchive(reader.segment(method.sample_outputs_segment), "stored sample outputs") as stored:
        return inputs, stored_sample_outputs(stored, method.name)


def run_bundle(request: RunRequest, progress: Progress = lambda _: None, load_progress: LoadProgress | None = None) -> RunResult:
    request.outputs.check()
    opened = open_for_run(request.bundle, request.data, request.method, request.load.trusted_keys, request.device)
    method = opened.method
    try:
        started = time.perf_counter()
        inputs, expected = prepare_inputs(opened.reader, method, request.inputs)
        if request.expected is not None:
            expected = load_reference(request.expected, [spec.name for spec in method.outputs])
        request.tolerances.check_names([spec.name for spec in method.outputs])
        prepared = time.perf_counter() - started
        if request.save_inputs is not None:
            save_archive(request.save_inputs / "inputs.npz", inputs.arrays)
        progress(f"loading {method.name!r}")
    except BaseException:
        opened.close()
        raise
    options = request.load.with_fields(warm_up=False)
    with load_model(opened.reader, request.device, options, methods=[method.name], open_seconds=opened.seconds, progress=load_progress) as model:
        loaded = model.method(method.name)
        load_timings = model.load_timings(method.name)
        progress(f"running {method.name!r} on {loaded.device}")
        started = time.perf_counter()
        outputs = loaded.run(inputs)  # checked against the signature when resolved: not again
        ran = time.perf_counter() - started
        device = str(loaded.device)
        provider = loaded.provider
    result = RunResult(request.bundle, method, device, inputs, outputs, load_timings=load_timings, signature=opened.signature, provider=provider)
    if expected is not None:
        result.comparison = compare_outputs(outputs, expected, request.tolerances, allow_missing=request.allow_missing)
    started = time.perf_counter()
    if request.outputs.writes:
        result.files = write_outputs(request.outputs, outputs)
        result.written_dtypes = {spec.name: written for spec in method.outputs
                                 if (written := request.outputs.written_dtype(spec.dtype)) != spec.dtype}
    result.timings = {"prepare": prepared, "load": sum(load_timings.values()), "run": ran, "write": time.perf_counter() - started}
    return result
