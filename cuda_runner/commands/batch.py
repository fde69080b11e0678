"""Many input sets through one loaded model: `cuda-runner run --batch DIR`.

A batch folder holds one input set per entry: an `.npz` keyed by input names,
or a subfolder of `NAME.npy` files. Each set is read, checked, run, compared
(with an expected folder) and written on its own, all-or-none; a set that
fails is recorded with its reason and the others go on. Sets are pipelined:
worker threads read and write files while other sets run, and a method with
several lanes runs several sets at once (on a GPU, one set's copies overlap
another's compute).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CudaRunnerError, ExitCode, InputError, WriteError, os_error
from ..files import file_digest, require_folder
from ..format.manifest import MethodSpec
from ..io.inputs import ArchiveFile, ArrayFile, GivenInputs, resolve_inputs
from ..io.outputs import OutputPlan, output_filenames, safe_filename, write_outputs
from ..report.schema import SCHEMAS
from ..runtime.method import LoadProgress
from ..runtime.model import load_model, load_pool
from ..runtime.options import LoadOptions
from ..verify.compare import Comparison, Tolerances, compare_outputs
from ..verify.reference import load_reference
from .running import open_for_run
from .stacking import Stacker, batch_dim

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class InputSet:
    name: str  # the entry's name without .npz; used for its output paths
    plan: GivenInputs


def discover_sets(folder: Path) -> list[InputSet]:
    """The input sets of a batch folder, by name: `NAME.npz` files and `NAME/` folders of `.npy` files."""
    require_folder(folder, "a folder of input sets")
    sets = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            files = sorted(entry.glob("*.npy"))
            sets.append(InputSet(entry.name, GivenInputs(tuple(ArrayFile(path, path.stem) for path in files))))
        elif entry.suffix == ".npz":
            sets.append(InputSet(entry.stem, GivenInputs((ArchiveFile(entry),))))
    if not sets:
        raise InputError(f"{folder} holds no input sets (NAME.npz files or NAME/ folders of .npy files)")
    names = [safe_filename(input_set.name) for input_set in sets]
    if len(set(names)) != len(names):
        raise InputError(f"{folder}: two input sets would write to the same output name")
    return sets


@dataclass(frozen=True)
class BatchRequest:
    bundle: Path
    inputs: Path  # the batch folder
    out_dir: Path
    out_format: str = "npy"  # "npy": OUT/<set>/<output>.npy; "npz": OUT/<set>.npz
    method: str | None = None
    device: str | None = None
    expected_dir: Path | None = None  # REF/<set>.npz or REF/<set>/<output>.npy
    tolerances: Tolerances = field(default_factory=Tolerances)
    allow_missing: bool = False
    resume: bool = False  # skip sets whose outputs are complete (their set record matches them)
    fail_fast: bool = False
    devices: str | None = None  # "all" or "0,1": one loaded model per GPU, sets shared out
    # Two lanes by default: one set's copies overlap another's compute.
    load: LoadOptions = field(default_factory=lambda: LoadOptions(lanes=2))
    data: Path | None = None  # an ExecuTorch program's data file (.ptd)
    batch_size: int = 1  # sets stacked into one call along the method's batch dim (stacking.py)


@dataclass
class SetResult:
    name: str
    status: str  # "passed", "failed" (compared and wrong), "error", "skipped" (resumed)
    exit_code: int = 0
    error: str | None = None
    seconds: float = 0.0
    files: list[Path] = field(default_factory=list)
    comparison: Comparison | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "status": self.status, "exit_code": self.exit_code, "error": self.error, "seconds": round(self.seconds, 6),
            "files": [str(path) for path in self.files],
            "verdict": None if self.comparison is None else self.comparison.verdict,
        }


@dataclass
class BatchResult:
    bundle: Path
    method: str
    device: str
    sets: list[SetResult]
    wall: float
    load_timings: dict[str, float] = field(default_factory=dict)
    batch_size: int = 1

    def count(self, status: str) -> int:
        return sum(1 for result in self.sets if result.status == status)

    @property
    def exit_code(self) -> int:
        """0 when every set succeeded, else the worst (highest) code of a set."""
        return max((result.exit_code for result in self.sets), default=0)

    @property
    def verdict(self) -> str:
        """As for one run: FAILED for outputs outside tolerance (exit 1), ERROR where a set was refused or failed (2, 3, 4)."""
        return {0: "PASSED", 1: "FAILED"}.get(self.exit_code, "ERROR")

    @property
    def sets_per_second(self) -> float:
        done = len(self.sets) - self.count("skipped")
        return done / self.wall if self.wall > 0 else 0.0

    def summary(self) -> str:
        return (f"{len(self.sets)} sets: {self.count('passed')} passed, {self.count('failed')} failed verification, "
                f"{self.count('error')} refused or failed, {self.count('skipped')} skipped as complete; "
                f"{self.wall:.3f} s, {self.sets_per_second:.1f} sets/s")

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMAS["batch"],
            "bundle": str(self.bundle), "method": self.method, "device": self.device,
            "wall_s": self.wall, "sets_per_s": self.sets_per_second, "batch_size": self.batch_size,
            "counts": {status: self.count(status) for status in ("passed", "failed", "error", "skipped")},
            "load_s": self.load_timings,
            "sets": [result.to_json() for result in self.sets],
            "verdict": self.verdict,
        }


def _destinations(request: BatchRequest, spec: MethodSpec, name: str, provenance: Mapping[str, Any] | None) -> tuple[OutputPlan, list[Path]]:
    """Where a set's outputs go, with the set record that lets --resume tell a
    whole set, written by this model from these inputs, from any other."""
    stem = safe_filename(name)
    if request.out_format == "npz":
        archive = request.out_dir / f"{stem}.npz"
        return OutputPlan(archive=archive, record=True, provenance=provenance), [archive]
    folder = request.out_dir / stem
    files = output_filenames([output.name for output in spec.outputs])
    return OutputPlan(directory=folder, record=True, provenance=provenance), [folder / files[output.name] for output in spec.outputs]


def set_provenance(model: str, method: str, input_set: InputSet) -> dict[str, Any] | None:
    """What a set's outputs are made from: the model (its content digest), the
    method, and every input file by name with its digest. None where an input
    cannot be read: the set is then run, and says why it fails."""
    inputs = {}
    for entry in input_set.plan.entries:
        path = getattr(entry, "path", None)
        if path is None:
            continue
        try:
            inputs[Path(path).name] = file_digest(Path(path))
        except OSError:
            return None
    return {"model": model, "method": method, "inputs": inputs}


@dataclass(frozen=True)
class _Runner:
    """What the pipeline needs of a method, or of a pool of them on several GPUs."""

    spec: MethodSpec
    run: Callable[[dict[str, Any]], dict[str, Any]]
    lanes: int
    model: str = ""  # the model file's identity, for set records


def _run_or_skip(request: BatchRequest, runner: _Runner, input_set: InputSet) -> SetResult:
    """A set run, or (with --resume) skipped, or only compared again, where its
    outputs are complete: written whole by this model and method from these inputs."""
    provenance = set_provenance(runner.model, runner.spec.name, input_set)
    plan, _ = _destinations(request, runner.spec, input_set.name, provenance)
    if request.resume and provenance is not None and plan.complete([output.name for output in runner.spec.outputs]):
        if request.expected_dir is None:
            return SetResult(input_set.name, "skipped")
        return _recheck(request, runner, input_set, provenance)
    return _run_set(request, runner, input_set, provenance)


def _run_set(request: BatchRequest, runner: _Runner, input_set: InputSet, provenance: Mapping[str, Any] | None) -> SetResult:
    started = time.perf_counter()
    plan, paths = _destinations(request, runner.spec, input_set.name, provenance)
    try:
        inputs = resolve_inputs(runner.spec, input_set.plan)
        outputs = runner.run(inputs.arrays)
        result = SetResult(input_set.name, "passed")
        if request.expected_dir is not None:
            reference = _reference(request.expected_dir, input_set.name, runner.spec)
            result.comparison = compare_outputs(outputs, reference, request.tolerances, allow_missing=request.allow_missing)
            if not result.comparison.passed:
                result.status, result.exit_code = "failed", int(ExitCode.VERIFICATION_FAILED)
        write_outputs(plan, outputs)
        result.files = paths
    except CudaRunnerError as error:
        result = SetResult(input_set.name, "error", int(error.exit_code), str(error))
    except MemoryError:
        result = SetResult(input_set.name, "error", int(ExitCode.RUNTIME), "out of host memory")
    result.seconds = time.perf_counter() - started
    return result


def _recheck(request: BatchRequest, runner: _Runner, input_set: InputSet, provenance: Mapping[str, Any]) -> SetResult:
    """A set whose outputs are complete: compared again with the reference, so that
    a resumed job never turns an earlier failure into a pass."""
    started = time.perf_counter()
    plan, paths = _destinations(request, runner.spec, input_set.name, provenance)
    source = plan.archive if plan.archive is not None else plan.directory
    assert source is not None and request.expected_dir is not None
    try:
        outputs = load_reference(source, [output.name for output in runner.spec.outputs])
    except CudaRunnerError:
        return _run_set(request, runner, input_set, provenance)  # unreadable: run the set again
    result = SetResult(input_set.name, "skipped", files=paths)
    try:
        reference = _reference(request.expected_dir, input_set.name, runner.spec)
        result.comparison = compare_outputs(outputs, reference, request.tolerances, allow_missing=request.allow_missing)
    except CudaRunnerError as error:
        result = SetResult(input_set.name, "error", int(error.exit_code), str(error))
    else:
        if not result.comparison.passed:
            result.status, result.exit_code = "failed", int(ExitCode.VERIFICATION_FAILED)
    result.seconds = time.perf_counter() - started
    return result


def _reference(folder: Path, name: str, spec: MethodSpec) -> dict[str, Any]:
    archive = folder / f"{name}.npz"
    source = archive if archive.is_file() else folder / name
    if not source.exists():
        raise InputError(f"no reference for set {name!r} in {folder} (expected {name}.npz or {name}/)")
    return load_reference(source, [output.name for output in spec.outputs])


def run_batch(request: BatchRequest, progress: Progress = lambda done, total: None, load_progress: LoadProgress | None = None) -> BatchResult:
    if request.out_format not in ("npy", "npz"):
        raise InputError(f"unknown output format {request.out_format!r}; use npy or npz")
    sets = discover_sets(request.inputs)
    OutputPlan(directory=request.out_dir).check()
    if request.expected_dir is not None:
        require_folder(request.expected_dir, "a folder of reference outputs")
    if request.devices is not None and request.device is not None:
        raise InputError("give either one device or several devices, not both", subject="device")
    started = time.perf_counter()
    # With several devices, none of them is the bundle's default one: no context is started on GPU 0 for nothing.
    opened = open_for_run(request.bundle, request.data, request.method, request.load.trusted_keys, request.device, prepare=request.devices is None)
    name = opened.method.name  # load only the method that runs
    try:
        if request.batch_size > 1:
            batch_dim(opened.method)  # refuse before loading anything
        model_identity = opened.reader.identity()
    except BaseException:
        opened.close()
        raise
    if request.devices is not None:
        opened.close()  # each device opens the bundle for itself
        with load_pool(request.bundle, request.devices, request.load, methods=[name], data=request.data) as pool:
            method = pool.method(name)
            _make_out_dir(request.out_dir)
            runner = _Runner(method.spec, lambda arrays: pool.run(arrays, name), method.lanes * len(pool.models), model_identity)
            results = _run_all(request, runner, sets, progress)
            device = ",".join(str(device) for device in pool.devices)
            load_timings = pool.models[0].load_timings(name)
    else:
        with load_model(opened.reader, request.device, request.load, methods=[name], open_seconds=opened.seconds, progress=load_progress) as model:
            method = model.method(name)
            load_timings = model.load_timings(name)
            _make_out_dir(request.out_dir)
            results = _run_all(request, _Runner(method.spec, method.run, method.lanes, model_identity), sets, progress)
            device = str(method.device)
    return BatchResult(request.bundle, name, device, results, time.perf_counter() - started, load_timings, request.batch_size)


def _make_out_dir(folder: Path) -> None:
    """OUT, made once before sets run: a set that fails removes the folders it
    made, and OUT made by one set could otherwise go from under another's."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise os_error(error, f"cannot make {folder}", WriteError) from None


def _run_all(request: BatchRequest, runner: _Runner, sets: list[InputSet], progress: Progress) -> list[SetResult]:
    if request.batch_size <= 1:
        return list(_pipelined(request, runner, sets, progress))
    stacker = Stacker(runner.spec, runner.run, request.batch_size, runner.lanes)
    try:
        # Enough sets in flight to fill every lane's stack.
        return list(_pipelined(request, _Runner(runner.spec, stacker.run, runner.lanes * request.batch_size, runner.model), sets, progress))
    finally:
        stacker.close()


def _pipelined(request: BatchRequest, runner: _Runner, sets: list[InputSet], progress: Progress) -> Iterator[SetResult]:
    """Results in set order; twice as many sets in flight as run at once, plus
    two, so that reading and writing files (each written file is fsynced)
    overlaps running."""
    workers = 2 * runner.lanes + 2
    pending: list[tuple[InputSet, Future[SetResult | None] | SetResult]] = []
    done = 0
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cuda-runner-batch")
    halted = threading.Event()  # with --fail-fast: a set failed, so sets not started yet are not run

    def run_set(work: Callable[[BatchRequest, _Runner, InputSet], SetResult], input_set: InputSet) -> SetResult | None:
        if halted.is_set():
            return None
        result = work(request, runner, input_set)
        if request.fail_fast and result.exit_code != 0:
            halted.set()
        return result

    try:
        stop = False
        index = 0
        while index < len(sets) or pending:
            while not stop and index < len(sets) and len(pending) < 2 * workers:
                input_set = sets[index]
                index += 1
                # On a worker: telling whether a set is complete reads its inputs (their digests).
                pending.append((input_set, pool.submit(run_set, _run_or_skip, input_set)))
            if not pending:
                break
            _, entry = pending.pop(0)
            result = entry if isinstance(entry, SetResult) else entry.result()
            if result is None:  # not started: an earlier set failed (--fail-fast)
                continue
            done += 1
            progress(done, len(sets))
            yield result
            if request.fail_fast and result.exit_code != 0:
                stop = True
                halted.set()
                for _, later in pending:  # those already running finish and are reported; the rest are dropped
                    if isinstance(later, Future) and later.cancel():
                        continue
                    finished = later if isinstance(later, SetResult) else later.result()
                    if finished is not None:
                        done += 1
                        yield finished
                pending = []
    finally:
        # On an interrupt, sets not started yet are dropped, not run.
        pool.shutdown(wait=True, cancel_futures=True)
