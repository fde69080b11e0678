"""The structure the code promises: layers that import only downwards, the
library never importing the CLI, and start-up imports that stay light."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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


# Lowest first. A unit (a root module, or a subpackage) may import from its
# own layer and the layers below, never from one above (docs/architecture.md).
LAYERS: list[tuple[str, set[str]]] = [
    ("foundations", {"errors", "arrays", "files", "version"}),
    ("format", {"format"}),
    ("data", {"io", "verify", "report"}),
    ("runtime", {"runtime"}),
    ("compile", {"compile"}),
    ("commands", {"commands"}),
    ("interfaces", {"cli", "ray", "__init__", "__main__"}),
]


def _unit(module: str) -> str:
    """The layer unit of an absolute module name: cuda_runner.format.bundle -> format."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(unit: str) -> int:
    for index, (_, units) in enumerate(LAYERS):
        if unit in units:
            return index
    raise AssertionError(f"{unit!r} is in no layer: add it to LAYERS (and to docs/architecture.md)")


def layer_violations(edges: set[tuple[str, str]]) -> list[str]:
    """The (importer unit, imported unit) pairs that climb to a higher layer."""
    return sorted(f"{importer} ({LAYERS[_layer(importer)][0]}) imports {imported} ({LAYERS[_layer(imported)][0]})"
                  for importer, imported in edges if _layer(imported) > _layer(importer))


def _package_edges() -> set[tuple[str, str]]:
    edges = set()
    for path in PACKAGE.rglob("*.py"):
        importer = _unit(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        for name in _imports(path):
            # A bare "cuda_runner" is only the prefix of a longer name (from . import x), also found.
            if name.startswith("cuda_runner.") and _unit(name) not in ("cuda_runner", importer):
                imported = _unit(name)
                if imported in {unit for _, units in LAYERS for unit in units} or (PACKAGE / imported).is_dir() or (PACKAGE / f"{imported}.py").exists():
                    edges.add((importer, imported))
    return edges


def test_every_import_goes_down_the_layers():
    assert layer_violations(_package_edges()) == []


def test_the_layer_check_catches_a_climb():
    """The rule itself: a format module importing the runtime would be refused."""
    assert layer_violations({("format", "runtime"), ("runtime", "format")}) == ["format (format) imports runtime (runtime)"]


def test_every_module_of_the_package_is_in_a_layer():
    units = {path.stem if path.is_file() else path.name for path in PACKAGE.iterdir() if (path.suffix == ".py" or (path / "__init__.py").exists())}
    for unit in units:
        _layer(unit)


def test_nothing_outside_the_cli_imports_it():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "cli" in path.relative_to(PACKAGE).parts[:1] or path.name == "__main__.py":
            continue
        if any(name == "cuda_runner.cli" or name.startswith("cuda_runner.cli.") for name in _imports(path)):
            offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []


# Heavy imports, and the standard modules a run of an unsigned bundle does not
# need (hashlib and _hashlib, which load OpenSSL, socket, secrets, tempfile:
# about 20 ms of start-up).
WATCHED = ("torch", "cupy", "numpy", "rich", "pydantic", "hashlib", "_hashlib", "socket", "secrets", "tempfile", "ml_dtypes")


def _modules_after(*argv: str) -> list[str]:
    code = (
        "import sys\n"
        f"sys.argv = ['cuda-runner', *{list(argv)!r}]\n"
        "from cuda_runner.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {WATCHED!r} if m in sys.modules))\n"
    )
    # A full exit, so that the code after main() runs and can list the modules;
    # none of the caller's cuda-runner settings (trusted keys, a provider).
    environment = {key: value for key, value in os.environ.items() if not key.startswith("CUDA_RUNNER_")}
    environment["CUDA_RUNNER_FULL_EXIT"] = "1"
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


def test_a_run_of_an_unsigned_bundle_loads_neither_openssl_nor_socket_nor_tempfile(dict_mlp_bundle, tmp_path):
    np.save(tmp_path / "x.npy", np.ones((2, 16), np.float32))
    np.save(tmp_path / "bias.npy", np.zeros(8, np.float32))
    loaded = _modules_after("run", str(dict_mlp_bundle.path), "--provider", "shim", "--inputs", str(tmp_path / "x.npy"),
                            "--inputs", str(tmp_path / "bias.npy"), "--out-dir", str(tmp_path / "out"))
    assert (tmp_path / "out" / "logits.npy").is_file()
    assert loaded == ["numpy"]


def test_random_float32_inputs_do_not_load_ml_dtypes(dict_mlp_bundle, tmp_path):
    """ml_dtypes is for bfloat16 only: importing it costs over 1 s of CPU (0.7 registers NumPy loops for many types)."""
    loaded = _modules_after("run", str(dict_mlp_bundle.path), "--provider", "shim", "--random-inputs", "--range", "x=-1:1",
                            "--out-dir", str(tmp_path / "out"))
    assert (tmp_path / "out" / "logits.npy").is_file()
    assert "numpy" in loaded and "ml_dtypes" not in loaded  # (NumPy's random module brings hashlib and secrets)
