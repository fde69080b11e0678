"""Per-call cost of the library's own input checks (check_inputs), side by side in one run.

The same bundle is loaded twice in one process, with and without the checks,
and the two are timed in alternating rounds so that drift hits both alike.

    python scripts/bench_checks.py --device cpu [--rounds 7 --runs 2000] [--output checks.json]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import bench_compare  # scripts/ is this script's own folder

import cuda_runner


def per_call(method: object, inputs: dict, runs: int) -> float:
    started = time.perf_counter()
    for _ in range(runs):
        method.run(inputs)  # type: ignore[attr-defined]
    return (time.perf_counter() - started) / runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--output", type=Path)
    options = parser.parse_args()
    import torch

    work = Path(tempfile.mkdtemp(prefix="cuda-runner-checks-"))
    module, args = bench_compare.build_models(torch)["mlp"]
    bundle = bench_compare.compile_bundle(torch, "mlp", module, args, options.device, work)
    inputs = {"input": args[0].numpy()}
    samples: dict[str, list[float]] = {"unchecked": [], "checked": []}
    with cuda_runner.load(bundle) as plain, cuda_runner.load(bundle, check_inputs=True) as checked:
        methods = {"unchecked": plain.method(), "checked": checked.method()}
        for method in methods.values():
            per_call(method, inputs, 100)  # warm-up, and the first run that fixes the checks on or off
        for _ in range(options.rounds):
            for name, method in methods.items():
                samples[name].append(per_call(method, inputs, options.runs))
    report = {
        "machine": platform.node(), "device": options.device, "rounds": options.rounds, "runs_per_round": options.runs,
        **{name: {"median_us": statistics.median(values) * 1e6, "min_us": min(values) * 1e6, "max_us": max(values) * 1e6}
           for name, values in samples.items()},
    }
    report["added_us"] = report["checked"]["median_us"] - report["unchecked"]["median_us"]
    bench_compare.write_report(report, options.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
