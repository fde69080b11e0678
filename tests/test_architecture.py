"""The structure the code promises: the library never imports the CLI, and
start-up imports stay light."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cuda_runner"


def _imports(path: Path) -> set[str]:
    """Absolute module names imported by one file of the package."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module or "")
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def test_nothing_outside_the_cli_imports_it():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "cli" in path.relative_to(PACKAGE).parts[:1] or path.name == "__main__.py":
            continue
        if any(name == "cuda_runner.cli" or name.startswith("cuda_runner.cli.") for name in _imports(path)):
            offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []


def _modules_after(*argv: str) -> list[str]:
    code = (
        "import sys\n"
        f"sys.argv = ['cuda-runner', *{list(argv)!r}]\n"
        "from cuda_runner.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'cupy', 'numpy', 'rich', 'pydantic') if m in sys.modules))\n"
    )
    # A full exit, so that the code after main() runs and can list the modules.
    environment = dict(os.environ, CUDA_RUNNER_FULL_EXIT="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environment)
    return eval(result.stdout.strip().splitlines()[-1])  # the list printed last


def test_help_loads_neither_torch_nor_cupy_nor_numpy():
    assert _modules_after("--help") == []


@pytest.mark.parametrize("command", ["inspect", "run"])
def test_inspect_and_run_help_stay_light(command):
    assert _modules_after(command, "--help") == []


def test_inspect_does_not_import_torch_or_cupy(dict_mlp_bundle):
    loaded = _modules_after("inspect", str(dict_mlp_bundle.path))
    assert "torch" not in loaded and "cupy" not in loaded
