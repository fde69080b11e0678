"""cuda-runner's own shim (native/aoti_shim.cpp) through ctypes, the renaming of a
library's imports, and CPU bundles run on it beside libtorch."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from cuda_runner.errors import BundleError
from cuda_runner.format.bundle import open_bundle
from cuda_runner.format.elf import read_library_facts, rename_imports
from cuda_runner.runtime.providers import RENAMES, SHIM_NAME, load_own_provider, missing_from_own_shim, own_exports, own_shim_path

pytestmark = pytest.mark.skipif(own_shim_path() is None, reason="the shim is built by pip install (scripts/test.sh)")

I64P = ctypes.POINTER(ctypes.c_int64)
H = ctypes.c_void_p


@pytest.fixture(scope="module")
def lib():
    load_own_provider("cpu")  # loaded as the runtime loads it; dlopen of the same path then hands back that library
    library = ctypes.CDLL(str(own_shim_path()), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    for name in ("cudarunner_shim_live_tensors", "cudarunner_shim_live_storages"):
        getattr(library, name).restype = ctypes.c_int64
    library.cudarunner_shim_last_error.restype = ctypes.c_char_p
    return library


def dims(*values: int):
    return (ctypes.c_int64 * max(1, len(values)))(*values)


def wrap(lib, array: np.ndarray, offset: int = 0) -> int:
    handle = H()
    strides = [stride // array.itemsize for stride in array.strides]
    code = {np.dtype(np.float32): 6, np.dtype(np.float64): 7, np.dtype(np.int64): 4}[array.dtype]
    status = lib.cudarunner_create_tensor_from_blob(ctypes.c_void_p(array.ctypes.data), ctypes.c_int64(array.ndim), dims(*array.shape),
                                                    dims(*strides), ctypes.c_int64(offset), code, 0, 0, ctypes.byref(handle))
    assert status == 0
    return handle.value


def read(lib, handle: int, dtype=np.float32) -> np.ndarray:
    """A NumPy view of a tensor handle's elements (its own sizes and strides)."""
    dim, sizes, strides, data = ctypes.c_int64(), I64P(), I64P(), ctypes.c_void_p()
    assert lib.cudarunner_get_dim(H(handle), ctypes.byref(dim)) == 0
    assert lib.cudarunner_get_sizes(H(handle), ctypes.byref(sizes)) == 0
    assert lib.cudarunner_get_strides(H(handle), ctypes.byref(strides)) == 0
    assert lib.cudarunner_get_data_ptr(H(handle), ctypes.byref(data)) == 0
    shape = tuple(sizes[i] for i in range(dim.value))
    item = np.dtype(dtype).itemsize
    span = 1 + sum((size - 1) * strides[i] for i, size in enumerate(shape)) if all(shape) else 0
    base = np.ctypeslib.as_array((ctypes.c_byte * (span * item)).from_address(data.value)).view(dtype) if span else np.empty(0, dtype)
    return np.lib.stride_tricks.as_strided(base, shape, tuple(strides[i] * item for i in range(dim.value)))


def live(lib) -> tuple[int, int]:
    return lib.cudarunner_shim_live_tensors(), lib.cudarunner_shim_live_storages()


def test_views_share_storage_and_every_handle_is_freed(lib):
    before = live(lib)
    array = np.arange(24, dtype=np.float32).reshape(4, 6)
    base = wrap(lib, array)
    view = H()
    # rows 1..2, every other column: sizes [2, 3], strides [6, 2], 6 elements further on
    assert lib.cudarunner__reinterpret_tensor(H(base), ctypes.c_int64(2), dims(2, 3), dims(6, 2), ctypes.c_int64(6), ctypes.byref(view)) == 0
    np.testing.assert_array_equal(read(lib, view.value), array[1:3, ::2])
    offset = ctypes.c_int64()
    assert lib.cudarunner_get_storage_offset(view, ctypes.byref(offset)) == 0 and offset.value == 6
    alias = H()
    assert lib.cudarunner_new_tensor_handle(view, ctypes.byref(alias)) == 0
    assert live(lib) == (before[0] + 3, before[1] + 1)  # one storage for three handles
    for handle in (base, view.value, alias.value):
        assert lib.cudarunner_delete_tensor_object(H(handle)) == 0
    assert live(lib) == before


def test_copies_and_clones_respect_strides(lib):
    source = np.arange(12, dtype=np.float64).reshape(3, 4)
    transposed = source.T  # strides (1, 4) in elements
    handle = wrap(lib, np.ascontiguousarray(source))
    t_view = H()
    assert lib.cudarunner__reinterpret_tensor(H(handle), ctypes.c_int64(2), dims(4, 3), dims(1, 4), ctypes.c_int64(0), ctypes.byref(t_view)) == 0
    clone, kept = H(), H()
    assert lib.cudarunner_clone(t_view, ctypes.byref(clone)) == 0
    np.testing.assert_array_equal(read(lib, clone.value, np.float64), transposed)
    assert read(lib, clone.value, np.float64).strides == (24, 8)  # clone is contiguous
    assert lib.cudarunner_clone_preserve_strides(t_view, ctypes.byref(kept)) == 0
    assert read(lib, kept.value, np.float64).strides == (8, 32)
    target = np.zeros((4, 3), np.float64)
    destination = wrap(lib, target)
    assert lib.cudarunner_copy_(H(destination), t_view, 0) == 0
    np.testing.assert_array_equal(target, transposed)
    assert lib.cudarunner_zero_(H(destination)) == 0 and not target.any()
    for item in (handle, t_view.value, clone.value, kept.value, destination):
        lib.cudarunner_delete_tensor_object(H(item))


def test_empty_strided_allocates_aligned_memory_and_sizes_every_dtype(lib):
    handle, data = H(), ctypes.c_void_p()
    for code, size in ((0, 1), (4, 8), (5, 2), (6, 4), (7, 8), (11, 1), (15, 2), (27, 2), (29, 8)):
        lib.cudarunner_dtype_element_size.restype = ctypes.c_size_t
        assert lib.cudarunner_dtype_element_size(code) == size
        assert lib.cudarunner_empty_strided(ctypes.c_int64(2), dims(3, 5), dims(5, 1), code, 0, 0, ctypes.byref(handle)) == 0
        storage = ctypes.c_int64()
        assert lib.cudarunner_get_storage_size(handle, ctypes.byref(storage)) == 0 and storage.value == 15 * size
        assert lib.cudarunner_get_data_ptr(handle, ctypes.byref(data)) == 0 and data.value % 64 == 0
        lib.cudarunner_delete_tensor_object(handle)


@pytest.mark.parametrize("case", ["null result", "negative size", "unknown dtype", "copy between dtypes", "overflowing span",
                                  "item of an undefined tensor", "zero_ of an undefined tensor", "clone of an undefined tensor",
                                  "as_strided past the storage", "negative view stride", "data missing"])
def test_bad_arguments_fail_with_a_reason_and_never_crash(lib, case):
    before = live(lib)
    handle = H()
    if case == "null result":
        status = lib.cudarunner_empty_strided(ctypes.c_int64(1), dims(4), dims(1), 6, 0, 0, None)
    elif case == "negative size":
        status = lib.cudarunner_empty_strided(ctypes.c_int64(1), dims(-4), dims(1), 6, 0, 0, ctypes.byref(handle))
    elif case == "unknown dtype":
        status = lib.cudarunner_empty_strided(ctypes.c_int64(1), dims(4), dims(1), 99, 0, 0, ctypes.byref(handle))
    elif case == "overflowing span":
        status = lib.cudarunner_empty_strided(ctypes.c_int64(2), dims(1 << 40, 1 << 40), dims(1 << 40, 1), 6, 0, 0, ctypes.byref(handle))
    elif case.endswith("undefined tensor"):
        undefined = H()
        assert lib.cudarunner_new_uninitialized_tensor(ctypes.byref(undefined)) == 0
        value = ctypes.c_float()
        status = {"item": lambda: lib.cudarunner_item_float32(undefined, ctypes.byref(value)), "zero_": lambda: lib.cudarunner_zero_(undefined),
                  "clone": lambda: lib.cudarunner_clone(undefined, ctypes.byref(handle))}[case.split()[0]]()
        # an undefined tensor is 0-dim (one element) with no data: refused, not dereferenced
        lib.cudarunner_delete_tensor_object(undefined)
    elif case in ("as_strided past the storage", "negative view stride"):
        array = np.zeros(4, np.float32)
        base = wrap(lib, array)
        if case == "as_strided past the storage":
            status = lib.cudarunner_as_strided(H(base), dims(2), dims(1000), ctypes.byref(handle))
        else:
            status = lib.cudarunner__reinterpret_tensor(H(base), ctypes.c_int64(1), dims(4), dims(-1), ctypes.c_int64(3), ctypes.byref(handle))
        lib.cudarunner_delete_tensor_object(H(base))
    elif case == "data missing":
        status = lib.cudarunner_create_tensor_from_blob(None, ctypes.c_int64(1), dims(4), dims(1), ctypes.c_int64(0), 6, 0, 0, ctypes.byref(handle))
    else:
        a, b = wrap(lib, np.zeros(3, np.float32)), wrap(lib, np.zeros(3, np.float64))
        status = lib.cudarunner_copy_(H(a), H(b), 0)
        lib.cudarunner_delete_tensor_object(H(a))
        lib.cudarunner_delete_tensor_object(H(b))
    assert status == 1
    assert lib.cudarunner_shim_last_error()
    assert live(lib) == before


def _view(lib, base: int, sizes, strides, offset=0) -> int:
    view = H()
    assert lib.cudarunner__reinterpret_tensor(H(base), ctypes.c_int64(len(sizes)), dims(*sizes), dims(*strides), ctypes.c_int64(offset),
                                              ctypes.byref(view)) == 0
    return view.value


def test_zero_of_a_broadcast_view_writes_each_element_once_and_refuses_what_it_cannot(lib):
    """zero_ of a zero-stride view whose element count overflows returned 0 and zeroed nothing."""
    before = live(lib)
    array = np.arange(1, 9, dtype=np.float32)
    base = wrap(lib, array)
    broadcast = _view(lib, base, (1 << 62, 4), (0, 1))  # 2^64 elements, four bytes apart... four floats
    assert lib.cudarunner_zero_(H(broadcast)) == 0
    np.testing.assert_array_equal(array, [0, 0, 0, 0, 5, 6, 7, 8])
    every_other = _view(lib, base, (2,), (2,), 4)
    array[:] = 1
    assert lib.cudarunner_zero_(H(every_other)) == 0
    np.testing.assert_array_equal(array, [1, 1, 1, 1, 0, 1, 0, 1])
    overlapping = _view(lib, base, (3, 3), (1, 1))  # element 1 is [0, 1] and [1, 0]: no loop writes each once
    status = lib.cudarunner_zero_(H(overlapping))
    assert status == 1 and b"overlap" in lib.cudarunner_shim_last_error()
    for handle in (base, broadcast, every_other, overlapping):
        lib.cudarunner_delete_tensor_object(H(handle))
    assert live(lib) == before


def test_a_gemm_whose_out_shares_memory_with_an_input_is_refused(lib):
    """cpu_mm_out with out aliasing an input, or with a zero-stride out, returned 0 with wrong numbers."""
    before = live(lib)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((4, 4)).astype(np.float32), rng.standard_normal((4, 4)).astype(np.float32)
    ha, hb = wrap(lib, a), wrap(lib, b)
    original = a.copy()
    assert lib.cudarunner_cpu_mm_out(H(ha), H(ha), H(hb)) == 1  # out is a
    np.testing.assert_array_equal(a, original)  # refused before anything was written
    out = np.zeros((4, 4), np.float32)
    ho = wrap(lib, out)
    column = _view(lib, ho, (4, 4), (1, 0))  # every column the same four floats
    assert lib.cudarunner_cpu_mm_out(H(column), H(ha), H(hb)) == 1
    part = _view(lib, ha, (2, 4), (4, 1), 8)  # the last two rows of a, as out of a 2x4 product of a's first rows
    top = _view(lib, ha, (2, 4), (4, 1))
    assert lib.cudarunner_cpu_mm_out(H(part), H(top), H(hb)) == 0  # apart in memory: fine
    np.testing.assert_allclose(a[2:], original[:2] @ b, rtol=1e-5)
    total = np.ones((4, 4), np.float32)
    ht = wrap(lib, total)
    assert lib.cudarunner_cpu_addmm_out(H(ht), H(ht), H(hb), H(hb), ctypes.c_double(1.0), ctypes.c_double(1.0)) == 0  # out is self: allowed
    np.testing.assert_allclose(total, 1 + b @ b, rtol=1e-5)
    for handle in (ha, hb, ho, column, part, top, ht):
        lib.cudarunner_delete_tensor_object(H(handle))
    assert live(lib) == before


def test_copy_between_overlapping_views_is_refused(lib):
    """copy_ between views that overlap returned 0 with wrong numbers (an element read after it was written)."""
    before = live(lib)
    array = np.arange(8, dtype=np.float32)
    base = wrap(lib, array)
    head, shifted = _view(lib, base, (6,), (1,)), _view(lib, base, (6,), (1,), 2)
    assert lib.cudarunner_copy_(H(shifted), H(head), 0) == 1
    np.testing.assert_array_equal(array, np.arange(8))
    assert lib.cudarunner_copy_(H(head), H(head), 0) == 0  # onto itself: nothing to do
    repeated = _view(lib, base, (3,), (0,))
    source = wrap(lib, np.array([7, 8, 9], np.float32))
    assert lib.cudarunner_copy_(H(repeated), H(source), 0) == 1  # three values into one element
    for handle in (base, head, shifted, repeated, source):
        lib.cudarunner_delete_tensor_object(H(handle))
    assert live(lib) == before


_PAST_THE_STORAGE = """
import ctypes, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_own_shim import H, dims, wrap
from cuda_runner.runtime.providers import load_own_provider, own_shim_path
load_own_provider("cpu")
lib = ctypes.CDLL(str(own_shim_path()))
lib.cudarunner_shim_last_error.restype = ctypes.c_char_p
base = wrap(lib, np.zeros(4, np.float32))
view, clone = H(), H()
status = lib.cudarunner__reinterpret_tensor(H(base), ctypes.c_int64(1), dims(1 << 24), dims(1), ctypes.c_int64(0), ctypes.byref(view))
if status == 0:
    lib.cudarunner_clone(view, ctypes.byref(clone))
print(status, lib.cudarunner_shim_last_error().decode())
"""


def test_a_reinterpreted_view_past_its_storage_is_refused():
    """_reinterpret_tensor past the storage, then clone, was a SIGSEGV (in a process of its own here)."""
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run([sys.executable, "-c", _PAST_THE_STORAGE, str(Path(__file__).parent)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-500:]
    assert result.stdout.strip() == "1 a view reaches past the end of its storage"


def test_deleters_never_fail_and_codes_are_libtorchs(lib):
    # Generated code deletes from destructors, where a failure status ends the process.
    assert lib.cudarunner_delete_tensor_object(None) == 0
    assert lib.cudarunner_delete_cuda_guard(None) == 0 and lib.cudarunner_delete_cuda_stream_guard(None) == 0
    codes = {"device_type_cpu": 0, "device_type_cuda": 1, "device_type_meta": 14, "device_type_xpu": 12, "device_type_mps": 13,
             "device_type_privateuse1": 20, "dtype_bfloat16": 15, "dtype_uint16": 27, "dtype_float8_e4m3fn": 24, "layout_strided": 0}
    assert {name: getattr(lib, f"cudarunner_{name}")() for name in codes} == codes


def test_cpu_addmm_matches_numpy_for_a_transposed_weight_and_a_broadcast_bias(lib):
    rng = np.random.default_rng(0)
    x, weight, bias = rng.standard_normal((5, 19)).astype(np.float32), rng.standard_normal((7, 19)).astype(np.float32), rng.standard_normal(7).astype(np.float32)
    out = np.empty((5, 7), np.float32)
    handles = [wrap(lib, out), wrap(lib, bias), wrap(lib, x), wrap(lib, weight)]
    weight_t = H()
    assert lib.cudarunner__reinterpret_tensor(H(handles[3]), ctypes.c_int64(2), dims(19, 7), dims(1, 19), ctypes.c_int64(0), ctypes.byref(weight_t)) == 0
    status = lib.cudarunner_cpu_addmm_out(H(handles[0]), H(handles[1]), H(handles[2]), weight_t, ctypes.c_double(0.5), ctypes.c_double(2.0))
    assert status == 0
    np.testing.assert_allclose(out, 0.5 * bias + 2.0 * x @ weight.T, rtol=1e-5, atol=1e-5)
    for handle in [*handles, weight_t.value]:
        lib.cudarunner_delete_tensor_object(H(handle))


def test_a_failed_check_in_generated_code_is_an_exception_not_an_abort(lib):
    lib.cudarunner_check.argtypes = (ctypes.c_bool, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_char_p)
    lib.cudarunner_check(True, b"f", b"file.cpp", 1, b"fine")  # passes silently
    # A failing check throws a C++ exception, which only the model's container catches; not callable from ctypes.


def library_of(bundle_path) -> bytes:
    with open_bundle(bundle_path) as reader:
        spec = reader.manifest.methods["forward"]
        return bytes(reader.read_verified(spec.library_segment))


def test_renaming_changes_only_the_renamed_import_names(dict_mlp_bundle):
    original = library_of(dict_mlp_bundle.path)
    renamed = rename_imports(original, RENAMES)
    before, after = read_library_facts(original, exports=True), read_library_facts(renamed, exports=True)
    assert len(original) == len(renamed)
    assert [name for name in after.undefined if name.startswith("aoti_torch_")] == []
    expected = sorted("cudarunner_" + name[len("aoti_torch_"):] if name.startswith("aoti_torch_") else name for name in before.undefined)
    assert sorted(after.undefined) == expected
    assert after.defined == before.defined and before.defined and after.needed == before.needed
    changed = [index for index, (a, b) in enumerate(zip(original, renamed)) if a != b]
    assert changed and max(changed) - min(changed) < 1 << 20  # all inside one string table
    with pytest.raises(ValueError):
        rename_imports(original, {"aoti_torch_": "short_"})


LAUNCHING_SOURCE = """
extern int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
extern int cuLaunchKernelEx(const void *, void *, void **, void **);
int launch(void *f) { return cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0) + cuLaunchKernelEx(0, f, 0, 0); }
"""


def test_a_cuda_library_launches_through_the_shim_by_exactly_that_name(tmp_path, lib):
    """cuLaunchKernel binds to the shim's crLaunchKernel; cuLaunchKernelEx, which starts with that name, keeps its own."""
    import shutil
    import subprocess

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    (tmp_path / "model.c").write_text(LAUNCHING_SOURCE)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "model.so"), str(tmp_path / "model.c")], check=True)
    renamed = read_library_facts(rename_imports((tmp_path / "model.so").read_bytes(), RENAMES))
    assert {"crLaunchKernel", "cuLaunchKernelEx"} <= set(renamed.undefined) and "cuLaunchKernel" not in renamed.undefined
    assert hasattr(lib, "crLaunchKernel")  # what the renamed import binds to


TAIL_SHARING_SOURCE = """
extern int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
extern int aoti_torch_get_data_ptr(void *, void **);
int my_cuLaunchKernel(void *f) { return cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0); }
int use(void *t, void **p) { return aoti_torch_get_data_ptr(t, p); }
"""


def test_a_library_whose_names_make_the_launch_rename_unsafe_still_binds_to_the_shim(tmp_path):
    """The linker lets my_cuLaunchKernel and cuLaunchKernel share bytes, so the
    launch cannot be renamed alone: the library keeps launching its kernels
    itself, and its shim functions are bound as before (a review found the
    shim refused such a library)."""
    import shutil
    import subprocess

    from cuda_runner.runtime.providers import bound_to_own_shim, own_shim_refusal

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    (tmp_path / "model.c").write_text(TAIL_SHARING_SOURCE)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "model.so"), str(tmp_path / "model.c")], check=True)
    library = (tmp_path / "model.so").read_bytes()
    with pytest.raises(BundleError):
        rename_imports(library, RENAMES)
    renamed = read_library_facts(bound_to_own_shim(library))
    assert "cudarunner_get_data_ptr" in renamed.undefined and "cuLaunchKernel" in renamed.undefined
    assert own_shim_refusal(library) is None


def test_our_shim_provides_every_import_of_the_cpu_fixtures(dict_mlp_bundle, embedder_bundle):
    assert "aoti_torch_cpu_addmm_out" in own_exports() and "Sleef_expf8_u10" in own_exports()
    for compiled in (dict_mlp_bundle, embedder_bundle):
        assert missing_from_own_shim([read_library_facts(library_of(compiled.path))]) == []


def test_cpu_bundles_give_the_same_outputs_on_both_providers(dict_mlp_bundle, embedder_bundle):
    import cuda_runner

    for compiled in (dict_mlp_bundle, embedder_bundle):
        inputs = [arg.numpy() for arg in compiled.args]
        with cuda_runner.load(compiled.path, provider="shim") as ours, cuda_runner.load(compiled.path, provider="libtorch") as theirs:
            assert ours.method().provider == SHIM_NAME and theirs.method().provider == "libtorch"
            mine, reference = ours.run(inputs), theirs.run(inputs)
        for name in reference:
            np.testing.assert_allclose(np.asarray(mine[name], np.float64), np.asarray(reference[name], np.float64), rtol=1e-5, atol=1e-6)


def test_a_bfloat16_gemm_runs_on_our_shim_as_on_libtorch(bf16_bundle):
    """It failed with "aoti_torch_cpu_addmm_out(...) API call failed", no reason given,
    though inspect said the bundle runs on the shim: bfloat16 GEMMs are float32 GEMMs rounded once."""
    import ml_dtypes

    import cuda_runner

    inputs = [arg.float().numpy().astype(ml_dtypes.bfloat16) for arg in bf16_bundle.args]
    outputs = {}
    for provider in ("shim", "libtorch"):
        with cuda_runner.load(bf16_bundle.path, provider=provider) as model:
            outputs[provider] = next(iter(model.run(inputs).values())).astype(np.float32)
    np.testing.assert_array_equal(outputs["shim"], outputs["libtorch"])


def test_a_rename_that_would_change_another_name_is_refused():
    from cuda_runner.format.elf import _check_no_overlap

    table = b"\0aoti_torch_get_sizes\0other\0"
    _check_no_overlap([(1, b"cudarunner_get_sizes")], [0, 22], table)  # names before and after it
    for inside in (1, 12):  # a defined symbol spelled alike, or "get_sizes" sharing its tail
        with pytest.raises(BundleError):
            _check_no_overlap([(1, b"cudarunner_get_sizes")], [inside], table)
    # The import is the tail of another name, "x" + its name: that name would change too.
    tail_shared = b"\0xaoti_torch_f\0"
    _check_no_overlap([(2, b"cudarunner_")], [13], tail_shared)  # "f" alone is past the renamed bytes
    with pytest.raises(BundleError):
        _check_no_overlap([(2, b"cudarunner_")], [1], tail_shared)
    # Two renamed ranges in one name: a name starting inside the first is refused
    # even where the second begins before it (a bisection over the ranges' starts alone misses it).
    with pytest.raises(BundleError):
        _check_no_overlap([(1, b"xxxxx"), (3, b"x")], [4], b"\0cc__abcb\0")


def test_the_rename_check_on_names_built_to_be_costly():
    """A 20 MB name ending in an import, and 4,000 imports each the tail of the
    one before in one name: judged like any other, without memory or time that
    grows with the name (a set of byte positions would hold 20 million here)."""
    from cuda_runner.format.elf import _check_no_overlap

    long_name = b"\0" + b"a" * 20_000_000 + b"aoti_torch_x\0"
    _check_no_overlap([(20_000_001, b"cudarunner_")], [0, len(long_name) - 1], long_name)
    with pytest.raises(BundleError):
        _check_no_overlap([(20_000_001, b"cudarunner_")], [1], long_name)
    chain = b"\0" + b"aoti_torch_" * 4000 + b"\0"
    imports = [(1 + 11 * index, b"cudarunner_") for index in range(4000)]
    _check_no_overlap(imports, [0, len(chain) - 1], chain)
    with pytest.raises(BundleError):
        _check_no_overlap(imports[1:], [5], chain)


@pytest.mark.parametrize("kind", [6, 0x6FFFFFFF, 0x6FFFFFFE], ids=["dynamic", "versym", "verneed"])
@pytest.mark.parametrize("field", [4, 40], ids=["retyped", "relinked"])
def test_a_section_header_that_hides_a_table_from_the_renaming_is_refused(dict_mlp_bundle, kind, field):
    """The loader finds the dynamic table and the version tables through the
    dynamic segment, the renaming through the section headers: a header
    retyped (PROGBITS) or linked to another table would hide a library name
    from the overlap check, or a symbol version from the version check."""
    import struct

    library = bytearray(library_of(dict_mlp_bundle.path))
    rename_imports(bytes(library), RENAMES)  # as it is: renamed
    offset = struct.unpack_from("<Q", library, 0x28)[0]
    count = struct.unpack_from("<H", library, 0x3C)[0]
    (index,) = [index for index in range(count) if struct.unpack_from("<I", library, offset + 64 * index + 4)[0] == kind]
    struct.pack_into("<I", library, offset + 64 * index + field, 1 if field == 4 else 0)
    with pytest.raises(BundleError):  # relinked .dynamic: its names are then read from no table at all
        rename_imports(bytes(library), RENAMES)


def test_a_second_version_table_is_refused(dict_mlp_bundle):
    """Two symbol-version tables: the loader reads the one DT_VERSYM names, the
    renaming would read the first; a copy of the real header made to look like
    another table (the .dynstr header retyped as a versym linked to the symbols)."""
    import struct

    library = bytearray(library_of(dict_mlp_bundle.path))
    offset = struct.unpack_from("<Q", library, 0x28)[0]
    count = struct.unpack_from("<H", library, 0x3C)[0]
    kinds = [struct.unpack_from("<I", library, offset + 64 * index + 4)[0] for index in range(count)]
    versym = kinds.index(0x6FFFFFFF)
    dynamic_strings = struct.unpack_from("<I", library, offset + 64 * kinds.index(11) + 40)[0]  # .dynsym's sh_link
    strings = next(index for index, kind in enumerate(kinds) if kind == 3 and index != dynamic_strings)  # .strtab or .shstrtab
    library[offset + 64 * strings:offset + 64 * strings + 64] = library[offset + 64 * versym:offset + 64 * versym + 64]
    struct.pack_into("<Q", library, offset + 64 * strings + 24, struct.unpack_from("<Q", library, offset + 64 * versym + 24)[0] + 2)
    with pytest.raises(BundleError, match="more than one symbol version table"):
        rename_imports(bytes(library), RENAMES)


def test_the_names_of_the_versions_a_library_defines_are_references():
    import struct

    from cuda_runner.format.elf import _verdef_strings

    first = struct.pack("<HHHHIII", 1, 1, 1, 1, 0, 20, 28) + struct.pack("<II", 5, 0)
    second = struct.pack("<HHHHIII", 1, 0, 2, 2, 0, 20, 0) + struct.pack("<II", 9, 8) + struct.pack("<II", 13, 0)
    assert _verdef_strings(memoryview(first + second)) == [5, 9, 13]
    assert _verdef_strings(memoryview(first[:10])) == []  # cut short: nothing read past the end


def test_a_library_without_a_section_table_is_refused(dict_mlp_bundle):
    """The loader reads the dynamic segment; a library whose section headers are
    gone (or lie) must not pass as one with nothing to rename."""
    import struct

    stripped = bytearray(library_of(dict_mlp_bundle.path))
    struct.pack_into("<Q", stripped, 0x28, 0)  # e_shoff
    struct.pack_into("<H", stripped, 0x3C, 0)  # e_shnum
    with pytest.raises(BundleError):
        rename_imports(bytes(stripped), RENAMES)


def test_a_truncated_library_is_refused(dict_mlp_bundle):
    with pytest.raises(BundleError):
        rename_imports(library_of(dict_mlp_bundle.path)[:100], RENAMES)


@pytest.mark.parametrize("call_helper", [True, False])
def test_interrupts_at_any_moment_of_a_run_leave_no_tensor_behind(lib, dict_mlp_bundle, call_helper):
    """Ctrl-C lands between Python bytecodes, anywhere in Model.run: every handle
    the run made must still be freed. The shim counts live tensors, so a leak of
    one output handle shows."""
    import random
    import signal

    rng = random.Random(0)
    inputs = [arg.numpy() for arg in dict_mlp_bundle.args]
    # Python's own SIGINT handler, whatever an earlier test in this worker left
    # (Ray, for one, replaces it): interrupt_main does nothing under SIG_IGN.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_runs(lib, dict_mlp_bundle, call_helper, rng, inputs)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_runs(lib, dict_mlp_bundle, call_helper, rng, inputs):
    import _thread
    import threading

    import cuda_runner

    with cuda_runner.load(dict_mlp_bundle.path, provider="shim", call_helper=call_helper) as model:
        model.run(inputs)
        baseline = live(lib)
        interrupted = 0
        for _ in range(400):
            timer = threading.Timer(rng.uniform(0, 0.0004), _thread.interrupt_main)
            try:
                timer.start()
                model.run(inputs)
                timer.join()
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                timer.cancel()
                try:
                    timer.join()
                except KeyboardInterrupt:  # it fired after all
                    interrupted += 1
        assert interrupted > 50  # the interrupts did land
        assert live(lib) == baseline


def test_a_closed_model_says_so(dict_mlp_bundle):
    import cuda_runner
    from cuda_runner.errors import ClosedError

    model = cuda_runner.load(dict_mlp_bundle.path)
    model.close()
    with pytest.raises(ClosedError, match="the model is closed"):
        model.run([arg.numpy() for arg in dict_mlp_bundle.args])


def test_a_library_that_needs_libtorch_on_a_machine_without_it_is_one_clear_error(monkeypatch):
    from cuda_runner.errors import DeviceError
    from cuda_runner.format.elf import LibraryFacts
    from cuda_runner.runtime import providers

    monkeypatch.setattr(providers, "libtorch_installed", lambda: False)
    facts = LibraryFacts(needed=(), undefined=("aoti_torch_proxy_executor_call_function", "aoti_torch_empty_strided"), kernels=())
    monkeypatch.setattr(providers, "read_library_facts", lambda library: facts)
    lacks = r"cuda-runner's shim lacks aoti_torch_proxy_executor_call_function"
    with pytest.raises(DeviceError, match=rf"needs libtorch \({lacks}\); install it with") as refused:
        providers.bind_library(b"", "cpu")
    assert refused.value.exit_code == 4
    with pytest.raises(DeviceError, match=lacks):
        providers.bind_library(b"", "cpu", "shim")


@pytest.mark.heavy
def test_auto_leaves_a_libtorch_that_lacks_an_import_for_the_shim(monkeypatch, compiled):
    """A partial torch (one without a function the library imports) is passed over for the shim."""
    from cuda_runner.runtime import providers

    library = library_of(compiled("tiny_resnet", "cpu").path)
    monkeypatch.setattr(providers, "missing_symbols", lambda names, device_type: (["aoti_torch_cpu_convolution"], device_type))
    assert providers.bind_library(library, "cpu")[0].name == providers.SHIM_NAME
    monkeypatch.undo()
    assert providers.bind_library(library, "cpu")[0].name == providers.LIBTORCH_NAME


@pytest.mark.parametrize("name, programmatic", [
    ("cudarunner_pdl_matvec_fused_3", True),  # cuda-runner's own kernels
    ("triton_poi_cudarunner_pdl_fused_1", True),  # Inductor's, where the build marked them (compile/inductor_pdl.py)
    ("triton_red_cudarunner_pdl_fused_embedding_0", True),
    ("triton_poi_fused_cudarunner_pdl_op_1", False),  # a custom op so named: its kernel has no waits
    ("model_triton_poi_cudarunner_pdl_fused_1", False),  # aot_inductor.model_name_for_generated_files before it
    ("my_cudarunner_pdl_kernel", False),
    ("triton_poi_fused_1", False),
    ("triton_", False),
    ("", False),
])
def test_only_a_kernel_named_with_the_mark_where_cuda_runner_puts_it_is_launched_as_a_programmatic_dependent(lib, name, programmatic):
    assert lib.cudarunner_shim_programmatic_name(name.encode()) == int(programmatic)
