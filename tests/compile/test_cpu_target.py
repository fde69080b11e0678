"""CPU bundles: the vector ISA Inductor's probe finds, the -march level, and
the CPU flags a bundle requires (compile --cpu-target)."""

from __future__ import annotations

import platform
import subprocess

import pytest

from cuda_runner.compile.aot import _flags_enabled_by, _unloadable_compiler, check_cpu_target
from cuda_runner.errors import InputError
from cuda_runner.format import read_manifest

x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 levels")


def test_unknown_cpu_targets_are_refused():
    with pytest.raises(InputError, match="unknown CPU target"):
        check_cpu_target("haswell")


def test_cpu_bundles_get_vector_code_where_the_cpu_has_it(compiled):
    """Inductor's probe links libtorch only with link_libtorch on: run under
    the bundle's link_libtorch=False it failed and every bundle was scalar."""
    import torch

    if not torch.cpu._is_avx2_supported():
        pytest.skip("this CPU has no AVX2")
    device = read_manifest(compiled("linear", "cpu").path).methods["forward"].device
    assert device.cpu_isa is not None and device.cpu_isa != "INVALID_VEC_ISA"


@x86
def test_a_portable_level_requires_only_its_own_flags():
    assert _flags_enabled_by("g++", ["-march=x86-64-v3", "-mavx2", "-mfma", "-mf16c"]) == (
        "abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "popcnt", "sse2", "sse4_1", "sse4_2", "ssse3")
    assert _flags_enabled_by("g++", ["-march=x86-64"]) == ("sse2",)


@x86
def test_the_wrapper_turns_march_native_into_the_level(tmp_path, monkeypatch):
    """Before torch 2.13 Inductor always passes -march=native: the wrapper rewrites it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    wrapper = _unloadable_compiler(tmp_path, "x86-64")

    def macros(compiler: str, *flags: str) -> str:
        return subprocess.run([compiler, *flags, "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True, text=True, check=True).stdout

    assert macros(wrapper, "-march=native") == macros("g++", "-fno-gnu-unique", "-march=x86-64")


@x86
def test_a_default_cpu_bundle_is_portable_and_inspect_names_its_isa(compiled):
    """The default target is the widest x86-64 level this CPU has: the bundle
    requires that level's flags, not vendor extras of the build CPU (sse4a,
    sha_ni, vaes, ..., nor the AMX and AVX512-VNNI/BF16 that Inductor's own
    choice of ISA would add), and `inspect` names the vector ISA."""
    from helpers import cli

    path = compiled("linear", "cpu").path
    device = read_manifest(path).methods["forward"].device
    level = {"abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "popcnt", "sse2", "sse4_1", "sse4_2", "ssse3",
             "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert set(device.cpu_flags) <= level, device.cpu_flags
    text = cli("inspect", str(path)).stdout
    isa_line = next(line for line in text.splitlines() if "vector ISA" in line)
    assert "scalar" not in isa_line and ("AVX2" in isa_line or "AVX-512" in isa_line), isa_line
