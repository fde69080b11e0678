"""Every way of giving inputs resolves to one validated set, or a precise error."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cuda_runner.cli.options import input_entry
from cuda_runner.errors import BundleError, InputError
from cuda_runner.format.manifest import DeviceSpec, DimSpec, MethodSpec, TensorSpec
from cuda_runner.io.inputs import GivenInputs, RandomInputs, example_shapes, resolve_inputs
from cuda_runner.io.npy import load_array

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


def given(specs, *, cast=False):
    """The plan the command line makes of --inputs strings."""
    return GivenInputs(tuple(input_entry(spec) for spec in specs), cast)


def random_inputs(method, *, seed=0, shapes=None, ranges=None):
    return resolve_inputs(method, RandomInputs(seed, shapes or {}, ranges or {}))


@pytest.fixture
def files(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((3, 4), np.float32))
    np.save(tmp_path / "ids.npy", np.zeros((3, 6), np.int64))
    np.save(tmp_path / "h.npy", np.ones(2, ml_dtypes.bfloat16))  # NumPy stores this as '<V2'
    np.savez(tmp_path / "all.npz", x=np.ones((3, 4), np.float32), ids=np.zeros((3, 6), np.int64))
    return tmp_path


def test_positional_named_iree_and_inline(files):
    resolved = resolve_inputs(METHOD, given([str(files / "x.npy"), f"ids=@{files / 'ids.npy'}", "scale=0.5", f"h={files / 'h.npy'}"]))
    assert resolved.arrays["scale"].dtype == np.float32 and resolved.arrays["scale"] == 0.5
    assert resolved.arrays["h"].dtype == ml_dtypes.bfloat16
    assert resolved.dims == {"batch": 3}
    assert [source.origin for source in resolved.sources] == ["file", "file", "literal", "file"]


def test_npz_keyed_by_input_names_and_iree_tensor_literal(files):
    resolved = resolve_inputs(METHOD, given([str(files / "all.npz"), "scale=1", "h=2xbf16=1 2"]))
    assert resolved.arrays["h"].astype(np.float32).tolist() == [1.0, 2.0]
    np.savez(files / "bad.npz", zz=np.zeros(1))
    with pytest.raises(InputError, match="key 'zz', which is not an input"):
        resolve_inputs(METHOD, given([str(files / "bad.npz")]))


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["x=x64.npy"], "expected dtype float32, got float64"),
        (["x=x.npy", "x=x.npy"], "given twice"),
        (["x=x.npy", "ids=ids.npy", "scale=0.5"], "missing 'h'"),
        (["x=x.npy", "ids=ids_wrong.npy", "scale=0.5", "h=h.npy"], "expected 2*batch = 6, got 5"),
        (["x=x.npy", "ids=ids.npy", "scale=abc", "h=h.npy"], "abc does not exist"),
        (["x=x.npy", "ids=ids.npy", "scale=[[1],[2,3]]", "h=h.npy"], "rectangular"),
        (["x=x.npy", "ids=ids.npy", "scale=" + "[" * 20000 + "]" * 20000, "h=h.npy"], "nested too deeply"),
        (["x=x.npy", "ids=3x6xi64=1 2 zz", "scale=0.5", "h=h.npy"], "'zz' is not a int64 value"),
        (["x=99999999999999999999x4xf32=0", "ids=ids.npy", "scale=0.5", "h=h.npy"], "too large for an inline value"),
        (["x=4294967296x4294967296xf32=0", "ids=ids.npy", "scale=0.5", "h=h.npy"], "too large for an inline value"),
        (["x=20000000x4xf32=0", "ids=ids.npy", "scale=0.5", "h=h.npy"], "outside the compiled range"),
        (["x=x.npy", "ids=3x6xi64=99999999999999999999", "scale=0.5", "h=h.npy"], "out of range for int64"),
        (["x=x.npy", "ids=ids.npy", "scale=[1,2]", "h=h.npy"], "expected rank 0"),
        (["x=x.npy", "ids=ids.npy", "scale=0.5", "h=3xbf16=1"], "axis 0: expected size 2, got 3"),
        (["x=x.npy", "ids=ids.npy", "scale=0.5", "h=2xf32=1"], "expected dtype bfloat16, got float32"),
        (["objects.npy"], "never unpickled"),
        (["a.npy", "b.npy", "c.npy", "d.npy", "e.npy"], "too many inputs"),
        (["nosuch=1"], "not an input"),
    ],
)
def test_errors_name_the_input_and_what_was_expected(files, specs, message):
    np.save(files / "x64.npy", np.ones((3, 4)))
    np.save(files / "ids_wrong.npy", np.zeros((3, 5), np.int64))
    np.save(files / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    for name in "abcde":
        np.save(files / f"{name}.npy", np.zeros(1))
    located = [_in_folder(files, spec) for spec in specs]
    with pytest.raises(InputError) as info:
        resolve_inputs(METHOD, given(located))
    assert message in str(info.value)


def _in_folder(folder, spec: str) -> str:
    """'x=x.npy' -> 'x=<folder>/x.npy'; inline values stay as they are."""
    if "=" not in spec:
        return str(folder / spec)
    name, value = spec.split("=", 1)
    return f"{name}={folder / value}" if value.endswith(".npy") else spec


def test_integer_literals_stay_exact():
    method = MethodSpec(name="m", device=DeviceSpec("cpu"), library_segment="so", weights_segment=None,
                        inputs=(TensorSpec("i", "int64", (2,)),), outputs=(), dims={}, torch_version="2.13")
    resolved = resolve_inputs(method, given(["i=[9007199254740993, -9007199254740993]"]))
    assert resolved.arrays["i"].tolist() == [9007199254740993, -9007199254740993]
    iree = resolve_inputs(method, given(["i=2xi64=9007199254740993 1"]))
    assert iree.arrays["i"].tolist() == [9007199254740993, 1]


def test_inputs_are_checked_before_their_data_is_read(files, monkeypatch):
    """A huge archive member, an inline splat or a --shape outside the bounds is
    refused from its header or its shape: nothing of its size is allocated."""
    import cuda_runner.io.npy as npy

    def never(*_args, **_kwargs):
        raise AssertionError("data was read before the shape was checked")

    np.savez(files / "huge.npz", x=np.zeros((20, 4), np.float32))
    monkeypatch.setattr(npy.NpzArchive, "load", never)
    with pytest.raises(InputError, match="outside the compiled range"):
        resolve_inputs(METHOD, given([str(files / "huge.npz"), f"ids={files / 'ids.npy'}", "scale=1", f"h={files / 'h.npy'}"]))
    import tracemalloc

    tracemalloc.start()  # NumPy reports its array buffers to tracemalloc
    try:
        with pytest.raises(InputError, match="outside the compiled range"):
            random_inputs(METHOD, shapes={"x": (20000000, 4)})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # the float32 array would be 320 MB


def test_a_negative_shape_in_an_npy_header_is_an_input_error(files):
    raw = (files / "x.npy").read_bytes().replace(b"(3, 4)", b"(-3, 4)")
    (files / "neg.npy").write_bytes(raw)
    with pytest.raises(InputError, match="shape"):
        resolve_inputs(METHOD, given([f"x={files / 'neg.npy'}", f"ids={files / 'ids.npy'}", "scale=1", f"h={files / 'h.npy'}"]))


def test_an_npz_member_that_is_not_npy_is_an_input_error(files):
    import zipfile

    with zipfile.ZipFile(files / "odd.npz", "w") as archive:
        archive.writestr("x.txt", "hello")
    with pytest.raises(InputError, match=r"not an \.npy file"):
        resolve_inputs(METHOD, given([str(files / "odd.npz")]))


def test_damaged_stored_samples_are_a_bundle_error(files):
    import zipfile

    from cuda_runner.io.inputs import StoredSamples
    from cuda_runner.io.npy import NpzArchive

    with zipfile.ZipFile(files / "samples.npz", "w") as archive:
        archive.writestr("x.npy", b"\x93NUMPY garbage")
    with NpzArchive(files / "samples.npz") as samples, pytest.raises(BundleError):
        resolve_inputs(METHOD, StoredSamples(), samples)


def test_cast_converts_only_where_every_value_is_kept(files):
    np.save(files / "x64.npy", np.ones((3, 4)))
    base = [f"ids={files / 'ids.npy'}", "scale=1", f"h={files / 'h.npy'}"]
    with pytest.raises(InputError) as refused:
        resolve_inputs(METHOD, given([f"x={files / 'x64.npy'}", *base]))
    assert refused.value.subject == "cast"  # the command line adds: use --cast
    resolved = resolve_inputs(METHOD, given([f"x={files / 'x64.npy'}", *base], cast=True))
    assert resolved.arrays["x"].dtype == np.float32
    np.save(files / "xi.npy", np.full((3, 4), 1 << 24, np.int32))  # every int32 up to 2^24 is a float32
    assert resolve_inputs(METHOD, given([f"x={files / 'xi.npy'}", *base], cast=True)).arrays["x"][0, 0] == 1 << 24
    np.save(files / "xi.npy", np.full((3, 4), (1 << 24) + 1, np.int32))
    with pytest.raises(InputError, match=r"the value 16777217 at \[0, 0\] \(and 11 more\) cannot be held exactly by float32"):
        resolve_inputs(METHOD, given([f"x={files / 'xi.npy'}", *base], cast=True))


def test_fortran_and_big_endian_files_are_accepted(files):
    np.save(files / "xf.npy", np.asfortranarray(np.arange(12, dtype=">f4").reshape(3, 4)))
    resolved = resolve_inputs(METHOD, given([f"x={files / 'xf.npy'}", f"ids={files / 'ids.npy'}", "scale=1", f"h={files / 'h.npy'}"]))
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
    assert first.arrays["ids"].min() >= 0 and first.arrays["ids"].max() < 100
    assert first.arrays["h"].dtype == ml_dtypes.bfloat16
    for name in first.arrays:
        np.testing.assert_array_equal(first.arrays[name], again.arrays[name])
    default = random_inputs(METHOD)
    assert default.dims == {"batch": 3}  # the example size recorded at compile time
    assert set(np.unique(default.arrays["ids"])) <= {0, 1}
    assert default.arrays["x"].min() >= -1 and default.arrays["x"].max() < 1


def test_random_positions_stay_within_their_bounds_and_given_values_outside_are_refused():
    import dataclasses

    bounded = dataclasses.replace(METHOD, inputs=(TensorSpec("pos", "int64", (1,), bounds=(0, 0)),), dims={})
    for seed in range(20):  # drawn from [0, 2) where the cache allows it; a cache of one position allows only 0
        assert random_inputs(bounded, seed=seed).arrays["pos"].tolist() == [0]
    with pytest.raises(InputError, match="holds 1; method 'forward' accepts 0 to 0") as refused:
        random_inputs(bounded, ranges={"pos": (1, 2)})
    assert refused.value.subject == "bounds"


def test_random_prompt_positions_start_where_a_prompt_as_long_as_the_cache_still_fits():
    """Drawn from [0, 2), a prompt of 16 positions in a cache of 16 was refused whenever its first was 1."""
    import dataclasses

    spanned = dataclasses.replace(METHOD, inputs=(TensorSpec("cache_position", "int64", (16,), span_bounds=(0, 15)),), dims={})
    for seed in range(20):
        assert random_inputs(spanned, seed=seed).arrays["cache_position"].tolist() == [0] * 16
    with pytest.raises(InputError, match="counts 16 position") as refused:
        random_inputs(spanned, ranges={"cache_position": (1, 2)})
    assert refused.value.subject == "bounds"


def test_shapes_outside_the_bounds_or_of_the_wrong_rank_are_refused():
    with pytest.raises(InputError, match="outside the compiled range"):
        random_inputs(METHOD, shapes={"x": (9, 4)})
    with pytest.raises(InputError, match="expected rank 2") as info:
        example_shapes(METHOD, {"x": (9,)})
    assert info.value.subject == "shape"


def test_bfloat16_output_files_read_back_as_bfloat16(tmp_path):
    data = np.array([1.5, -2.0], ml_dtypes.bfloat16)
    from cuda_runner.files import write_file
    from cuda_runner.io.npy import npy_writer

    write_file(tmp_path / "o.npy", npy_writer(data))
    loaded = np.load(tmp_path / "o.npy")
    assert loaded.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(loaded.astype(np.float32), [1.5, -2.0])
