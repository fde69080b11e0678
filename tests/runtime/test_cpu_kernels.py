"""The shim's CPU compute kernels (native/cpu_kernels.cpp) against libtorch, on
random inputs: GEMMs in every layout and dtype (through the BLAS, and the
shim's own loops without one), convolutions of every kind, edge values."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from cuda_runner.runtime.providers import blas_candidates, load_own_provider, own_shim_path, shim_blas

pytestmark = pytest.mark.skipif(own_shim_path() is None, reason="the shim is built by pip install (scripts/test.sh)")

H = ctypes.c_void_p
CODES = {torch.float32: 6, torch.float64: 7, torch.float16: 5, torch.bfloat16: 15}
# How close the shim must come to libtorch: float32 GEMMs differ in their order
# of additions; half precisions are computed in float32 and rounded once, like libtorch's.
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module")
def lib():
    load_own_provider("cpu")
    library = ctypes.CDLL(str(own_shim_path()))
    library.cudarunner_shim_last_error.restype = ctypes.c_char_p
    for name in ("cudarunner_shim_live_tensors", "cudarunner_shim_live_storages"):
        getattr(library, name).restype = ctypes.c_int64
    return library


def _dims(values):
    return (ctypes.c_int64 * max(1, len(values)))(*values)


class Wrapped:
    """A torch tensor's memory as a shim tensor handle (same sizes and strides); the tensor stays alive with it."""

    def __init__(self, lib, tensor: torch.Tensor):
        self.tensor, self.handle, self.lib = tensor, H(), lib
        status = lib.cudarunner_create_tensor_from_blob(
            H(tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()), ctypes.c_int64(tensor.dim()), _dims(tensor.shape),
            _dims(tensor.stride()), ctypes.c_int64(tensor.storage_offset()), CODES[tensor.dtype], 0, 0, ctypes.byref(self.handle))
        assert status == 0, lib.cudarunner_shim_last_error()

    def __del__(self):
        self.lib.cudarunner_delete_tensor_object(self.handle)


def _as_tensor(lib, handle: H, dtype: torch.dtype) -> torch.Tensor:
    """A copy of what a shim handle holds (sizes and strides as it has them)."""
    dim, sizes, strides, data = ctypes.c_int64(), ctypes.POINTER(ctypes.c_int64)(), ctypes.POINTER(ctypes.c_int64)(), H()
    lib.cudarunner_get_dim(handle, ctypes.byref(dim))
    lib.cudarunner_get_sizes(handle, ctypes.byref(sizes))
    lib.cudarunner_get_strides(handle, ctypes.byref(strides))
    lib.cudarunner_get_data_ptr(handle, ctypes.byref(data))
    shape, stride = [sizes[i] for i in range(dim.value)], [strides[i] for i in range(dim.value)]
    span = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * (span * itemsize)).from_address(data.value)).copy()
    flat = torch.from_numpy(raw).view(dtype)
    return torch.as_strided(flat, shape, stride).clone(), stride


def _layout(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values in another layout: as is, transposed storage, or a strided slice of a larger buffer."""
    if kind == "transposed":
        return tensor.t().contiguous().t()
    if kind == "sliced":
        padded = torch.zeros(tensor.shape[0] * 2, tensor.shape[1] * 3, dtype=tensor.dtype)
        padded[::2, ::3] = tensor
        return padded[::2, ::3]
    return tensor


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    scale = max(1.0, float(want.float().abs().max()))
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype] * scale, rtol=TOLERANCE[dtype], equal_nan=True, msg=what)


@pytest.mark.parametrize("dtype", list(CODES), ids=lambda dtype: str(dtype).split(".")[1])
def test_gemms_match_libtorch_in_every_layout(lib, dtype):
    rng = torch.Generator().manual_seed(1)
    for m, k, n in ((1, 1, 1), (3, 17, 5), (64, 96, 33), (1, 256, 8), (40, 1, 40)):
        a, b = torch.randn(m, k, generator=rng).to(dtype), torch.randn(k, n, generator=rng).to(dtype)
        bias = torch.randn(n, generator=rng).to(dtype)
        for a_kind in ("plain", "transposed", "sliced"):
            for b_kind, out_kind in (("plain", "plain"), ("transposed", "transposed"), ("sliced", "sliced"), ("transposed", "plain")):
                x, y = _layout(a, a_kind), _layout(b, b_kind)
                out = _layout(torch.full((m, n), float("nan"), dtype=dtype), out_kind)  # what beta 0 must not read
                wrapped = [Wrapped(lib, tensor) for tensor in (out, bias, x, y)]
                assert lib.cudarunner_cpu_addmm_out(wrapped[0].handle, wrapped[1].handle, wrapped[2].handle, wrapped[3].handle,
                                                    ctypes.c_double(0.5), ctypes.c_double(2.0)) == 0, lib.cudarunner_shim_last_error()
                _close(out, torch.addmm(bias, x, y, beta=0.5, alpha=2.0), dtype, f"addmm {m}x{k}x{n} {a_kind}/{b_kind}/{out_kind}")
                assert lib.cudarunner_cpu_mm_out(wrapped[0].handle, wrapped[2].handle, wrapped[3].handle) == 0
                _close(out, x @ y, dtype, f"mm {m}x{k}x{n} {a_kind}/{b_kind}/{out_kind}")
    batch_a, batch_b = torch.randn(3, 7, 9, generator=rng).to(dtype), torch.randn(3, 9, 4, generator=rng).to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.empty(3, 7, 4, dtype=dtype)
    wrapped = [Wrapped(lib, tensor) for tensor in (out, batch_a, batch_b)]
    assert lib.cudarunner_cpu_bmm_out(*(item.handle for item in wrapped)) == 0
    _close(out, torch.bmm(batch_a, batch_b), dtype, "bmm")


@pytest.mark.parametrize("dtype", list(CODES), ids=lambda dtype: str(dtype).split(".")[1])
def test_gemm_edge_values_propagate_as_in_libtorch(lib, dtype):
    """NaN and infinity in an input reach exactly the outputs they reach in libtorch; huge values overflow alike; denormals stay."""
    a = torch.tensor([[1.0, float("nan"), 2.0], [float("inf"), 1.0, 0.0], [1e-40, 1e-40, 3.0], [3e38, 3e38, 1.0]], dtype=torch.float32).to(dtype)
    b = torch.tensor([[1.0, 0.0], [1.0, 2.0], [1.0, -1.0]], dtype=torch.float32).to(dtype)
    out = torch.empty(4, 2, dtype=dtype)
    wrapped = [Wrapped(lib, tensor) for tensor in (out, a, b)]
    assert lib.cudarunner_cpu_mm_out(*(item.handle for item in wrapped)) == 0
    want = a @ b
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.equal(torch.isinf(out), torch.isinf(want))
    _close(out, want, dtype, "edge values")


CONVOLUTIONS = [
    # (input shape, weight shape, stride, padding, dilation, transposed, output padding, groups)
    ((2, 3, 11, 9), (8, 3, 3, 3), (1, 1), (1, 1), (1, 1), False, (0, 0), 1),
    ((1, 4, 12, 12), (6, 2, 3, 2), (2, 1), (1, 0), (2, 1), False, (0, 0), 2),
    ((1, 8, 10, 10), (8, 1, 3, 3), (1, 1), (2, 2), (2, 2), False, (0, 0), 8),  # depthwise, dilated
    ((2, 6, 7, 7), (4, 6, 1, 1), (1, 1), (0, 0), (1, 1), False, (0, 0), 1),  # 1x1
    ((1, 80, 30), (16, 80, 3), (1,), (1,), (1,), False, (0,), 1),  # conv1d, Whisper's front
    ((2, 16, 31), (16, 16, 3), (2,), (1,), (1,), False, (0,), 1),
    ((1, 2, 5, 6, 4), (3, 2, 3, 3, 2), (1, 2, 1), (1, 1, 0), (1, 1, 1), False, (0, 0, 0), 1),  # conv3d
    ((1, 4, 5, 5), (4, 3, 3, 3), (2, 2), (1, 1), (1, 1), True, (1, 1), 1),  # transposed
    ((1, 4, 6), (4, 2, 4), (3,), (0,), (2,), True, (1,), 2),  # transposed conv1d, grouped
    ((3, 9, 9), (5, 3, 3, 3), (1, 1), (1, 1), (1, 1), False, (0, 0), 1),  # unbatched
]


def _convolve(lib, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    result = H()
    bias_handle = Wrapped(lib, bias) if bias is not None else None
    bias_pointer = ctypes.byref(bias_handle.handle) if bias_handle is not None else None
    x_wrapped, w_wrapped = Wrapped(lib, x), Wrapped(lib, weight)
    status = lib.cudarunner_cpu_convolution(
        x_wrapped.handle, w_wrapped.handle, bias_pointer, _dims(stride), ctypes.c_int64(len(stride)), _dims(padding), ctypes.c_int64(len(padding)),
        _dims(dilation), ctypes.c_int64(len(dilation)), ctypes.c_int32(int(transposed)), _dims(output_padding), ctypes.c_int64(len(output_padding)),
        ctypes.c_int64(groups), ctypes.byref(result))
    assert status == 0, lib.cudarunner_shim_last_error()
    got, strides = _as_tensor(lib, result, x.dtype)
    lib.cudarunner_delete_tensor_object(result)
    return got, strides


@pytest.mark.parametrize("dtype", list(CODES), ids=lambda dtype: str(dtype).split(".")[1])
@pytest.mark.parametrize("case", CONVOLUTIONS, ids=lambda case: f"{len(case[1]) - 2}d-{'t' if case[5] else 'f'}-g{case[7]}-{'x'.join(map(str, case[0]))}")
def test_convolutions_match_libtorch(lib, dtype, case):
    shape, weight_shape, stride, padding, dilation, transposed, output_padding, groups = case
    rng = torch.Generator().manual_seed(sum(shape))
    x, weight = torch.randn(shape, generator=rng).to(dtype), torch.randn(weight_shape, generator=rng).to(dtype)
    out_channels = weight_shape[1] * groups if transposed else weight_shape[0]
    bias = torch.randn(out_channels, generator=rng).to(dtype)
    before = lib.cudarunner_shim_live_tensors()
    layouts = [(x, weight)]
    if x.dim() == 4:  # Inductor hands 2-D convolutions channels-last tensors; the result must be channels-last too
        layouts.append((x.to(memory_format=torch.channels_last), weight.to(memory_format=torch.channels_last)))
    unbatched = x.dim() == len(weight_shape) - 1  # aten's convolution takes a batch: one of 1, taken off again

    def aten(given, kernel, bias):
        batch = given.unsqueeze(0) if unbatched else given
        result = torch.ops.aten.convolution(batch, kernel, bias, list(stride), list(padding), list(dilation), transposed, list(output_padding), groups)
        return result.squeeze(0) if unbatched else result

    for given, kernel in layouts:
        wide = dtype in (torch.float16, torch.bfloat16)  # what the shim computes in: float32, rounded once
        want = aten(given.float() if wide else given, kernel.float() if wide else kernel, bias.float() if wide else bias)
        reference = aten(given, kernel, bias)
        got, strides = _convolve(lib, given, kernel, bias, stride, padding, dilation, transposed, output_padding, groups)
        assert tuple(strides) == reference.stride(), "the result's layout is libtorch's"
        _close(got, want.to(dtype), dtype, f"convolution {case}")
        got, _ = _convolve(lib, given, kernel, None, stride, padding, dilation, transposed, output_padding, groups)
        _close(got, (want - bias.float().view(-1, *([1] * (len(weight_shape) - 2)))).to(dtype), dtype, "no bias")
    assert lib.cudarunner_shim_live_tensors() == before


def test_a_convolution_the_shim_cannot_do_is_refused_with_a_reason(lib):
    def convolve(x, weight, groups):
        result, inputs = H(), (Wrapped(lib, x), Wrapped(lib, weight))
        two = ctypes.c_int64(2)
        return lib.cudarunner_cpu_convolution(inputs[0].handle, inputs[1].handle, None, _dims([1, 1]), two, _dims([0, 0]), two, _dims([1, 1]), two,
                                              ctypes.c_int32(0), _dims([0, 0]), two, ctypes.c_int64(groups), ctypes.byref(result))

    assert convolve(torch.randn(1, 4, 5, 5), torch.randn(3, 2, 3, 3), 3) == 1  # 4 channels in 3 groups
    assert b"groups" in lib.cudarunner_shim_last_error()
    assert convolve(torch.randn(1, 2, 2, 2), torch.randn(1, 2, 3, 3), 1) == 1
    assert b"larger than the padded input" in lib.cudarunner_shim_last_error()


def test_the_gemms_run_on_the_blas_numpy_bundles(lib):
    """The BLAS is found without importing anything: NumPy's own OpenBLAS first, where its wheel bundles one."""
    candidates = blas_candidates()
    if not candidates:
        pytest.skip("no scipy-openblas build on this machine (NumPy's wheel bundles one on Linux)")
    assert shim_blas() == candidates[0]


_WITHOUT_BLAS = """
import ctypes, sys, torch
sys.path.insert(0, sys.argv[1])
import test_cpu_kernels as kernels
from cuda_runner.runtime.providers import load_own_provider, own_shim_path, shim_blas
load_own_provider("cpu")
assert shim_blas() is None, shim_blas()
lib = ctypes.CDLL(str(own_shim_path()))
lib.cudarunner_shim_last_error.restype = ctypes.c_char_p
for dtype in kernels.CODES:
    kernels.test_gemms_match_libtorch_in_every_layout(lib, dtype)
    kernels.test_convolutions_match_libtorch(lib, dtype, kernels.CONVOLUTIONS[1])
print("ok")
"""


def test_without_a_blas_the_shims_own_loops_give_the_same_numbers():
    result = subprocess.run([sys.executable, "-c", _WITHOUT_BLAS, os.path.dirname(__file__)], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, CUDA_RUNNER_BLAS="none"))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
