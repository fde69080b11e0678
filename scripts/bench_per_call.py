"""Per-call overhead on device arrays against the C floor, in one run (GPU).

Both sides are timed the same way: N calls, one synchronize at the end, mean per call.

    python scripts/bench_per_call.py [--iterations 5000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import bench_compare  # scripts/ is this script's own folder

import cuda_runner


def device_resident_throughput(method: object, device_inputs: dict, runs: int) -> float:
    """Mean seconds per run_device call over `runs` calls with one synchronize at the
    end: measured like the C floor (bench_floor.c), so the two compare directly."""
    stream = method.stream  # type: ignore[attr-defined]
    for _ in range(10):
        method.run_device(device_inputs)  # type: ignore[attr-defined]
    stream.synchronize()
    started = time.perf_counter()
    for _ in range(runs):
        method.run_device(device_inputs)  # type: ignore[attr-defined]
    stream.synchronize()
    return (time.perf_counter() - started) / runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--output", type=Path)
    options = parser.parse_args()
    import cupy
    import torch

    work = Path(tempfile.mkdtemp(prefix="cuda-runner-percall-"))
    module, args = bench_compare.build_models(torch)["mlp"]
    bundle = bench_compare.compile_bundle(torch, "mlp", module, args, "cuda", work)
    array = args[0].numpy()
    floor = bench_compare.c_floor(bundle, "cuda", array, work, options.iterations)
    with cuda_runner.load(bundle) as model:
        method = model.method()
        inputs = {method.spec.inputs[0].name: cupy.asarray(array)}
        api = [device_resident_throughput(method, inputs, options.iterations) for _ in range(3)]
    report = {
        "iterations": options.iterations,
        "c_floor_s": floor,
        "api_run_device_s": {"median": statistics.median(api), "min": min(api), "max": max(api), "n": 3},
    }
    report["overhead_over_floor_s"] = report["api_run_device_s"]["median"] - floor["per_call"]["median"] if "per_call" in floor else None
    bench_compare.write_report(report, options.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
