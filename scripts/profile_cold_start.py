"""Where a cold `cuda-runner run` spends its time, and what overlapping would save (GPU).

Each step runs in fresh processes (median of --repeats): the interpreter alone,
numpy, the CLI's imports, libtorch's CUDA libraries, the CUDA context, both one
after the other, both at once (the context on a thread started first), and the
whole CLI run of a small bundle.

    python scripts/profile_cold_start.py --bundle m.bundle --input x.npy --output cold.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONTEXT = "from cupy_backends.cuda.api import runtime; runtime.setDevice(0); runtime.free(0)"
LIBTORCH = "from cuda_runner.runtime.shim import load_shim; load_shim('cuda')"
STEPS = {
    "interpreter": "pass",
    "numpy": "import numpy",
    "cli_imports": "import cuda_runner.cli.main, cuda_runner.commands.running",
    "libtorch_cuda": LIBTORCH,
    "cuda_context": CONTEXT,
    "libtorch_then_context": f"{LIBTORCH}; {CONTEXT}",
    "context_on_a_thread_while_libtorch_loads": (
        "import threading\n"
        f"thread = threading.Thread(target=lambda: exec({CONTEXT!r})); thread.start()\n"
        f"{LIBTORCH}\n"
        "thread.join()"
    ),
}


def timed(argv: list[str], repeats: int) -> dict[str, float]:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        samples.append(time.perf_counter() - started)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples), "n": repeats}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path)
    options = parser.parse_args()
    report = {name: timed([sys.executable, "-c", code], options.repeats) for name, code in STEPS.items()}
    for warm_up in (True, False):
        code = (
            "import time, numpy as np, cuda_runner\n"
            f"x = np.load({str(options.input)!r}); started = time.perf_counter()\n"
            f"model = cuda_runner.load({str(options.bundle)!r}, warm_up={warm_up}); loaded = time.perf_counter()\n"
            "model.run([x]); ran = time.perf_counter()\n"
            "print(loaded - started, ran - loaded)"
        )
        rounds = [subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split() for _ in range(options.repeats)]
        report[f"load_and_first_run_warm_up_{warm_up}"] = {
            "load_median_s": statistics.median(float(load) for load, _ in rounds),
            "first_run_median_s": statistics.median(float(first) for _, first in rounds), "n": options.repeats,
        }
    report["cli_run"] = timed([sys.executable, "-m", "cuda_runner", "run", str(options.bundle), "-i", str(options.input), "-q"], options.repeats)
    print(json.dumps(report, indent=1))
    if options.output:
        options.output.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
