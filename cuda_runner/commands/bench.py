"""`cuda-runner bench` as a library call: load phases, first run, steady state and its split."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..format.manifest import MethodSpec, TensorSpec, choose_method
from ..io.inputs import InputPlan, RandomInputs, resolve_inputs
from ..report.schema import SCHEMAS
from ..runtime.method import LoadProgress, Method
from ..runtime.model import Model, load_model
from ..runtime.options import LoadOptions
from .running import open_for_run, prepare_inputs

# What each number includes; also in `bench --json` as "definitions".
DEFINITIONS = """\
load_s: the load phases, as in `run --json`: open (the bundle's header, manifest checksum and layout), libtorch
(libtorch's shim libraries, once per process), verify_library (copy the library segment and check its digest),
load_library (memfd and dlopen), load_call_helper (check and load the bundle's call helper), create_container, load_weights (feed the weights blob; its digest and those of the
stored samples are checked on other threads meanwhile), verify_weights_wait (waiting for those checks), capture_graph
(--cuda-graph), warm_up (CUDA: one run on zeros, so the first call does not load kernels or create cuBLAS handles).
first_run_s: the first host-to-host run after the load (on CUDA the load's warm_up phase has already run the model once).
steady_s: wall time of one host-to-host run (copy in, model, copy out, synchronize), after warm-up.
throughput_per_s: runs completed in the timed phase divided by its wall time.
split_s: the same run in separate passes with its phases timed: on a GPU by CUDA events (device time of copy_in, the
host-to-device copies from pinned staging; compute, the model; copy_out, the device-to-host copies), on CPU by host
timers (copy_in, preparing and wrapping the inputs; compute; copy_out, copying the outputs out and freeing handles).
device_resident_s: wall time of one run on device arrays with no host copies, synchronized (GPU only).
call_path: how each call reaches the library: "call helper" (one foreign call), or "ctypes: <why>".
provider: whose shim functions the library runs on: "cuda-runner shim" or "libtorch".
decode (--steps): a stateful loop: the --prefill method once on a prompt of --prompt-length tokens, then --warmup
untimed and --steps timed calls of the method, its position input advanced by one each call, the state (a KV cache)
kept between calls; step_s is the wall time of each timed call (copy in, model, copy out, synchronize),
tokens_per_s the timed steps divided by their wall time, positions the first and last position the timed steps used.\
"""

HIGH_SPREAD_CV = 0.10
SPLIT_RUNS = 200

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class LatencyStats:
    """Seconds per iteration."""

    count: int
    min: float
    median: float
    mean: float
    p90: float
    p95: float
    p99: float
    max: float
    stdev: float

    @property
    def cv(self) -> float:
        return self.stdev / self.mean if self.mean else 0.0

    @classmethod
    def of(cls, samples: list[float]) -> LatencyStats:
        ordered = sorted(samples)

        def percentile(fraction: float) -> float:
            return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]

        return cls(
            count=len(ordered), min=ordered[0], median=statistics.median(ordered), mean=statistics.fmean(ordered),
            p90=percentile(0.90), p95=percentile(0.95), p99=percentile(0.99), max=ordered[-1],
            stdev=statistics.pstdev(ordered) if len(ordered) > 1 else 0.0,
        )

    def to_json(self) -> dict[str, float]:
        data = {key: getattr(self, key) for key in ("count", "min", "median", "mean", "p90", "p95", "p99", "max", "stdev")}
        data["cv"] = self.cv
        return data


@dataclass(frozen=True)
class Gates:
    """Performance limits; a missed one makes `bench` exit 5. None: no limit."""

    max_p50_ms: float | None = None
    max_p99_ms: float | None = None
    min_throughput: float | None = None
    max_load_s: float | None = None


@dataclass(frozen=True)
class GateResult:
    gate: str
    figure: float
    limit: float
    passed: bool

    def describe(self) -> str:
        relation = "<=" if self.gate.startswith("max") else ">="
        return f"{self.gate}: {self.figure:.6g} {relation} {self.limit:g}: {'met' if self.passed else 'MISSED'}"

    def to_json(self) -> dict[str, Any]:
        return {"gate": self.gate, "figure": self.figure, "limit": self.limit, "passed": self.passed}


@dataclass(frozen=True)
class BenchRequest:
    bundle: Path
    inputs: InputPlan = field(default_factory=RandomInputs)
    data: Path | None = None  # an ExecuTorch program's data file (.ptd)
    method: str | None = None
    device: str | None = None
    load: LoadOptions = field(default_factory=LoadOptions)  # its warm_up is the load's one run on zeros (CUDA)
    warmup_runs: int = 10  # untimed runs after the first, before measuring
    iterations: int = 100
    duration: float | None = None  # seconds; replaces iterations
    gates: Gates = field(default_factory=Gates)
    decode: DecodeLoop | None = None  # a stateful decode loop instead of repeated calls on one input


@dataclass(frozen=True)
class DecodeLoop:
    """`bench --steps`: a decode loop (see DEFINITIONS)."""

    steps: int
    prefill: str | None = None  # a method run once first, on the prompt
    prompt_length: int = 32
    position: str | None = None  # the input advanced each step; None: the method's one position-like input


@dataclass
class DecodeResult:
    steps: LatencyStats
    timed_wall: float
    prefill_method: str | None
    prompt_length: int
    prefill_s: float | None
    position_input: str
    positions: tuple[int, int]

    @property
    def tokens_per_s(self) -> float:
        return self.steps.count / self.timed_wall if self.timed_wall > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps.count, "step_s": self.steps.to_json(), "timed_wall_s": self.timed_wall, "tokens_per_s": self.tokens_per_s,
                "prefill_method": self.prefill_method, "prompt_length": self.prompt_length if self.prefill_method else None,
                "prefill_s": self.prefill_s, "position_input": self.position_input, "positions": list(self.positions)}


@dataclass
class BenchResult:
    bundle: str
    method: str
    device: str
    load: dict[str, float]
    first_run: float
    steady: LatencyStats
    timed_wall: float  # seconds the timed phase took, start to end
    split: dict[str, LatencyStats]
    device_resident: LatencyStats | None
    input_bytes: int
    output_bytes: int
    gates: list[GateResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    call_path: str = ""
    provider: str = ""
    decode: DecodeResult | None = None

    @property
    def throughput(self) -> float:
        """Runs completed per second of the timed phase's wall time."""
        return self.steady.count / self.timed_wall if self.timed_wall > 0 else 0.0

    @property
    def verdict(self) -> str:
        return "PASSED" if all(gate.passed for gate in self.gates) else "FAILED"

    def check_gates(self, gates: Gates) -> None:
        """The gates hold against the runs measured: the decode steps in a decode loop (throughput: tokens/s)."""
        figures = {
            "max_p50_ms": self.steady.median * 1e3, "max_p99_ms": self.steady.p99 * 1e3,
            "min_throughput": self.decode.tokens_per_s if self.decode is not None else self.throughput, "max_load_s": sum(self.load.values()),
        }
        for name, figure in figures.items():
            limit = getattr(gates, name)
            if limit is not None:
                passed = figure >= limit if name.startswith("min") else figure <= limit
                self.gates.append(GateResult(name, figure, limit, passed))

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMAS["bench"],
            "bundle": self.bundle,
            "method": self.method,
            "device": self.device,
            "load_s": self.load,
            "first_run_s": self.first_run,
            "steady_s": self.steady.to_json(),
            "timed_wall_s": self.timed_wall,
            "throughput_per_s": self.throughput,
            "split_s": {name: stats.to_json() for name, stats in self.split.items()},
            "device_resident_s": None if self.device_resident is None else self.device_resident.to_json(),
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
            "call_path": self.call_path,
            "provider": self.provider,
            "decode": None if self.decode is None else self.decode.to_json(),
            "gates": [gate.to_json() for gate in self.gates],
            "verdict": self.verdict,
            "definitions": DEFINITIONS,
            "warnings": self.warnings,
        }


def _timed(function: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = function()
    return value, time.perf_counter() - started


def benchmark(request: BenchRequest, progress: Progress = lambda done, total: None, load_progress: LoadProgress | None = None) -> BenchResult:
    opened = open_for_run(request.bundle, request.data, request.method, request.load.trusted_keys, request.device)
    decode = request.decode
    try:
        inputs, _ = prepare_inputs(opened.reader, opened.method, request.inputs)
        names = [opened.method.name]
        prompt = None
        if decode is not None:
            position = position_input(opened.method, decode.position)  # refused before anything loads
            if decode.prefill is not None:
                manifest = opened.reader.manifest
                prefill = manifest.methods[choose_method(list(manifest.methods), decode.prefill)]
                prompt = prompt_inputs(prefill, decode.prompt_length, request.inputs)
                names.insert(0, prefill.name)
            _check_positions(opened.method, position, decode, request.warmup_runs)
    except BaseException:
        opened.close()
        raise
    with load_model(opened.reader, request.device, request.load, methods=names, open_seconds=opened.seconds, progress=load_progress) as model:
        if decode is None:
            result = _measure(request, model, opened.method.name, inputs.arrays, progress)
        else:
            result = _measure_decode(request, decode, model, opened.method.name, inputs.arrays, prompt, progress)
    result.check_gates(request.gates)
    return result


_POSITION_WORDS = ("pos", "position", "cache_position", "input_pos", "start_pos", "step")


def position_input(method: MethodSpec, name: str | None) -> TensorSpec:
    """The input a decode loop advances each step: `name`, else the one integer
    input of one element whose name says it is a position."""
    if name is not None:
        found = method.input(name)
        if found is None:
            raise InputError(f"method {method.name!r} has no input {name!r} to advance; it takes {', '.join(t.name for t in method.inputs)}",
                             subject="position")
        candidates = [found]
    else:
        candidates = [tensor for tensor in method.inputs if tensor.dtype in ("int64", "int32") and _one_element(tensor)
                      and any(word in tensor.name.lower() for word in _POSITION_WORDS)]
        if len(candidates) != 1:
            raise InputError(f"method {method.name!r}: cannot tell which input is the position to advance "
                             f"({', '.join(t.name for t in candidates) or 'none looks like one'})", subject="position")
    chosen = candidates[0]
    if chosen.dtype not in ("int64", "int32") or not _one_element(chosen):
        raise InputError(f"input {chosen.name!r} is {chosen.dtype} {chosen.shape_text()}, not one integer position", subject="position")
    return chosen


def _check_positions(method: MethodSpec, position: TensorSpec, decode: DecodeLoop, warmup_runs: int) -> None:
    """Refuse, before anything loads, a loop whose last step would pass the
    positions the method accepts (its KV cache), rather than fail at that step."""
    if position.bounds is None:
        return
    first = decode.prompt_length if decode.prefill is not None else 0
    last = first + warmup_runs + decode.steps  # the first call, the warm-up, then the timed steps
    low, high = position.bounds
    if first < low or last > high:
        prompt = f" after a prompt of {first}" if decode.prefill is not None else ""
        raise InputError(f"the loop would run method {method.name!r} at positions {first} to {last} (the first call, {warmup_runs} warm-up "
                         f"and {decode.steps} timed steps{prompt}); its input {position.name!r} accepts {low} to {high}, the positions of its KV "
                         f"cache: ask for fewer --steps, less --warmup{' or a shorter --prompt-length' if decode.prefill is not None else ''}",
                         subject="steps")


def _one_element(tensor: TensorSpec) -> bool:
    return all(entry == 1 for entry in tensor.shape)


def prompt_inputs(method: MethodSpec, length: int, plan: InputPlan) -> dict[str, np.ndarray]:
    """The prefill's inputs for a prompt of `length` tokens: its dynamic dims
    set to `length`, integer inputs drawn as the plan draws them (seeded), and a
    position input of `length` elements counting from 0."""
    if length < 1:
        raise InputError("--prompt-length must be at least 1", subject="prompt_length")
    shapes = {tensor.name: tuple(length if not isinstance(entry, int) else entry for entry in tensor.shape) for tensor in method.inputs}
    seed = plan.seed if isinstance(plan, RandomInputs) else 0
    ranges = plan.ranges if isinstance(plan, RandomInputs) else {}
    arrays = dict(resolve_inputs(method, RandomInputs(seed=seed, shapes=shapes, ranges=ranges)).arrays)
    for tensor in method.inputs:
        if tensor.dtype in ("int64", "int32") and any(word in tensor.name.lower() for word in _POSITION_WORDS):
            arrays[tensor.name] = np.arange(arrays[tensor.name].size, dtype=arrays[tensor.name].dtype).reshape(arrays[tensor.name].shape)
    return arrays


def _measure_decode(request: BenchRequest, decode: DecodeLoop, model: Model, name: str, arrays: dict[str, np.ndarray],
                    prompt: dict[str, np.ndarray] | None, progress: Progress) -> BenchResult:
    method = model.method(name)
    position = position_input(method.spec, decode.position)
    prefill_s = None
    start = 0
    first_outputs: dict[str, Any] = {}
    if prompt is not None and decode.prefill is not None:
        _, prefill_s = _timed(lambda: model.method(decode.prefill).run(prompt))
        start = decode.prompt_length
    step_inputs = dict(arrays)
    # One array, refilled each step: a call has read its inputs by the time it returns.
    step_inputs[position.name] = at_position = np.empty(tuple(int(size) for size in position.shape), np.dtype(position.dtype))

    def step(at: int) -> dict[str, Any]:
        at_position.fill(at)
        return method.run(step_inputs)

    at = start
    first_outputs, first_run = _timed(lambda: step(at))
    at += 1
    for _ in range(request.warmup_runs):
        step(at)
        at += 1
    samples: list[float] = []
    begun = at
    clock = time.perf_counter
    started = clock()
    for index in range(decode.steps):
        before = clock()
        step(begun + index)
        samples.append(clock() - before)
        progress(index + 1, decode.steps)
    wall = clock() - started
    stats = LatencyStats.of(samples)
    result = BenchResult(
        bundle=str(request.bundle), method=name, device=str(method.device), load=model.load_timings(name), first_run=first_run,
        steady=stats, timed_wall=wall, split={}, device_resident=None,
        input_bytes=sum(array.nbytes for array in step_inputs.values()), output_bytes=sum(array.nbytes for array in first_outputs.values()),
        call_path=method.call_path, provider=method.provider,
        decode=DecodeResult(stats, wall, decode.prefill, decode.prompt_length, prefill_s, position.name, (begun, begun + decode.steps - 1)),
    )
    if stats.cv > HIGH_SPREAD_CV:
        result.warnings.append(f"high step-to-step spread (CV {stats.cv:.0%}): other work on this machine may be interfering; measure longer")
    return result


def _measure(request: BenchRequest, model: Model, name: str, arrays: dict[str, np.ndarray], progress: Progress) -> BenchResult:
    method = model.method(name)
    outputs, first_run = _timed(lambda: method.run(arrays))
    for _ in range(request.warmup_runs):
        method.run(arrays)
    steady, wall = _steady(request, lambda: method.run(arrays), progress)
    split = {} if request.load.cuda_graph else _split(method, arrays, min(len(steady), SPLIT_RUNS))
    on_gpu = method.device.type == "cuda" and not request.load.cuda_graph
    resident = _device_resident(method, arrays, min(len(steady), 1000)) if on_gpu else None
    stats = LatencyStats.of(steady)
    result = BenchResult(
        bundle=str(request.bundle), method=name, device=str(method.device), load=model.load_timings(name), first_run=first_run,
        steady=stats, timed_wall=wall, split=split, device_resident=resident,
        input_bytes=sum(array.nbytes for array in arrays.values()), output_bytes=sum(array.nbytes for array in outputs.values()),
        call_path=method.call_path,
        provider=method.provider,
    )
    if stats.cv > HIGH_SPREAD_CV:
        result.warnings.append(f"high run-to-run spread (CV {stats.cv:.0%}): other work on this machine may be interfering; measure longer")
    return result


def _steady(request: BenchRequest, run: Callable[[], Any], progress: Progress) -> tuple[list[float], float]:
    """Per-run seconds, and the wall time of the whole timed phase."""
    samples: list[float] = []
    clock = time.perf_counter
    started = clock()
    if request.duration is not None:
        deadline = started + request.duration
        while clock() < deadline or not samples:
            samples.append(_timed(run)[1])
            progress(min(int(clock() - started), int(request.duration)), int(request.duration))
    else:
        total = max(1, request.iterations)
        for index in range(total):
            samples.append(_timed(run)[1])
            progress(index + 1, total)
    return samples, clock() - started


def _split(method: Method, arrays: dict[str, np.ndarray], runs: int) -> dict[str, LatencyStats]:
    collected: dict[str, list[float]] = {}
    for _ in range(max(1, runs)):
        phases: dict[str, float] = {}
        method.run(arrays, phases=phases)
        for name, seconds in phases.items():
            collected.setdefault(name, []).append(seconds)
    return {name: LatencyStats.of(samples) for name, samples in collected.items()}


def _device_resident(method: Method, arrays: dict[str, np.ndarray], runs: int) -> LatencyStats:
    """Per-call cost on device arrays: the number to hold against the C floor."""
    import cupy

    with cupy.cuda.Device(method.device.index):
        device_inputs = {name: cupy.asarray(array.view("uint16") if array.dtype.name == "bfloat16" else array) for name, array in arrays.items()}
    stream = method.stream
    for _ in range(10):
        method.run_device(device_inputs)
    stream.synchronize()
    samples = []
    for _ in range(max(1, runs)):
        started = time.perf_counter()
        method.run_device(device_inputs)
        stream.synchronize()
        samples.append(time.perf_counter() - started)
    return LatencyStats.of(samples)
