"""The path a `cuda-runner run` request takes through the package's modules.

Runs the CLI in this process on a CPU bundle (compiled here, or given) with a
profiler hook that records every call into a cuda_runner function, then
reports, for the sequence of modules entered (repeats in a row collapsed):

- rooms: distinct modules entered;
- doors: distinct (caller module, callee module) pairs;
- returns: entries into a module the path had already left;
- climbs: calls whose caller is in a lower layer than the callee (callbacks
  and late imports the layer rule does not see), as distinct pairs;
- the sequence itself, with `--show`.

The CLI's own modules and the start-up import are left out: the path begins
when the run command starts. So is code that runs because a module is being
imported (module and class bodies, decorators, tables built at import), which
the request's own calls do not choose: the lazy imports of a run would
otherwise count each module imported on the way as a room (a finaliser that
garbage collection happens to run during an import is left out with them).
`--with-imports` counts them too, as the figures before 2026-12-02 did. Layers are those of
tests/test_architecture.py.

With `--by unit`, modules are grouped into the units the layer rule knows
(errors, format, io, runtime, commands, ...), as the older layout's root
modules are mapped to where they live now, so that two checkouts compare.

    python scripts/trace_run_path.py [--bundle B.bundle] [--by module|unit] [--with-imports] [--show]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # where the layer rule lives
from test_architecture import LAYERS as NAMED_LAYERS  # the layer rule, in one place

LAYERS = [units for _, units in NAMED_LAYERS]
# Before the modules were put in layers (for tracing an older checkout side by side).
OLD_UNITS = {"validation": "format", "signing": "format", "running": "commands", "bench": "commands", "batch": "commands",
             "stacking": "commands", "inspection": "commands"}


def unit_of(module: str) -> str:
    parts = module.split(".")
    return OLD_UNITS.get(parts[1], parts[1]) if len(parts) > 1 else "__init__"


def layer_of(name: str) -> int:
    """The layer of a module name, or of a unit name (--by unit)."""
    unit = unit_of(name) if name.startswith("cuda_runner") else name
    return next((index for index, units in enumerate(LAYERS) if unit in units), len(LAYERS))


def compile_bundle(folder: Path) -> Path:
    import torch

    import cuda_runner

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x))

    path = folder / "traced.bundle"
    cuda_runner.compile_module(Model().eval(), (torch.randn(2, 16),), path, device="cpu")
    return path


_IMPORT_MACHINERY = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")


def _importing(frame: Any) -> bool:
    """Whether `frame` runs inside an import (any caller is the import machinery)."""
    caller = frame.f_back
    while caller is not None:
        if caller.f_code.co_filename in _IMPORT_MACHINERY:
            return True
        caller = caller.f_back
    return False


def trace(argv: list[str], with_imports: bool = False) -> tuple[list[str], set[tuple[str, str]]]:
    """The modules entered, in order, and the (caller, callee) module pairs, while the CLI runs `argv`."""
    entered: list[str] = []
    doors: set[tuple[str, str]] = set()

    def hook(frame, event, _arg):  # type: ignore[no-untyped-def]
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("cuda_runner.") or module.startswith("cuda_runner.cli"):
            return
        if not with_imports and _importing(frame):
            return
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        if caller.startswith("cuda_runner.") and caller != module:
            doors.add((caller, module))
        if not entered or entered[-1] != module:
            entered.append(module)

    from cuda_runner.cli.main import main

    os.environ["CUDA_RUNNER_FULL_EXIT"] = "1"  # return from main() instead of ending the process at once
    sys.argv = ["cuda-runner", *argv]
    sys.setprofile(hook)
    try:
        main()
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    return entered, doors


def summarise(path: list[str], doors: set[tuple[str, str]]) -> dict[str, int]:
    seen: set[str] = set()
    returns = 0
    for module in path:
        returns += module in seen
        seen.add(module)
    climbs = sum(1 for caller, callee in doors if layer_of(callee) > layer_of(caller))
    return {"rooms": len(seen), "doors": len(doors), "entries": len(path), "returns": returns, "climbs": climbs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, help="a CPU bundle with one input x of [2, 16] float32 (default: compile one)")
    parser.add_argument("--show", action="store_true", help="print the sequence of modules")
    parser.add_argument("--by", choices=("module", "unit"), default="module", help="count modules, or the units of the layer rule")
    parser.add_argument("--with-imports", action="store_true", help="count code run by imports too (module bodies, decorators)")
    options = parser.parse_args()
    import numpy as np

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        bundle = options.bundle or compile_bundle(folder)
        np.save(folder / "x.npy", np.ones((2, 16), np.float32))
        path, doors = trace(["run", str(bundle), "--inputs", f"x={folder / 'x.npy'}", "--out-dir", str(folder / "out"), "--device", "cpu", "-q"],
                            options.with_imports)
    if options.by == "unit":
        collapsed: list[str] = []
        for module in (unit_of(module) for module in path):
            if not collapsed or collapsed[-1] != module:
                collapsed.append(module)
        path = collapsed
        doors = {(unit_of(caller), unit_of(callee)) for caller, callee in doors if unit_of(caller) != unit_of(callee)}
    figures = summarise(path, doors)
    print(f"run, by {options.by}: {figures['rooms']} rooms, {figures['doors']} doors, {figures['entries']} entries, "
          f"{figures['returns']} returns to rooms already left, {figures['climbs']} climbs to a higher layer")
    if options.show:
        for module in path:
            print(f"  {module}")
        for caller, callee in sorted(doors):
            print(f"  {caller} -> {callee}{'  (climb)' if layer_of(callee) > layer_of(caller) else ''}")


if __name__ == "__main__":
    main()
