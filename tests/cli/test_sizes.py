"""Sizes no array can have, or this machine cannot hold, are refused before
anything is allocated: exit 2 when the user asked for them (--shape, an inline
shape, an input archive), exit 3 when the bundle's manifest declares them
(static sizes, example sizes, stored samples); never NumPy's "array is too
big" as an internal error, nor an attempt to allocate them.

The bundles are forged: every check here happens before the library loads.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from forge import forge, method
from helpers import cli

HUGE = 1 << 62  # times 4 bytes: past 2^63


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sizes")

    def write(name: str, manifest: dict | None = None, segments: dict | None = None, **overrides) -> str:
        path = folder / f"{name}.bundle"
        path.write_bytes(forge(manifest or {"methods": {"forward": method(**overrides)}}, segments))
        return str(path)

    unbounded = {"n": {"min": 0, "max": None, "example": 2}, "m": {"min": 0, "max": None, "example": 3}}
    return {
        "unbounded": write("unbounded", dims=unbounded, inputs=[{"name": "x", "dtype": "float32", "shape": ["n", "m"]}]),
        "static_overflow": write("static_overflow", dims={}, inputs=[{"name": "x", "dtype": "float32", "shape": [HUGE, 4]}]),
        "static_huge": write("static_huge", dims={}, inputs=[{"name": "x", "dtype": "float32", "shape": [1 << 40, 4]}]),
        "output_overflow": write("output_overflow", outputs=[{"name": "y", "dtype": "float64", "shape": ["batch", HUGE]}]),
        "example_huge": write("example_huge", dims={"n": {"min": 1, "max": None, "example": HUGE}},
                              inputs=[{"name": "x", "dtype": "float32", "shape": ["n", 4]}]),
        "samples": write("samples", {"methods": {"forward": method(
            dims={}, inputs=[{"name": "x", "dtype": "float32", "shape": [256, 256]}],
            sample_inputs_segment="m_in", sample_outputs_segment="m_out")}},
            {"m_so": b"\x7fELF" + b"L" * 60, "m_w": b"W" * 100, "m_in": _npz(x=np.zeros((256, 256), np.float32)), "m_out": _npz()}),
        "folder": folder,
    }


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _one_error(result, code: int) -> str:
    assert result.returncode == code, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and len(result.error_lines) == 1, result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr
    return result.error_lines[0]


@pytest.mark.parametrize("command", ["run", "bench"])
@pytest.mark.parametrize(("shape", "fragment"), [
    (f"x={HUGE}x4", "multiply past 2^63 bytes"),
    (f"x=0x{HUGE}", "multiply past 2^63 bytes"),  # NumPy refuses it even with no element
    (f"x={1 << 40}x4", "16.0 TiB, more than this machine's memory"),
])
def test_a_shape_the_user_asks_for_that_cannot_be_made_is_a_usage_error(bundles, command, shape, fragment):
    line = _one_error(cli(command, bundles["unbounded"], "--random-inputs", "--shape", shape), 2)
    assert "input 'x': cannot generate float32 values of shape" in line and fragment in line and "--shape" in line


def test_an_inline_shape_that_cannot_be_made_is_a_usage_error(bundles):
    line = _one_error(cli("run", bundles["unbounded"], "-i", f"x=0x{HUGE}xf32=1"), 2)
    assert "input 'x': the inline shape" in line and "multiply past 2^63 bytes" in line


@pytest.mark.parametrize("command", [["inspect"], ["run", "--random-inputs"], ["bench"]])
@pytest.mark.parametrize("bundle", ["static_overflow", "output_overflow"])
def test_a_manifest_with_static_sizes_no_array_can_have_is_refused_at_open(bundles, command, bundle):
    line = _one_error(cli(command[0], bundles[bundle], *command[1:]), 3)
    assert "shape" in line and "multiply past 2^63 bytes" in line


def test_a_manifest_whose_static_sizes_exceed_this_machine_is_refused_before_generating(bundles):
    assert cli("inspect", bundles["static_huge"]).returncode == 0  # a valid manifest, for a bigger machine
    line = _one_error(cli("run", bundles["static_huge"], "--random-inputs"), 3)
    assert "the manifest declares the float32 shape [1099511627776, 4]" in line and "more than this machine's memory" in line


def test_example_sizes_that_cannot_be_made_are_the_bundles_fault_and_a_shape_overrides_them(bundles):
    for args in (["run", bundles["example_huge"], "--random-inputs"], ["bench", bundles["example_huge"]]):
        line = _one_error(cli(*args), 3)
        assert "the manifest's example sizes give the float32 shape" in line and "(give sizes with --shape" in line
    verify = cli("inspect", bundles["example_huge"], "--verify")
    assert verify.returncode == 3 and "verification failed" in verify.error_lines[0] and "example sizes" in verify.error_lines[0]
    overridden = cli("run", bundles["example_huge"], "--random-inputs", "--shape", "x=2x4")
    assert "model library" in overridden.stderr  # past the inputs: the forged library is all that fails


def test_archive_members_larger_than_memory_are_refused_before_reading(bundles, monkeypatch):
    folder = bundles["folder"]
    np.savez(folder / "inputs.npz", x=np.zeros((256, 256), np.float32))  # 256 KiB
    monkeypatch.setattr("cuda_runner.arrays.host_memory_bytes", lambda: 64 << 10)
    line = _one_error(cli("run", bundles["unbounded"], "-i", str(folder / "inputs.npz")), 2)
    assert "member 'x' of shape [256, 256]" in line and "256.0 KiB, more than this machine's memory (64.0 KiB)" in line
    line = _one_error(cli("run", bundles["samples"], "--self-test"), 3)
    assert "stored samples cannot be read" in line and "more than this machine's memory" in line


def test_a_self_test_reads_stored_samples_that_fit(bundles):
    result = cli("run", bundles["samples"], "--self-test")
    assert "model library" in result.stderr, result.stderr  # the samples were read; the forged library is what fails

