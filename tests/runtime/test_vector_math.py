"""The shim's vector math (native/vector_math.cpp) against libtorch's SLEEF.

Every function and width the shim exports (`cr_sl_*`, the names CPU model
libraries import as `Sleef_*`) is called on random inputs over the whole
range of its type, denormals included, and on edge values (zeros, infinities,
NaN, denormals, the extremes, huge arguments, each function's thresholds),
next to libtorch's own SLEEF function of the same name. Both promise the
ULP bound their name gives (u10: 1.0, u15: 1.5, u35: 3.5, u05: 0.5, none:
exact); they must agree within the sum of their bounds, and agree exactly on
which results are NaN or infinite. The documented exception: double lgamma
near its zeros for negative arguments, where only the absolute error is
bounded (SLEEF documents the same). A width this CPU cannot run is skipped,
saying so (the CI machines have no AVX-512; the GPU machine runs this file too).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from cuda_runner.runtime.providers import own_shim_path

pytestmark = pytest.mark.skipif(own_shim_path() is None, reason="the shim is built by pip install (scripts/test.sh)")

DRIVER = r"""
#include <immintrin.h>
#define RUN(name, isa, type, vec, lanes, load, store)                                                           \
  extern "C" __attribute__((target(isa))) void name(void *fn, int arity, const type *x, const type *y, type *o, long n) { \
    for (long i = 0; i < n; i += lanes) {                                                                         \
      vec r = arity == 1 ? ((vec(*)(vec))fn)(load(x + i)) : ((vec(*)(vec, vec))fn)(load(x + i), load(y + i));     \
      store(o + i, r);                                                                                            \
    }                                                                                                             \
  }
RUN(run_f4, "sse2", float, __m128, 4, _mm_loadu_ps, _mm_storeu_ps)
RUN(run_d2, "sse2", double, __m128d, 2, _mm_loadu_pd, _mm_storeu_pd)
RUN(run_f8, "avx2", float, __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps)
RUN(run_d4, "avx2", double, __m256d, 4, _mm256_loadu_pd, _mm256_storeu_pd)
RUN(run_f16, "avx512f", float, __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps)
RUN(run_d8, "avx512f", double, __m512d, 8, _mm512_loadu_pd, _mm512_storeu_pd)
"""

# name: (arity, suffixes, typical range)
FUNCTIONS = {
    "exp": (1, ("_u10",), 90), "exp2": (1, ("_u10",), 130), "expm1": (1, ("_u10",), 10), "log": (1, ("_u10",), 1e3), "log2": (1, ("_u10",), 1e3),
    "log10": (1, ("_u10",), 1e3), "log1p": (1, ("_u10",), 10), "sin": (1, ("_u10", "_u35"), 20), "cos": (1, ("_u10", "_u35"), 20),
    "tan": (1, ("_u10",), 20), "asin": (1, ("_u10",), 1), "acos": (1, ("_u10",), 1), "atan": (1, ("_u10",), 20), "sinh": (1, ("_u10",), 20),
    "cosh": (1, ("_u10",), 20), "tanh": (1, ("_u10",), 10), "asinh": (1, ("_u10",), 20), "acosh": (1, ("_u10",), 20),
    "atanh": (1, ("_u10",), 1), "erf": (1, ("_u10",), 5), "erfc": (1, ("_u15",), 10), "lgamma": (1, ("_u10",), 10),
    "atan2": (2, ("_u10",), 20), "pow": (2, ("_u10",), 10), "hypot": (2, ("_u05",), 1e3), "fmod": (2, ("",), 1e3),
    "nextafter": (2, ("",), 1e3), "copysign": (2, ("",), 1e3),
}
BOUNDS = {"_u10": 1.0, "_u15": 1.5, "_u35": 3.5, "_u05": 0.5, "": 0.0}
WIDTHS = {"f4": ("sse2", np.float32, 4), "d2": ("sse2", np.float64, 2), "f8": ("avx2", np.float32, 8), "d4": ("avx2", np.float64, 4),
          "f16": ("avx512f", np.float32, 16), "d8": ("avx512f", np.float64, 8)}


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    import torch

    if shutil.which("g++") is None:
        pytest.skip("needs g++ for the calling driver")
    folder = tmp_path_factory.mktemp("vector-math")
    (folder / "driver.cpp").write_text(DRIVER)
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(folder / "driver.so"), str(folder / "driver.cpp")], check=True)
    from pathlib import Path

    sleef = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))  # loaded by torch already: the same handle
    return ctypes.CDLL(str(folder / "driver.so")), ctypes.CDLL(str(own_shim_path())), sleef


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            return any(flag in line.split() for line in info if line.startswith("flags"))
    except OSError:
        return False


def _inputs(dtype, arity: int, scale: float, rng: np.random.Generator, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    info = np.finfo(dtype)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, float(info.smallest_subnormal), -float(info.smallest_subnormal),
                      float(info.tiny), float(info.max), -float(info.max), 1.0, -1.0, 0.5, 2.0, 1e30, -1e30, 1e10, 3.0, -3.0,
                      float(info.eps), 88.7, -103.9, 709.7, -745.1, 0.9999, 1.0001, -2.4570247, -2.7476826], dtype=np.float64)
    with np.errstate(over="ignore"):
        edges = edges.astype(dtype)
    magnitudes = np.exp2(rng.uniform(np.log2(float(info.smallest_subnormal)), np.log2(float(info.max)), 3000)).astype(dtype)
    signs = rng.choice([-1, 1], 3000).astype(dtype)
    common = rng.uniform(-scale, scale, 3000).astype(dtype)
    x = np.concatenate([edges, magnitudes * signs, common])
    if arity == 2:  # pairs: every edge against every edge, and random pairs
        grid = np.array(np.meshgrid(edges, edges)).reshape(2, -1)
        y = np.concatenate([rng.permutation(x), grid[1]])
        x = np.concatenate([x, grid[0]])
    else:
        y = x.copy()
    padding = (-len(x)) % 16  # a multiple of every width: the reference may run at another
    return np.concatenate([x, x[:padding]]), np.concatenate([y, y[:padding]])


def _ulps(got: np.ndarray, want: np.ndarray, dtype) -> np.ndarray:
    """|got - want| in ULPs of want (of the smallest subnormal for results that small)."""
    info = np.finfo(dtype)
    spacing = np.maximum(np.abs(np.spacing(want.astype(dtype))).astype(np.float64), float(info.smallest_subnormal))
    with np.errstate(invalid="ignore", over="ignore"):
        return np.abs(got.astype(np.float64) - want.astype(np.float64)) / spacing


EXACT = {"fmod": np.fmod, "nextafter": np.nextafter, "copysign": np.copysign}
LIBM = {"asinh": np.arcsinh, "acosh": np.arccosh}


def _call(driver, width: str, function, arity: int, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    getattr(driver, f"run_{width}")(ctypes.cast(function, ctypes.c_void_p), arity, x.ctypes.data_as(ctypes.c_void_p),
                                    y.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(len(x)))
    return out


CASES = [(name, suffix, width) for name, (_, suffixes, _) in FUNCTIONS.items() for suffix in suffixes for width in WIDTHS]


@pytest.mark.parametrize(("name", "suffix", "width"), CASES, ids=[f"{name}{width}{suffix}" for name, suffix, width in CASES])
def test_each_function_agrees_with_libtorchs_sleef(libraries, name, suffix, width):
    driver, shim, sleef = libraries
    flag, dtype, lanes = WIDTHS[width]
    if flag == "avx512f" and not _cpu_has("avx512f"):
        pytest.skip("this CPU has no AVX-512: the f16/d8 entry points are run on the GPU machine's CPU")
    arity, _, scale = FUNCTIONS[name]
    symbol = f"{name}{width}{suffix}"
    x, y = _inputs(dtype, arity, scale, np.random.default_rng(len(symbol)), lanes)
    got = _call(driver, width, getattr(shim, f"cr_sl_{symbol}"), arity, x, y)
    if name in EXACT:  # exact functions: C99's results, which NumPy's match (SLEEF's fmod gives NaN for huge quotients)
        want = EXACT[name](x, y)
    elif name in LIBM:  # SLEEF gives infinity past 1e18 or so, where the result is finite: long-double libm instead
        with np.errstate(invalid="ignore", divide="ignore"):
            want = LIBM[name](x.astype(np.longdouble)).astype(dtype)
    else:  # libtorch exports no SSE widths: their reference is its AVX2 function of the same precision
        reference = width if hasattr(sleef, f"Sleef_{symbol}") else ("f8" if dtype == np.float32 else "d4")
        want = _call(driver, reference, getattr(sleef, f"Sleef_{name}{reference}{suffix}"), arity, x, y)
    where = [f"{name}({x[index]!r}{', ' + repr(y[index]) if arity == 2 else ''}) = {got[index]!r}, reference {want[index]!r}"
             for index in np.flatnonzero(np.isnan(got) != np.isnan(want))[:3]]
    assert not where, f"NaN where the reference has none, or none where it has: {where}"
    finite = np.isfinite(want) & np.isfinite(got)
    infinite = [f"{name}({x[index]!r}{', ' + repr(y[index]) if arity == 2 else ''}) = {got[index]!r}, reference {want[index]!r}"
                for index in np.flatnonzero((np.isinf(got) | np.isinf(want)) & (got != want))[:3]]
    assert not infinite, f"infinities differ: {infinite}"
    errors = _ulps(got[finite], want[finite], dtype)
    allowed = 2 * BOUNDS[suffix] + (0.5 if suffix else 0.0)  # both within their bound of the exact value, plus a rounding
    if name == "lgamma":  # near its negative zeros both only bound the absolute error
        near_zero = (x[finite] < 0) & (np.abs(want[finite]) < 0.5)
        assert np.all(np.abs(got[finite] - want[finite])[near_zero] <= (1e-15 if dtype == np.float64 else 1e-6))
        errors = errors[~near_zero]
    worst = int(np.argmax(errors)) if errors.size else 0
    assert errors.size == 0 or errors[worst] <= allowed, (
        f"{symbol}: {errors[worst]:.2f} ULP from SLEEF at {x[finite][worst]!r}: {got[finite][worst]!r} against {want[finite][worst]!r}")
