"""Real ExecuTorch CUDA programs on the GPU: the three committed H200 exports
(payload layouts G1, G2, G3), run directly and converted, compared with eager
PyTorch's outputs; and, when scripts/gpu-test.sh made one
(CUDA_RUNNER_ET_EXTRA) or else the committed one, a program with two inputs,
two outputs and a dynamic batch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, cli

import cuda_runner

pytestmark = pytest.mark.gpu

DATA = ROOT / "tests" / "data" / "executorch"
FOLDERS = {"G1": DATA / "g1_et120_torch211", "G2": DATA / "g2_et141_torch211", "G3": DATA / "g3_et151_torch211"}
TOLERANCE = ["--atol", "1e-5", "--rtol", "0"]


def _files(tmp_path: Path, folder: Path) -> tuple[Path, Path]:
    io = np.load(folder / "io.npz")
    np.save(tmp_path / "x.npy", io["x0"])
    np.savez(tmp_path / "ref.npz", output_0=io["y0"])
    return tmp_path / "x.npy", tmp_path / "ref.npz"


@pytest.mark.parametrize("layout", ["G1", "G2", "G3"])
def test_real_programs_match_eager_directly_and_converted(tmp_path, layout):
    folder = FOLDERS[layout]
    x, reference = _files(tmp_path, folder)
    io = np.load(folder / "io.npz")
    with cuda_runner.load(folder / "model.pte") as model:
        output = model.run([io["x0"]])["output_0"]
    error = float(np.abs(output - io["y0"]).max())
    print(f"{layout}: max abs error {error:.3g} against eager")
    assert error <= 1e-5
    direct = cli("run", str(folder / "model.pte"), "--inputs", str(x), "--expected", str(reference), *TOLERANCE)
    assert direct.returncode == 0, direct.stderr
    converted = tmp_path / "converted.bundle"
    assert cli("convert", str(folder / "model.pte"), "-o", str(converted)).returncode == 0
    through_bundle = cli("run", str(converted), "--inputs", str(x), "--expected", str(reference), *TOLERANCE)
    assert through_bundle.returncode == 0, through_bundle.stderr
    bench = cli("bench", str(folder / "model.pte"), "--iterations", "200", "--json")
    assert bench.returncode == 0, bench.stderr
    figures = json.loads(bench.stdout)
    print(f"{layout}: bench median {figures['steady_s']['median'] * 1e3:.4f} ms, first run {figures['first_run_s'] * 1e3:.2f} ms")
    inspected = cli("inspect", str(folder / "model.pte"), "--verify")
    assert inspected.returncode == 0 and "this libtorch has all of them" in inspected.stdout, inspected.stdout


def test_a_two_input_dynamic_program(tmp_path):
    """The one scripts/gpu-test.sh exported on this machine, else the committed one."""
    folder = Path(os.environ.get("CUDA_RUNNER_ET_EXTRA") or DATA / "g3_two_io_et151_torch211")
    io = dict(np.load(folder / "io.npz"))
    np.savez(tmp_path / "in.npz", input_0=io["input_0"], input_1=io["input_1"])
    np.savez(tmp_path / "ref.npz", output_0=io["output_0"], output_1=io["output_1"])
    print(cli("inspect", str(folder / "model.pte")).stdout)
    result = cli("run", str(folder / "model.pte"), "--inputs", str(tmp_path / "in.npz"), "--expected", str(tmp_path / "ref.npz"), *TOLERANCE)
    print(result.stdout, result.stderr)
    assert result.returncode == 0
    converted = tmp_path / "converted.bundle"
    assert cli("convert", str(folder / "model.pte"), "-o", str(converted)).returncode == 0
    assert cli("run", str(converted), "--inputs", str(tmp_path / "in.npz"), "--expected", str(tmp_path / "ref.npz"), *TOLERANCE).returncode == 0
    bench = cli("bench", str(folder / "model.pte"), "--iterations", "200")
    assert bench.returncode == 0, bench.stderr
    print(bench.stdout)
