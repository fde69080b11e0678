"""`cuda-runner run` as a library call: resolve inputs, load, run, write outputs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import InputError
from .format.bundle import BundleReader, open_bundle
from .format.manifest import MethodSpec, choose_method
from .io.inputs import InputSource, ResolvedInputs, finish_inputs, parse_ranges, parse_shapes, random_inputs, resolve_inputs
from .io.npy import save_archive
from .io.outputs import write_output_archive, write_output_dir
from .runtime.model import load_model
from .verify.compare import Comparison, Tolerances, compare_outputs
from .verify.reference import bundle_samples, load_reference


@dataclass
class RunRequest:
    bundle: str | os.PathLike
    inputs: Sequence[str] = ()
    method: str | None = None
    device: str | None = None
    random_inputs: bool = False
    seed: int = 0
    shapes: Sequence[str] = ()
    ranges: Sequence[str] = ()
    cast: bool = False
    save_inputs: str | os.PathLike | None = None
    out_dir: str | os.PathLike | None = None
    out_file: str | os.PathLike | None = None
    verify_weights: bool = True
    expected: str | os.PathLike | None = None
    self_test: bool = False
    tolerances: Tolerances = field(default_factory=Tolerances)
    cuda_graph: bool = False


@dataclass
class RunResult:
    bundle: Path
    method: MethodSpec
    device: str
    inputs: ResolvedInputs
    outputs: dict[str, np.ndarray]
    files: dict[str, Path] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    comparison: Comparison | None = None

    @property
    def verdict(self) -> str:
        return "FAILED" if self.comparison is not None and not self.comparison.passed else "PASSED"


def select_method(reader: BundleReader, name: str | None) -> MethodSpec:
    methods = reader.manifest.methods
    return methods[choose_method(list(methods), name)]


def gather_inputs(reader: BundleReader, method: MethodSpec, request: RunRequest) -> tuple[ResolvedInputs, dict[str, np.ndarray] | None]:
    """The inputs, and the reference outputs if the request compares against any."""
    if request.self_test:
        if request.inputs or request.random_inputs or request.expected is not None:
            raise InputError("--self-test uses the samples stored in the bundle; give no --inputs, --random-inputs or --expected")
        sample_inputs, sample_outputs = bundle_samples(reader, method)
        sources = [InputSource(name, "sample", "stored in the bundle") for name in sample_inputs]
        return finish_inputs(method, sample_inputs, sources), sample_outputs
    inputs = _fresh_inputs(method, request)
    expected = None if request.expected is None else load_reference(request.expected, [spec.name for spec in method.outputs])
    return inputs, expected


def _fresh_inputs(method: MethodSpec, request: RunRequest) -> ResolvedInputs:
    if request.random_inputs:
        if request.inputs:
            raise InputError("give either --inputs or --random-inputs, not both")
        return random_inputs(method, seed=request.seed, shapes=parse_shapes(request.shapes), ranges=parse_ranges(request.ranges))
    if request.shapes or request.ranges:
        raise InputError("--shape and --range apply to --random-inputs")
    return resolve_inputs(method, request.inputs, cast=request.cast)


def run_bundle(request: RunRequest, progress: Callable[[str], None] = lambda _: None) -> RunResult:
    """Everything is checked before the library is loaded; nothing is written on failure."""
    _check_request(request)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    reader = open_bundle(request.bundle)
    try:
        method = select_method(reader, request.method)
        inputs, expected = gather_inputs(reader, method, request)
        timings["prepare"] = time.perf_counter() - started
        if request.save_inputs is not None:
            save_archive(Path(request.save_inputs) / "inputs.npz", inputs.arrays)
        progress(f"loading {method.name!r}")
    except BaseException:
        reader.close()
        raise
    with load_model(reader, request.device, verify_weights=request.verify_weights, methods=[method.name], cuda_graph=request.cuda_graph) as model:
        loaded = model.method(method.name)
        timings.update({f"load.{phase}": seconds for phase, seconds in loaded.load_timings.items()})
        progress(f"running {method.name!r} on {loaded.device}")
        started = time.perf_counter()
        outputs = loaded.run(inputs.arrays)
        timings["run"] = time.perf_counter() - started
        device = str(loaded.device)
    result = RunResult(Path(request.bundle), method, device, inputs, outputs, timings=timings)
    if expected is not None:
        result.comparison = compare_outputs(outputs, expected, request.tolerances)
    write_outputs(result, request)
    return result


def _check_request(request: RunRequest) -> None:
    if request.out_file is not None and Path(request.out_file).suffix != ".npz":
        raise InputError(f"--out {request.out_file}: the archive must end in .npz")
    if request.out_dir is not None and Path(request.out_dir).exists() and not Path(request.out_dir).is_dir():
        raise InputError(f"--out-dir {request.out_dir} exists and is not a directory")


def write_outputs(result: RunResult, request: RunRequest) -> None:
    if request.out_dir is not None:
        result.files.update(write_output_dir(request.out_dir, result.outputs))
    if request.out_file is not None:
        archive = write_output_archive(request.out_file, result.outputs)
        for name in result.outputs:
            result.files.setdefault(name, archive)
