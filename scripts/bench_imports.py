"""What importing a module costs a cold process, beside `import numpy` alone.

Each contender is a fresh `python -c "import ..."`, run in turns (numpy, then
each module after numpy, again), so that a busy moment of the machine falls
on all of them alike; prints the median and the spread of each one's CPU
(user + system, from the kernel) and wall time, and the module's version.

    python scripts/bench_imports.py [--rounds 9] [MODULE ...]   (default: ml_dtypes)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import subprocess
import sys
import time


def cold(code: str) -> tuple[float, float]:
    """(CPU s, wall s) of one fresh interpreter running `code`."""
    before = os.times()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    wall = time.perf_counter() - start
    after = os.times()
    return after.children_user - before.children_user + after.children_system - before.children_system, wall


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def version(module: str) -> str:
    try:
        return importlib.metadata.version(module.split(".")[0].replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", default=["ml_dtypes"])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    contenders = {"numpy": "import numpy", **{f"numpy + {module}": f"import numpy, {module}" for module in args.modules}}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, code in contenders.items():
            results[name].append(cold(code))
    print(f"python {sys.version.split()[0]}, numpy {version('numpy')}, {os.cpu_count()} CPUs; {args.rounds} cold processes each")
    print("| process | CPU s | wall s |\n| --- | --- | --- |")
    for name, runs in results.items():
        label = name if name == "numpy" else f"{name} {version(name.split(' + ')[1])}"
        print(f"| {label} | {spread([cpu for cpu, _ in runs])} | {spread([wall for _, wall in runs])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
