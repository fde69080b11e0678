"""scripts/bench_floor.c on cuda-runner's shim: the C program that calls the
container's Run with no Python in the loop (the per-call floor), driven by
scripts/bench_standalone.py as the benchmark drives it, on the session's CPU
bundle (the GPU benchmark runs the same code with --device cuda)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from cuda_runner.runtime.providers import own_shim_path

ROOT = Path(__file__).resolve().parent.parent.parent

pytestmark = [
    pytest.mark.skipif(own_shim_path() is None, reason="the shim is built by pip install (scripts/test.sh)"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler"),
]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_standalone", ROOT / "scripts" / "bench_standalone.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One folder for the module, so that the C program is compiled once."""
    return tmp_path_factory.mktemp("c-floor")


def test_the_c_program_runs_a_cpu_bundle_on_the_shim_and_frees_every_handle(bench, dict_mlp_bundle, work):
    inputs = {"x": np.zeros((4, 16), np.float32), "bias": np.zeros(8, np.float32)}
    result = bench.c_floor(dict_mlp_bundle.path, "cpu", inputs, work, 200, processes=1)
    assert "error" not in result, result  # the program itself fails (exit 3) when a call leaves a tensor handle behind
    assert 0 < result["median_us"] < 1e5


def test_it_refuses_a_library_whose_imports_were_not_renamed(bench, dict_mlp_bundle, work):
    """Bound to the shim, an unrenamed library would look for aoti_torch_* names
    that nothing in the process defines: the load fails, it never runs on them."""
    binary = bench.build_floor(work)
    library, weights = bench._floor_files(dict_mlp_bundle.path, work, rename=False)
    done = subprocess.run([str(binary), f"--shim={own_shim_path()}", str(library), str(weights), "cpu", "5", "6:4x16", "6:8"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "aoti_torch_" in done.stderr
