"""Per-call cost, side by side in one run: the call helper, the ctypes path,
eager PyTorch and the C floor, on one small model (issue 14's table).

The same bundle is loaded twice (`call_helper=True` and False) and measured
in turn with eager PyTorch, over several rounds, so that drift on the
machine hits all three alike:
  - device arrays, timed like the C floor: N run_device calls, one synchronize
    at the end, mean per call (bench_floor.c is timed the same way);
  - device arrays, run + synchronize, each call timed: median and spread;
  - host arrays (NumPy in, NumPy out), each call timed: median and spread.
On CPU only the host figure applies (against eager PyTorch on CPU).

    python scripts/bench_per_call.py [--device cuda] [--iterations 1000] [--rounds 7] [--output per-call.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_compare  # scripts/ is this script's own folder

import cuda_runner

PATHS = {"helper": True, "ctypes": False}


def mean_per_call(call: Callable[[], Any], synchronize: Callable[[], Any], runs: int) -> float:
    """Mean seconds per call over `runs` calls with one synchronize at the end."""
    for _ in range(20):
        call()
    synchronize()
    started = time.perf_counter()
    for _ in range(runs):
        call()
    synchronize()
    return (time.perf_counter() - started) / runs


def each_call(call: Callable[[], Any], runs: int) -> list[float]:
    for _ in range(20):
        call()
    samples = []
    clock = time.perf_counter
    for _ in range(runs):
        started = clock()
        call()
        samples.append(clock() - started)
    return samples


def _contenders(bundle: Path, torch: Any, module: Any, array: Any, device: str) -> tuple[dict[str, dict[str, Callable[[], Any]]], list[Any]]:
    """For each contender, its calls: host (NumPy in and out), device (device
    arrays, no synchronize) and the synchronize that completes a device call."""
    models = [cuda_runner.load(bundle, device=device, call_helper=flag) for flag in PATHS.values()]
    contenders: dict[str, dict[str, Callable[[], Any]]] = {}
    for label, model in zip(PATHS, models):
        method = model.method()
        assert method.call_path.startswith("call helper" if PATHS[label] else "ctypes"), method.call_path
        name = method.spec.inputs[0].name
        calls: dict[str, Callable[[], Any]] = {"host": lambda method=method, name=name: method.run({name: array})}
        if device == "cuda":
            import cupy

            resident = {name: cupy.asarray(array)}
            calls["device"] = lambda method=method, resident=resident: method.run_device(resident)
            calls["synchronize"] = method.stream.synchronize
        contenders[label] = calls
    module = module.to(device)
    host = torch.from_numpy(array)
    on_device = host.to(device)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def eager_host():
        with torch.no_grad():
            return module(host.to(device)).cpu()

    def eager_device():
        with torch.no_grad():
            return module(on_device)

    contenders["eager"] = {"host": eager_host}
    if device == "cuda":
        contenders["eager"].update(device=eager_device, synchronize=synchronize)
    return contenders, models


def measure(bundle: Path, torch: Any, module: Any, array: Any, device: str, iterations: int, rounds: int) -> dict[str, Any]:
    """Every contender in every round, in turn, so that drift on the machine hits all alike."""
    contenders, models = _contenders(bundle, torch, module, array, device)
    try:
        results: dict[str, dict[str, list[float]]] = {label: {} for label in contenders}
        for _ in range(rounds):
            for label, calls in contenders.items():
                collected = results[label]
                collected.setdefault("host", []).extend(each_call(calls["host"], iterations))
                if "device" in calls:
                    device_call, synchronize = calls["device"], calls["synchronize"]

                    def with_synchronize(device_call=device_call, synchronize=synchronize):
                        device_call()
                        synchronize()

                    collected.setdefault("device_sync", []).extend(each_call(with_synchronize, iterations))
                    collected.setdefault("device_like_floor", []).append(mean_per_call(device_call, synchronize, iterations))
        return {label: {kind: _summary(kind, samples) for kind, samples in collected.items()} for label, collected in results.items()}
    finally:
        for model in models:
            model.close()


def _summary(kind: str, samples: list[float]) -> dict[str, Any]:
    if kind == "device_like_floor":
        return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples), "note": "median of each round's mean per call"}
    return bench_compare.spread(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--iterations", type=int, default=1000, help="calls per contender and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--output", type=Path)
    options = parser.parse_args()
    import torch

    work = Path(tempfile.mkdtemp(prefix="cuda-runner-percall-"))
    module, args = bench_compare.build_models(torch)["mlp"]
    bundle = bench_compare.compile_bundle(torch, "mlp", module, args, options.device, work)
    array = args[0].numpy()
    report: dict[str, Any] = {
        "machine": bench_compare.machine_info(torch, options.device),
        "model": "mlp: Linear 256->1024, ReLU, Linear 1024->256 on 8x256 float32",
        "iterations": options.iterations,
        "c_floor_s": bench_compare.c_floor(bundle, options.device, array, work, 5000),
        "rounds": options.rounds,
        "contenders": measure(bundle, torch, module, array, options.device, options.iterations, options.rounds),
    }
    bench_compare.write_report(report, options.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
