"""A second, small Python environment with no torch installed at all, in which
the real command line runs CPU bundles and ExecuTorch programs on cuda-runner's
own shim and matches eager PyTorch.

The environment is a venv made without pip whose site-packages holds links to
exactly the installed distributions cuda-runner needs at run time (the closure
of its requirements that no extra asks for), and cuda_runner itself from the
source tree through a .pth file. torch is not blocked there: it is absent. The
bundles and references are made here, in the test environment, with torch.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from et_writer import MethodPlan, TensorValue, write_program

import cuda_runner
from cuda_runner.arrays import SCALAR_TYPE_CODES
from cuda_runner.format.bundle import open_bundle, write_bundle
from cuda_runner.format.elf import read_library_facts, rename_imports
from cuda_runner.runtime.providers import own_shim_path

pytestmark = pytest.mark.skipif(own_shim_path() is None, reason="the shim is built by pip install (scripts/test.sh)")

SOURCE_TREE = Path(cuda_runner.__file__).resolve().parent.parent
STANDINS = Path(__file__).resolve().parent.parent / "data" / "executorch"
FLOAT32 = SCALAR_TYPE_CODES["float32"]


def _name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def _wanted(requirement: str) -> bool:
    """Whether a requirement applies with no extra chosen (its marker, if any, holds)."""
    _, _, marker = requirement.partition(";")
    if not marker.strip():
        return True
    if "extra" in marker:
        return False
    try:
        from packaging.markers import Marker
    except ImportError:  # no packaging: keep it when installed, which can only add a distribution
        return True
    return Marker(marker).evaluate()


def runtime_closure() -> list[importlib.metadata.Distribution]:
    """The installed distributions cuda-runner needs at run time, by its
    requirements (pyproject's dependencies) and theirs, extras left out."""
    try:
        roots = importlib.metadata.distribution("cuda-runner").requires or []
    except importlib.metadata.PackageNotFoundError:
        import tomllib

        roots = tomllib.loads((SOURCE_TREE / "pyproject.toml").read_text())["project"]["dependencies"]
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = [requirement for requirement in roots if _wanted(requirement)]
    while pending:
        name = _name(pending.pop())
        if name in found:
            continue
        try:
            found[name] = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency of a dependency, not installed here
        pending += [requirement for requirement in found[name].requires or [] if _wanted(requirement)]
    return list(found.values())


def top_level_paths(distribution: importlib.metadata.Distribution) -> set[Path]:
    """The files and folders a distribution put directly in site-packages (its
    RECORD), including its .dist-info; not scripts or data installed elsewhere."""
    tops = set()
    for file in distribution.files or []:
        parts = Path(file).parts
        if not parts or parts[0] in ("..", "__pycache__") or file.name.endswith(".pth"):
            continue
        tops.add(Path(distribution.locate_file(parts[0])))
    return tops


@pytest.fixture(scope="module")
def python(tmp_path_factory) -> Path:
    """The interpreter of a venv holding only cuda-runner and what it runs with."""
    venv = tmp_path_factory.mktemp("no-torch-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    interpreter = venv / "bin" / "python"
    site = Path(subprocess.run([str(interpreter), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    distributions = runtime_closure()
    names = {_name(distribution.metadata["Name"]) for distribution in distributions}
    assert "torch" not in names and {"numpy", "typer", "rich", "xxhash", "ml-dtypes"} <= names
    for distribution in distributions:
        for top in top_level_paths(distribution):
            if top.exists() and not (site / top.name).exists():
                (site / top.name).symlink_to(top)
    (site / "cuda_runner_source.pth").write_text(f"{SOURCE_TREE}\n")
    return interpreter


def in_env(python: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """A command of that interpreter, with none of this environment's paths (its
    bytecode settings kept: CI writes bytecode outside the source tree)."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONSAFEPATH")
    env = {key: value for key, value in os.environ.items() if key not in dropped and not key.startswith("CUDA_RUNNER_")}
    env.update(NO_COLOR="1", PYTHONNOUSERSITE="1")
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def cli(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return in_env(python, "-m", "cuda_runner", *args, cwd=cwd)


def test_torch_is_not_installed_there_and_cuda_runner_is_this_tree(python, tmp_path):
    probe = ("import importlib.util, json, cuda_runner, numpy\n"
             "try:\n    import torch\n    error = None\nexcept ImportError as caught:\n    error = type(caught).__name__\n"
             "print(json.dumps([error, importlib.util.find_spec('torch') is None, cuda_runner.__file__]))\n")
    done = in_env(python, "-c", probe, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    error, no_spec, where = json.loads(done.stdout)
    assert error == "ModuleNotFoundError" and no_spec
    assert Path(where).resolve().parent.parent == SOURCE_TREE


def test_devices_says_libtorch_is_absent_and_the_shim_is_built(python, tmp_path):
    done = cli(python, "devices", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["libtorch"] is None
    assert report["own_shim"] == own_shim_path().name


def _inputs(batch: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {"x": rng.standard_normal((batch, 16), dtype=np.float32), "bias": rng.standard_normal(8, dtype=np.float32)}


def _eager(compiled_model, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = compiled_model.eager(arrays["x"], arrays["bias"])
    return {"logits": out["logits"].numpy(), "aux.loss": out["aux"]["loss"].numpy(), "aux.hidden": out["aux"]["hidden"].numpy()}


@pytest.mark.heavy
def test_a_standalone_cpu_bundle_runs_and_matches_eager(python, dict_mlp_bundle, tmp_path):
    """dict_mlp's CPU bundle is what `compile --device cpu --standalone` writes
    (for the CPU the flag only adds the check that the shim serves every import,
    asserted here), so the session's fixture stands for it."""
    library = _library(dict_mlp_bundle.path)
    from cuda_runner.runtime.providers import missing_from_own_shim

    assert missing_from_own_shim([read_library_facts(library)]) == []
    arrays = _inputs()
    np.savez(tmp_path / "in.npz", **arrays)
    np.savez(tmp_path / "ref.npz", **_eager(dict_mlp_bundle, arrays))
    # provider auto, as a user runs it: with no libtorch installed, the shim serves it
    done = cli(python, "run", str(dict_mlp_bundle.path), "--inputs", "in.npz", "--expected", "ref.npz", "--atol", "1e-5", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "VERDICT: PASSED" in done.stdout


def _library(bundle: Path) -> bytes:
    with open_bundle(bundle) as reader:
        return bytes(reader.read_verified(reader.manifest.methods["forward"].library_segment))


@pytest.mark.heavy
def test_an_executorch_program_around_a_session_library_runs_and_matches_eager(python, dict_mlp_bundle, tmp_path):
    """The stand-ins below need the CPU they were built on; this program (G2
    layout, host/device copies around the call, written by tests/et_writer.py)
    holds a library built for this machine, so the ExecuTorch path is checked everywhere."""
    with open_bundle(dict_mlp_bundle.path) as reader:
        blob = bytes(reader.segment("forward_weights_blob"))
    inputs = [TensorValue(FLOAT32, (64, 16), 1), TensorValue(FLOAT32, (8,))]
    outputs = [TensorValue(FLOAT32, (64, 8), 1), TensorValue(FLOAT32, ()), TensorValue(FLOAT32, (64, 32), 1)]
    pte, ptd = write_program([MethodPlan("forward", _library(dict_mlp_bundle.path), inputs, outputs, weights_blob=blob, copies=True)], "G2")
    (tmp_path / "model.pte").write_bytes(pte)
    (tmp_path / "aoti_cuda_blob.ptd").write_bytes(ptd)
    arrays = _inputs(7)
    eager = _eager(dict_mlp_bundle, arrays)
    np.savez(tmp_path / "in.npz", input_0=arrays["x"], input_1=arrays["bias"])
    np.savez(tmp_path / "ref.npz", output_0=eager["logits"], output_1=eager["aux.loss"], output_2=eager["aux.hidden"])
    done = cli(python, "run", "model.pte", "--data", "aoti_cuda_blob.ptd", "--inputs", "in.npz", "--expected", "ref.npz", "--atol", "1e-5", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "VERDICT: PASSED" in done.stdout


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


@pytest.mark.parametrize("folder", ["standin_g2", "standin_g3"])
def test_the_executorch_cpu_standins_run_and_match_their_reference(python, tmp_path, folder):
    """Their io.npz holds the input and eager PyTorch's output. Their libraries
    were compiled with -march=native on an AVX-512 machine: on a CPU without
    those instructions the process dies of SIGILL, and the test says so."""
    if "avx512f" not in _cpu_flags():
        pytest.skip(f"{folder}'s library uses AVX-512 (built with -march=native on its maker's machine); this CPU has none")
    program = STANDINS / folder
    io = np.load(program / "io.npz")
    np.savez(tmp_path / "in.npz", input_0=io["x0"])
    np.savez(tmp_path / "ref.npz", output_0=io["y0"])
    (data,) = program.glob("*.ptd")
    done = cli(python, "run", str(program / "model.pte"), "--data", str(data), "--inputs", "in.npz", "--expected", "ref.npz", cwd=tmp_path)
    if done.returncode in (-signal.SIGILL, 128 + signal.SIGILL):
        pytest.skip(f"{folder}'s library uses instructions this CPU lacks (built with -march=native on its maker's machine)")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "VERDICT: PASSED" in done.stdout


@pytest.mark.heavy
def test_a_bundle_that_needs_libtorch_exits_4_with_how_to_install_it(python, dict_mlp_bundle, tmp_path):
    """dict_mlp's bundle with its GEMM import renamed to one our shim lacks (as
    a default compile of a convolution would import aoti_torch_cpu_convolution):
    only libtorch could serve it, and it is not installed."""
    library = rename_imports(_library(dict_mlp_bundle.path), {"aoti_torch_cpu_addmm_out": "aoti_torch_cpu__fused_mm"})
    needs = tmp_path / "needs-libtorch.bundle"
    with open_bundle(dict_mlp_bundle.path) as reader:
        manifest = reader.manifest
        segments = {entry.name: bytes(reader.segment(entry.name)) for entry in manifest.segments}
    segments[manifest.methods["forward"].library_segment] = library
    write_bundle(needs, manifest, segments)
    np.savez(tmp_path / "in.npz", **_inputs())
    done = cli(python, "run", str(needs), "--inputs", "in.npz", cwd=tmp_path)
    assert done.returncode == 4, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "needs libtorch" in lines[0] and "aoti_torch_cpu__fused_mm" in lines[0]
    assert "pip install 'cuda-runner[torch]'" in lines[0]
