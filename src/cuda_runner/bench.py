"""`cuda-runner bench` as a library call: load phases, first run, steady state and its split.

What each number includes:
- load.open: opening the bundle and checking its header, manifest checksum and layout;
- load.libtorch: loading libtorch's shim libraries (once per process);
- load.verify_library: copying the library segment and checking its digest;
- load.library: writing the library to a memfd and dlopening it;
- load.container: creating the AOTInductor container;
- load.weights: feeding the weights blob to the device (its digest is checked on other threads meanwhile);
- load.verify_weights_wait: waiting, after that, for the weights digest to finish (absent with verify_weights=False);
- first_run: the first host-to-host run (it also loads the kernels);
- steady: wall time of one host-to-host run (copy in, model, copy out, synchronize), after warm-up;
- split: the same run in separate passes with its phases timed: on a GPU by CUDA events (device time of
  copy_in, the host-to-device copies from pinned staging; compute, the model; copy_out, the device-to-host
  copies), on CPU by host timers (copy_in, preparing and wrapping the inputs; compute; copy_out, copying
  the outputs out and freeing their handles);
- device_resident: wall time of one run on device arrays with no host copies, synchronized (GPU only).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .format.bundle import open_bundle
from .running import RunRequest, gather_inputs, select_method
from .runtime.devices import choose_device
from .runtime.method import Method
from .runtime.shim import load_shim

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
            return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]

        return cls(
            count=len(ordered), min=ordered[0], median=statistics.median(ordered), mean=statistics.fmean(ordered),
            p90=percentile(0.90), p95=percentile(0.95), p99=percentile(0.99), max=ordered[-1],
            stdev=statistics.pstdev(ordered) if len(ordered) > 1 else 0.0,
        )

    def to_json(self) -> dict[str, float]:
        data = {key: getattr(self, key) for key in ("count", "min", "median", "mean", "p90", "p95", "p99", "max", "stdev")}
        data["cv"] = self.cv
        return data


@dataclass
class BenchRequest:
    run: RunRequest
    warmup: int = 10
    iterations: int | None = 100
    duration: float | None = None  # seconds; replaces iterations


@dataclass
class BenchResult:
    bundle: str
    method: str
    device: str
    load: dict[str, float]
    first_run: float
    steady: LatencyStats
    split: dict[str, LatencyStats]
    device_resident: LatencyStats | None
    input_bytes: int
    output_bytes: int
    warnings: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Host-to-host runs per second at the median."""
        return 1.0 / self.steady.median if self.steady.median else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "cuda-runner/bench/1",
            "bundle": self.bundle,
            "method": self.method,
            "device": self.device,
            "load_s": self.load,
            "first_run_s": self.first_run,
            "steady_s": self.steady.to_json(),
            "throughput_per_s": self.throughput,
            "split_s": {name: stats.to_json() for name, stats in self.split.items()},
            "device_resident_s": None if self.device_resident is None else self.device_resident.to_json(),
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
            "definitions": __doc__.split("What each number includes:", 1)[1].strip(),
            "warnings": self.warnings,
        }


def _timed(function: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = function()
    return value, time.perf_counter() - started


def benchmark(request: BenchRequest, progress: Progress = lambda done, total: None) -> BenchResult:
    reader, load = None, {}
    reader, load["open"] = _timed(lambda: open_bundle(request.run.bundle))
    try:
        spec = select_method(reader, request.run.method)
        inputs, _ = gather_inputs(reader, spec, request.run)
        device = choose_device([spec], request.run.device)
        _, load["libtorch"] = _timed(lambda: load_shim(device.type))
        method = Method.load(reader, spec, device, verify_weights=request.run.verify_weights, cuda_graph=request.run.cuda_graph)
    except BaseException:
        reader.close()
        raise
    renamed = {
        "verify": "verify_library", "load_library": "library", "create_container": "container", "load_weights": "weights",
        "verify_weights_wait": "verify_weights_wait", "capture_graph": "capture_graph",
    }
    load.update({renamed[key]: value for key, value in method.load_timings.items()})
    try:
        return _measure(request, method, inputs.arrays, load, progress)
    finally:
        method.close()
        reader.close()


def _measure(request: BenchRequest, method: Method, arrays: dict, load: dict[str, float], progress: Progress) -> BenchResult:
    outputs, first_run = _timed(lambda: method.run(arrays))
    for _ in range(request.warmup):
        method.run(arrays)
    steady = _steady(request, lambda: method.run(arrays), progress)
    split = {} if request.run.cuda_graph else _split(method, arrays, min(len(steady), SPLIT_RUNS))
    resident = _device_resident(method, arrays, min(len(steady), 1000)) if method.device.type == "cuda" and not request.run.cuda_graph else None
    stats = LatencyStats.of(steady)
    result = BenchResult(
        bundle=str(request.run.bundle), method=method.spec.name, device=str(method.device), load=load, first_run=first_run,
        steady=stats, split=split, device_resident=resident,
        input_bytes=sum(array.nbytes for array in arrays.values()), output_bytes=sum(array.nbytes for array in outputs.values()),
    )
    if stats.cv > HIGH_SPREAD_CV:
        result.warnings.append(f"high run-to-run spread (CV {stats.cv:.0%}): other work on this machine may be interfering; use more iterations or --duration")
    return result


def _steady(request: BenchRequest, run: Callable[[], Any], progress: Progress) -> list[float]:
    samples: list[float] = []
    clock = time.perf_counter
    if request.duration is not None:
        deadline = clock() + request.duration
        while clock() < deadline:
            samples.append(_timed(run)[1])
            progress(min(int(request.duration - (deadline - clock())), int(request.duration)), int(request.duration))
    else:
        total = max(1, request.iterations or 1)
        for index in range(total):
            samples.append(_timed(run)[1])
            progress(index + 1, total)
    return samples or [_timed(run)[1]]


def _split(method: Method, arrays: dict, runs: int) -> dict[str, LatencyStats]:
    collected: dict[str, list[float]] = {}
    for _ in range(max(1, runs)):
        phases: dict[str, float] = {}
        method.run(arrays, phases=phases)
        for name, seconds in phases.items():
            collected.setdefault(name, []).append(seconds)
    return {name: LatencyStats.of(samples) for name, samples in collected.items()}


def _device_resident(method: Method, arrays: dict, runs: int) -> LatencyStats:
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


def device_resident_throughput(method: Method, device_inputs: dict, runs: int) -> float:
    """Mean seconds per run_device call over `runs` calls with one synchronize at the
    end: measured like the C floor (scripts/bench_floor.c), so the two compare directly."""
    stream = method.stream
    for _ in range(10):
        method.run_device(device_inputs)
    stream.synchronize()
    started = time.perf_counter()
    for _ in range(runs):
        method.run_device(device_inputs)
    stream.synchronize()
    return (time.perf_counter() - started) / runs
