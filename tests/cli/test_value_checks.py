"""No input value changes on its way to the model, except by float rounding.

`--cast`, inline values and `--range` refuse (exit 2, one line naming the
input, the value and the dtype) any value the declared dtype cannot hold,
instead of wrapping it (int64 2^31 to int32), making it infinite (float32
70000 to float16) or truncating it (2.5 to int64). README, "--cast".

Dtypes no fixture model has (int32, float16, uint8, bool) come from forged
bundles: inputs are converted and checked before the library loads, so
`--save-inputs` shows what the model would have been given even though the
forged library itself never loads.
"""

from __future__ import annotations

import numpy as np
import pytest
from forge import forge, method
from helpers import cli

from cuda_runner.io.npy import load_archive


@pytest.fixture(scope="module")
def typed(tmp_path_factory):
    """A forged bundle whose one input `v` has the given dtype and shape [3]."""
    folder = tmp_path_factory.mktemp("typed")

    def make(dtype: str):
        path = folder / f"{dtype}.bundle"
        if not path.exists():
            spec = method(dims={}, inputs=[{"name": "v", "dtype": dtype, "shape": [3]}])
            path.write_bytes(forge({"methods": {"forward": spec}}))
        return path

    return make


def _refused(*args: str) -> str:
    result = cli("run", *args)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and len(result.error_lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    return result.error_lines[0]


def _given(typed, dtype: str, folder, *args: str) -> np.ndarray:
    """What the model of a forged bundle would be given (its library then fails to load)."""
    result = cli("run", str(typed(dtype)), *args, "--save-inputs", str(folder))
    assert "model library" in result.stderr, result.stderr  # the forged library (not ELF) is refused: inputs were accepted
    return load_archive(folder / "inputs.npz")["v"]


@pytest.mark.parametrize(("values", "shown"), [([2**40 + 5, 1, 2], "1099511627781 at [0]"), ([0, 2**31, 1], "2147483648 at [1]"),
                                               ([0, -(2**31) - 1, 1], "-2147483649 at [1]")])
def test_cast_refuses_integers_that_would_wrap(typed, tmp_path, values, shown):
    np.save(tmp_path / "v.npy", np.array(values, np.int64))
    line = _refused(str(typed("int32")), "--cast", "-i", str(tmp_path / "v.npy"))
    assert "input 'v'" in line and shown in line and "out of range for int32" in line
    np.save(tmp_path / "v.npy", np.array([-(2**31), 2**31 - 1, 7], np.int64))
    assert _given(typed, "int32", tmp_path, "--cast", "-i", str(tmp_path / "v.npy")).tolist() == [-(2**31), 2**31 - 1, 7]


def test_cast_refuses_finite_floats_that_would_overflow_and_keeps_inf_and_nan(typed, tmp_path):
    np.save(tmp_path / "v.npy", np.array([1, 70000, 2], np.float32))
    line = _refused(str(typed("float16")), "--cast", "-i", str(tmp_path / "v.npy"))
    assert "input 'v'" in line and "70000.0 at [1]" in line and "too large for float16" in line
    np.save(tmp_path / "v.npy", np.array([np.inf, np.nan, 65504], np.float64))
    kept = _given(typed, "float16", tmp_path, "--cast", "-i", str(tmp_path / "v.npy"))
    assert kept.dtype == np.float16 and np.isposinf(kept[0]) and np.isnan(kept[1]) and kept[2] == 65504


@pytest.mark.parametrize(("values", "fragment"), [([1.0, 2.5, 3.0], "2.5 at [1] is not a whole number, as needed by uint8"),
                                                   ([1.0, np.nan, 3.0], "nan at [1] is not a whole number"),
                                                   ([1.0, 256.0, 3.0], "256.0 at [1] is out of range for uint8"),
                                                   ([-1.0, 0.0, 3.0], "-1.0 at [0] is out of range for uint8")])
def test_cast_from_float_to_integer_needs_whole_numbers_in_range(typed, tmp_path, values, fragment):
    np.save(tmp_path / "v.npy", np.array(values))
    assert fragment in _refused(str(typed("uint8")), "--cast", "-i", str(tmp_path / "v.npy"))
    np.save(tmp_path / "v.npy", np.array([0.0, 255.0, 7.0]))
    assert _given(typed, "uint8", tmp_path, "--cast", "-i", str(tmp_path / "v.npy")).tolist() == [0, 255, 7]


def test_bool_inputs_take_only_0_and_1(typed, tmp_path):
    np.save(tmp_path / "v.npy", np.array([0, 2, 1], np.int64))
    assert "the value 2 at [1] is out of range for bool" in _refused(str(typed("bool")), "--cast", "-i", str(tmp_path / "v.npy"))
    assert "the value 2 at [1] is out of range for bool" in _refused(str(typed("bool")), "-i", "v=[0,2,1]")
    assert "the value 2 at [0] is out of range for bool" in _refused(str(typed("bool")), "-i", "v=3xi1=2 1 0")
    assert _given(typed, "bool", tmp_path, "-i", "v=[0,true,1]").tolist() == [False, True, True]
    drawn = _given(typed, "bool", tmp_path, "--random-inputs", "--range", "v=1:2")  # a range works as for integers
    assert drawn.tolist() == [True, True, True]


def test_cast_on_real_models_keeps_values_and_runs(embedder_bundle, dict_mlp_bundle, tmp_path):
    ids = np.arange(18).reshape(3, 6)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "ids_float.npy", ids.astype(np.float64))
    exact = cli("run", str(embedder_bundle.path), "-i", str(tmp_path / "ids.npy"), "-i", "scale=0.5", "--out", str(tmp_path / "a.npz"))
    cast = cli("run", str(embedder_bundle.path), "--cast", "-i", str(tmp_path / "ids_float.npy"), "-i", "scale=0.5", "--out", str(tmp_path / "b.npz"))
    assert exact.returncode == 0 and cast.returncode == 0, exact.stderr + cast.stderr
    for name, array in load_archive(tmp_path / "a.npz").items():
        np.testing.assert_array_equal(load_archive(tmp_path / "b.npz")[name], array)
    np.save(tmp_path / "ids_float.npy", np.where(ids == 4, 2.0**63, ids).astype(np.float64))
    line = _refused(str(embedder_bundle.path), "--cast", "-i", str(tmp_path / "ids_float.npy"), "-i", "scale=0.5")
    assert "input 'ids'" in line and "9.223372036854776e+18 at [0, 4] is out of range for int64" in line
    x = np.ones((2, 16))
    x[1, 3] = 1e39
    np.save(tmp_path / "x.npy", x)
    line = _refused(str(dict_mlp_bundle.path), "--cast", "-i", str(tmp_path / "x.npy"), "-i", "bias=8xf32=0")
    assert "input 'x'" in line and "1e+39 at [1, 3] is too large for float32" in line


def test_a_bf16_input_refuses_what_bfloat16_cannot_hold(bf16_bundle, tmp_path):
    np.save(tmp_path / "x.npy", np.full((2, 32), 3.4e38, np.float32))
    line = _refused(str(bf16_bundle.path), "--cast", "-i", str(tmp_path / "x.npy"))
    assert "input 'x'" in line and "3.4e+38 at [0, 0] (and 63 more) is too large for bfloat16" in line
    np.save(tmp_path / "x.npy", np.full((2, 32), 0.5, np.float32))
    assert cli("run", str(bf16_bundle.path), "--cast", "-i", str(tmp_path / "x.npy")).returncode == 0


@pytest.mark.parametrize("value", ["bias=8xf32=1e39", "bias=[1e39,0,0,0,0,0,0,0]", "bias=8xf32=1e400", "bias=[0,0,0,0,0,0,0,-1e39]"])
def test_inline_values_that_overflow_are_refused(dict_mlp_bundle, value):
    line = _refused(str(dict_mlp_bundle.path), "-i", "x=2x16xf32=0", "-i", value)
    assert "input 'bias'" in line and "too large for float32" in line and "1e" in line


def test_inline_inf_and_nan_written_out_are_kept(dict_mlp_bundle, tmp_path):
    result = cli("run", str(dict_mlp_bundle.path), "-i", "x=2x16xf32=0", "-i", "bias=8xf32=inf", "--save-inputs", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert np.isposinf(load_archive(tmp_path / "inputs.npz")["bias"]).all()


@pytest.mark.parametrize(("args", "fragment"), [
    (["--range", "x=0:1e39"], "the range [0, 1e+39) reaches past float32"),
    (["--range", "x=-1e39:0"], "the range [-1e+39, 0) reaches past float32"),
])
def test_float_ranges_beyond_the_dtype_are_refused(dict_mlp_bundle, args, fragment):
    line = _refused(str(dict_mlp_bundle.path), "--random-inputs", *args)
    assert "input 'x'" in line and fragment in line


@pytest.mark.parametrize(("dtype", "bounds", "fragment"), [
    ("int32", "0:1e30", "reaches past int32, which holds -2147483648 to 2147483647"),
    ("uint8", "0:300", "reaches past uint8, which holds 0 to 255"),
    ("uint8", "-1:10", "reaches past uint8"),
    ("float16", "0:70000", "reaches past float16, whose largest finite value is 65504"),
])
def test_ranges_are_refused_rather_than_clamped(typed, dtype, bounds, fragment):
    assert fragment in _refused(str(typed(dtype)), "--random-inputs", "--range", f"v={bounds}")


def test_a_range_that_fits_exactly_is_drawn_from(typed, tmp_path):
    drawn = _given(typed, "uint8", tmp_path, "--random-inputs", "--range", "v=255:256")
    assert drawn.tolist() == [255, 255, 255]
