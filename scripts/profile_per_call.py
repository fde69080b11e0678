"""Where the Python layer spends a call (GPU): cProfile over run_device and run on a small MLP.

    python scripts/profile_per_call.py [--calls 5000]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import bench_compare  # scripts/ is this script's own folder

import cuda_runner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    options = parser.parse_args()
    import cupy
    import torch

    work = Path(tempfile.mkdtemp(prefix="cuda-runner-profile-"))
    module, args = bench_compare.build_models(torch)["mlp"]
    bundle = bench_compare.compile_bundle(torch, "mlp", module, args, "cuda", work)
    array = args[0].numpy()
    with cuda_runner.load(bundle) as model:
        method = model.method()
        name = method.spec.inputs[0].name
        resident = {name: cupy.asarray(array)}
        for label, call in (("run_device", lambda: method.run_device(resident)), ("run", lambda: method.run({name: array}))):
            for _ in range(200):
                call()
            method.stream.synchronize()
            started = time.perf_counter()
            for _ in range(options.calls):
                call()
            method.stream.synchronize()
            print(f"{label}: {(time.perf_counter() - started) / options.calls * 1e6:.1f} us per call (one synchronize at the end)")
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(options.calls):
                call()
            method.stream.synchronize()
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
            print(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
