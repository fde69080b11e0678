"""`cuda-runner run` as a library call: resolve inputs, load, run, compare, write outputs.

Everything that can be checked is checked before the library is loaded: the
output destinations, the bundle, the inputs against the signature, and the
reference. The inputs are saved (`save_inputs`) before the model runs, so a
run that crashes the process can still be replayed; outputs are written
all-or-none after it ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputError
from .format.manifest import MethodSpec, choose_method
from .format.source import AnyReader, open_model
from .io.inputs import GivenInputs, InputPlan, ResolvedInputs, StoredSamples, resolve_inputs
from .io.npy import NpzArchive, save_archive
from .io.outputs import OutputPlan, write_outputs
from .report.schema import SCHEMAS
from .report.stats import ArrayStats, array_stats
from .runtime.model import load_model
from .signing import TrustedKey
from .verify.compare import Comparison, Tolerances, compare_outputs
from .verify.reference import load_reference, stored_sample_outputs

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
    verify_weights: bool = True
    cuda_graph: bool = False
    check_inputs: bool = False  # the library's own input checks (AOTI_RUNTIME_CHECK_INPUTS)
    trusted_keys: tuple[TrustedKey, ...] = ()  # when given, the bundle must be signed by one of them


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


def select_method(reader: AnyReader, name: str | None) -> MethodSpec:
    methods = reader.manifest.methods
    return methods[choose_method(list(methods), name)]


def prepare_inputs(reader: AnyReader, method: MethodSpec, plan: InputPlan) -> tuple[ResolvedInputs, dict[str, np.ndarray] | None]:
    """The inputs, and for stored samples the eager outputs stored with them."""
    if not isinstance(plan, StoredSamples):
        return resolve_inputs(method, plan), None
    if method.sample_inputs_segment is None or method.sample_outputs_segment is None:
        raise InputError(f"method {method.name!r} has no stored samples", subject="samples")
    with NpzArchive(reader.segment(method.sample_inputs_segment), "stored sample inputs") as samples:
        inputs = resolve_inputs(method, plan, samples)
    with NpzArchive(reader.segment(method.sample_outputs_segment), "stored sample outputs") as stored:
        return inputs, stored_sample_outputs(stored, method.name)


def run_bundle(request: RunRequest, progress: Progress = lambda _: None) -> RunResult:
    request.outputs.check()
    started = time.perf_counter()
    reader = open_model(request.bundle, request.data)
    try:
        if request.trusted_keys:
            reader.require_signature(request.trusted_keys)  # before anything in the bundle is used
        checked = reader.signature
        signature = checked.to_json() if checked is not None else None
        opened = time.perf_counter() - started
        started = time.perf_counter()
        method = select_method(reader, request.method)
        inputs, expected = prepare_inputs(reader, method, request.inputs)
        if request.expected is not None:
            expected = load_reference(request.expected, [spec.name for spec in method.outputs])
        request.tolerances.check_names([spec.name for spec in method.outputs])
        prepared = time.perf_counter() - started
        if request.save_inputs is not None:
            save_archive(request.save_inputs / "inputs.npz", inputs.arrays)
        progress(f"loading {method.name!r}")
    except BaseException:
        reader.close()
        raise
    with load_model(reader, request.device, verify_weights=request.verify_weights, methods=[method.name],
                    cuda_graph=request.cuda_graph, check_inputs=request.check_inputs) as model:
        loaded = model.method(method.name)
        load_timings = {**model.load_timings(method.name), "open": opened}
        progress(f"running {method.name!r} on {loaded.device}")
        started = time.perf_counter()
        outputs = loaded.run(inputs.arrays)
        ran = time.perf_counter() - started
        device = str(loaded.device)
        provider = loaded.provider
    result = RunResult(request.bundle, method, device, inputs, outputs, load_timings=load_timings, signature=signature, provider=provider)
    if expected is not None:
        result.comparison = compare_outputs(outputs, expected, request.tolerances, allow_missing=request.allow_missing)
    started = time.perf_counter()
    if request.outputs.writes:
        result.files = write_outputs(request.outputs, outputs)
        result.written_dtypes = {spec.name: written for spec in method.outputs
                                 if (written := request.outputs.written_dtype(spec.dtype)) != spec.dtype}
    result.timings = {"prepare": prepared, "load": sum(load_timings.values()), "run": ran, "write": time.perf_counter() - started}
    return result
