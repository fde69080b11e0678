"""Every way of giving inputs resolves to one validated set, or a precise error."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cuda_runner.errors import InputError
from cuda_runner.format.manifest import DeviceSpec, DimSpec, MethodSpec, TensorSpec
from cuda_runner.io.inputs import example_shapes, parse_ranges, parse_shapes, random_inputs, resolve_inputs
from cuda_runner.io.npy import load_array, save_array

METHOD = MethodSpec(
    name="forward", device=DeviceSpec("cpu"), library_segment="so", weights_segment=None,
    inputs=(
        TensorSpec("x", "float32", ("batch", 4)),
        TensorSpec("ids", "int64", ("batch", "2*batch")),
        TensorSpec("scale", "float32", ()),
        TensorSpec("h", "bfloat16", (2,)),
    ),
    outputs=(TensorSpec("y", "float32", ("batch", 4)),),
    dims={"batch": DimSpec("batch", 1, 8, 3)}, torch_version="2.13",
)


@pytest.fixture
def files(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((3, 4), np.float32))
    np.save(tmp_path / "ids.npy", np.zeros((3, 6), np.int64))
    np.save(tmp_path / "h.npy", np.ones(2, ml_dtypes.bfloat16))  # NumPy stores this as '<V2'
    np.savez(tmp_path / "all.npz", x=np.ones((3, 4), np.float32), ids=np.zeros((3, 6), np.int64))
    return tmp_path


def test_positional_named_iree_and_inline(files):
    resolved = resolve_inputs(METHOD, [str(files / "x.npy"), f"ids=@{files / 'ids.npy'}", "scale=0.5", f"h={files / 'h.npy'}"])
    assert resolved.arrays["scale"].dtype == np.float32 and resolved.arrays["scale"] == 0.5
    assert resolved.arrays["h"].dtype == ml_dtypes.bfloat16
    assert resolved.dims == {"batch": 3}
    assert [source.origin for source in resolved.sources] == ["file", "file", "literal", "file"]


def test_npz_keyed_by_input_names_and_iree_tensor_literal(files):
    resolved = resolve_inputs(METHOD, [str(files / "all.npz"), "scale=1", "h=2xbf16=1 2"])
    assert resolved.arrays["h"].astype(np.float32).tolist() == [1.0, 2.0]
    with pytest.raises(InputError, match="key 'zz', which is not an input"):
        np.savez(files / "bad.npz", zz=np.zeros(1))
        resolve_inputs(METHOD, [str(files / "bad.npz")])


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["x=x64.npy"], "expected dtype float32, got float64 (use --cast"),
        (["x=x.npy", "x=x.npy"], "given twice"),
        (["x=x.npy", "ids=ids.npy", "scale=0.5"], "missing 'h'"),
        (["x=x.npy", "ids=ids_wrong.npy", "scale=0.5", "h=h.npy"], "expected 2*batch = 6, got 5"),
        (["x=x.npy", "ids=ids.npy", "scale=abc", "h=h.npy"], "abc does not exist"),
        (["x=x.npy", "ids=ids.npy", "scale=[1,2]", "h=h.npy"], "expected rank 0"),
        (["x=x.npy", "ids=ids.npy", "scale=0.5", "h=3xbf16=1"], "axis 0: expected size 2, got 3"),
        (["x=x.npy", "ids=ids.npy", "scale=0.5", "h=2xf32=1"], "expected dtype bfloat16, got float32"),
        (["objects.npy"], "never unpickled"),
        (["a.npy", "b.npy", "c.npy", "d.npy", "e.npy"], "too many positional inputs"),
        (["nosuch=1"], "not an input"),
    ],
)
def test_errors_name_the_input_and_what_was_expected(files, specs, message):
    np.save(files / "x64.npy", np.ones((3, 4)))
    np.save(files / "ids_wrong.npy", np.zeros((3, 5), np.int64))
    np.save(files / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    for name in "abcde":
        np.save(files / f"{name}.npy", np.zeros(1))
    with pytest.raises(InputError) as info:
        resolve_inputs(METHOD, [spec if "=" in spec and not spec.split("=", 1)[1].endswith(".npy") else spec.replace("=", f"={files}/", 1) if "=" in spec else str(files / spec) for spec in specs])
    assert message in str(info.value)


def test_cast_converts_within_a_kind_only(files):
    np.save(files / "x64.npy", np.ones((3, 4)))
    base = [f"ids={files / 'ids.npy'}", "scale=1", f"h={files / 'h.npy'}"]
    resolved = resolve_inputs(METHOD, [f"x={files / 'x64.npy'}", *base], cast=True)
    assert resolved.arrays["x"].dtype == np.float32
    np.save(files / "xi.npy", np.ones((3, 4), np.int32))
    with pytest.raises(InputError, match="cannot cast int32 to float32"):
        resolve_inputs(METHOD, [f"x={files / 'xi.npy'}", *base], cast=True)


def test_fortran_and_big_endian_files_are_accepted(files):
    np.save(files / "xf.npy", np.asfortranarray(np.arange(12, dtype=">f4").reshape(3, 4)))
    resolved = resolve_inputs(METHOD, [f"x={files / 'xf.npy'}", f"ids={files / 'ids.npy'}", "scale=1", f"h={files / 'h.npy'}"])
    assert resolved.arrays["x"].dtype.name == "float32"
    np.testing.assert_array_equal(resolved.arrays["x"], np.arange(12).reshape(3, 4))


def test_large_npy_files_are_memory_mapped(files):
    np.save(files / "big.npy", np.zeros((256, 1024), np.float32))
    assert isinstance(load_array(files / "big.npy"), np.memmap)


def test_random_inputs_follow_the_signature_and_seed():
    first = random_inputs(METHOD, seed=3, shapes={"x": (5, 4)}, ranges={"ids": (0, 100)})
    again = random_inputs(METHOD, seed=3, shapes={"x": (5, 4)}, ranges={"ids": (0, 100)})
    assert first.dims == {"batch": 5}
    assert first.arrays["ids"].shape == (5, 10) and first.arrays["ids"].dtype == np.int64
    assert 0 <= first.arrays["ids"].min() and first.arrays["ids"].max() < 100
    assert first.arrays["h"].dtype == ml_dtypes.bfloat16
    for name in first.arrays:
        np.testing.assert_array_equal(first.arrays[name], again.arrays[name])
    default = random_inputs(METHOD)
    assert default.dims == {"batch": 3}  # the example size recorded at compile time
    assert set(np.unique(default.arrays["ids"])) <= {0, 1}
    assert -1 <= default.arrays["x"].min() and default.arrays["x"].max() < 1


def test_shape_and_range_parsing_errors():
    assert parse_shapes(["x=4x128", "s="]) == {"x": (4, 128), "s": ()}
    assert parse_ranges(["ids=0:30522"]) == {"ids": (0.0, 30522.0)}
    for bad in (["x"], ["x=4xa"]):
        with pytest.raises(InputError):
            parse_shapes(bad)
    for bad in (["ids=5:1"], ["ids=0"], ["ids=a:b"]):
        with pytest.raises(InputError):
            parse_ranges(bad)
    with pytest.raises(InputError, match="outside the compiled range"):
        random_inputs(METHOD, shapes={"x": (9, 4)})
    with pytest.raises(InputError, match="expected rank 2"):
        example_shapes(METHOD, {"x": (9,)})


def test_bfloat16_output_files_read_back_as_bfloat16(tmp_path):
    data = np.array([1.5, -2.0], ml_dtypes.bfloat16)
    save_array(tmp_path / "o.npy", data)
    loaded = np.load(tmp_path / "o.npy")
    assert loaded.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(loaded.astype(np.float32), [1.5, -2.0])
