"""The .npy header parser (io/npy_header.py) against NumPy's own reader, and
what a bad header does to a run and to a batch."""

from __future__ import annotations

import base64
import gzip
import importlib.util
import io
import json

import numpy as np
import pytest
from helpers import ROOT, cli

from cuda_runner.errors import InputError
from cuda_runner.io.npy import NpzArchive, load_array, read_array_header


def _fuzzer():
    spec = importlib.util.spec_from_file_location("fuzz_npy_headers", ROOT / "scripts" / "fuzz_npy_headers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FUZZ = _fuzzer()
CORPUS = [base64.b64decode(entry) for entry in json.loads(gzip.decompress((ROOT / "tests" / "data" / "npy-headers.json.gz").read_bytes()))]


def test_the_kept_corpus_obeys_the_rule():
    """What our parser accepts NumPy reads alike; what NumPy refuses we refuse, with an InputError."""
    violations = [(data[:100], why) for data in CORPUS if (why := FUZZ.violation(data)) is not None]
    assert violations == []
    accepted = [data for data in CORPUS if not isinstance(FUZZ.ours_reads(data), InputError)]
    assert len(accepted) > 600  # every header NumPy writes, and their harmless variants, are read


def test_fresh_mutations_obey_the_rule():
    entries = FUZZ.corpus(1500, seed=20261202)
    assert [(data[:100], why) for data in entries if (why := FUZZ.violation(data)) is not None] == []


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
@pytest.mark.parametrize("fortran", [False, True])
def test_what_numpy_writes_is_read_back_exactly(tmp_path, version, fortran):
    rng = np.random.default_rng(0)
    for dtype in ("float32", "float64", "float16", "int8", "uint8", "int16", "int32", "int64", "bool"):
        for shape in [(), (0,), (3,), (2, 5), (2, 3, 4)]:
            array = (rng.standard_normal(shape) * 50).astype(dtype)
            array = np.asfortranarray(array) if fortran else array
            path = tmp_path / f"{dtype}-{len(shape)}.npy"
            with open(path, "wb") as handle:
                np.lib.format.write_array(handle, array, version=version)
            header = read_array_header(path)
            assert (header.dtype, header.shape, header.fortran_order) == (array.dtype, array.shape, fortran and array.ndim > 1)
            np.testing.assert_array_equal(load_array(path), array)


def test_an_archive_member_is_read_by_the_same_parser(tmp_path):
    path = tmp_path / "sets.npz"
    np.savez(path, x=np.arange(6, dtype=np.float32).reshape(2, 3), flags=np.array([True, False]))
    with NpzArchive(path) as archive:
        assert archive.header("x").shape == (2, 3)
        loaded = archive.load_all()
    np.testing.assert_array_equal(loaded["x"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert loaded["x"].flags.writeable  # read into memory of its own, not a view of the archive
    np.testing.assert_array_equal(loaded["flags"], [True, False])


UNCLOSED = FUZZ.frame("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 16), ", (1, 0)) + bytes(128)


def test_an_unclosed_header_dict_is_one_line_and_exit_2(dict_mlp_bundle, tmp_path):
    """It ended in tokenize's TokenError, an internal error (exit 4)."""
    (tmp_path / "x.npy").write_bytes(UNCLOSED)
    np.save(tmp_path / "bias.npy", np.zeros(8, np.float32))
    result = cli("run", str(dict_mlp_bundle.path), "--inputs", f"x={tmp_path / 'x.npy'}", "--inputs", f"bias={tmp_path / 'bias.npy'}")
    assert result.returncode == 2
    assert result.error_lines == [f"error: {tmp_path / 'x.npy'} is not a valid .npy file: its header ends where a quoted string belongs"]


def test_a_set_with_a_bad_header_is_refused_and_the_batch_goes_on(dict_mlp_bundle, tmp_path):
    sets = tmp_path / "sets"
    sets.mkdir()
    rng = np.random.default_rng(1)
    for index in range(6):
        np.savez(sets / f"s{index}.npz", x=rng.standard_normal((2, 16), dtype=np.float32), bias=np.zeros(8, np.float32))
    bad = sets / "s2b"
    bad.mkdir()
    (bad / "x.npy").write_bytes(UNCLOSED)
    np.save(bad / "bias.npy", np.zeros(8, np.float32))
    _archive_with_bad_member(sets / "s4b.npz")
    out = tmp_path / "out"
    result = cli("run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(out), "--json")
    assert result.returncode == 2
    document = json.loads(result.stdout)
    statuses = {entry["name"]: entry["status"] for entry in document["sets"]}
    assert statuses == {**{f"s{index}": "passed" for index in range(6)}, "s2b": "error", "s4b": "error"}
    errors = {entry["name"]: entry["error"] for entry in document["sets"] if entry["error"]}
    assert "x.npy is not a valid .npy file" in errors["s2b"] and "not a valid .npy file" in errors["s4b"]
    assert sorted(path.name for path in out.iterdir()) == [f"s{index}" for index in range(6)]
    assert result.stderr.splitlines()[-1] == "VERDICT: ERROR"  # exit 2: an error, not outputs outside tolerance


def _archive_with_bad_member(path):
    """An .npz whose member 'x' has the unclosed header."""
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", UNCLOSED)
        member = io.BytesIO()
        np.save(member, np.zeros(8, np.float32))
        archive.writestr("bias.npy", member.getvalue())
