"""bfloat16 arrays saved by NumPy itself (np.save, np.savez) come back as a bare
2-byte void; inputs and references read that way are bfloat16."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from helpers import cli

from cuda_runner.io.npy import load_archive, load_array


def test_numpy_saved_bfloat16_reads_as_bfloat16(tmp_path):
    values = np.array([[1.5, -2.0], [0.25, 3.0]], dtype=ml_dtypes.bfloat16)
    np.save(tmp_path / "a.npy", values)
    np.savez(tmp_path / "a.npz", a=values)
    assert np.load(tmp_path / "a.npy").dtype == np.dtype("V2")  # what NumPy itself gives back
    for loaded in (load_array(tmp_path / "a.npy"), load_archive(tmp_path / "a.npz")["a"]):
        assert loaded.dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(loaded.astype(np.float32), values.astype(np.float32))


def test_a_bfloat16_model_runs_and_verifies_with_files_numpy_wrote(bf16_bundle, tmp_path):
    x = bf16_bundle.args[0].float().numpy().astype(ml_dtypes.bfloat16)
    np.savez(tmp_path / "in.npz", **{"x": x})
    first = cli("run", str(bf16_bundle.path), "--inputs", str(tmp_path / "in.npz"), "--out-dir", str(tmp_path / "out"))
    assert first.returncode == 0, first.stderr
    reference = np.load(tmp_path / "out" / "output_0.npy")
    np.savez(tmp_path / "ref.npz", output_0=reference.astype(ml_dtypes.bfloat16))  # saved by NumPy: a bare void on disk
    again = cli("run", str(bf16_bundle.path), "--inputs", str(tmp_path / "in.npz"), "--expected", str(tmp_path / "ref.npz"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "VERDICT: PASSED" in again.stdout


def test_ml_dtypes_is_imported_only_for_files_that_hold_bfloat16(tmp_path):
    """Importing ml_dtypes costs about a second of CPU: a float32 file does not
    pay it, and a file with the 'bfloat16' descriptor is still read in a process
    that had not imported it (NumPy knows the name only once it is)."""
    import subprocess
    import sys

    from cuda_runner.io.npy import write_npy

    with open(tmp_path / "b.npy", "wb") as handle:
        write_npy(handle, np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16))
    np.save(tmp_path / "f.npy", np.ones(3, np.float32))
    code = (
        "import sys\n"
        "from cuda_runner.io.npy import load_array, read_array_header\n"
        f"assert read_array_header({str(tmp_path / 'f.npy')!r}).dtype.name == 'float32'\n"
        "assert 'ml_dtypes' not in sys.modules\n"
        f"header = read_array_header({str(tmp_path / 'b.npy')!r})\n"
        f"print(header.dtype.name, load_array({str(tmp_path / 'b.npy')!r}).astype('float32').tolist())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split(None, 1) == ["bfloat16", "[1.5, -2.0]\n"]


def test_arrays_np_load_gives_as_bare_voids_run_as_bfloat16(bf16_bundle, tmp_path):
    """np.savez then np.load of a bfloat16 array gives a bare 2-byte void: passed
    to a bfloat16 input it runs as the bfloat16 it holds."""
    import cuda_runner

    x = bf16_bundle.args[0].float().numpy().astype(ml_dtypes.bfloat16)
    np.savez(tmp_path / "in.npz", x=x)
    void = np.load(tmp_path / "in.npz")["x"]
    assert void.dtype == np.dtype("V2")
    with cuda_runner.load(bf16_bundle.path) as model:
        expected, got = model.run([x]), model.run([void])
    for name in expected:
        np.testing.assert_array_equal(got[name].astype(np.float32), expected[name].astype(np.float32))
