"""Who provides a model library's shim functions: libtorch, or cuda-runner's own shim.

A library compiled with link_libtorch=False imports aoti_torch_* functions
(and, for CPU vector code, SLEEF's Sleef_* functions) from whatever the
process has loaded globally. Two providers that export the same names in one
process would make a library bind by load order, and one provider's tensor
handles read as the other's crash the process. So cuda-runner's shim
(cuda_runner/native/aoti_shim.cpp, built with the package) exports its
functions under other names of the same length, and a library that runs on it
is loaded from a private copy whose imports are renamed to match
(format.elf.rename_imports). libtorch-bound libraries keep the original names.
Each library is bound to one provider, chosen before it is loaded, and both
providers can serve libraries in one process.

The choice (`bind_library`, by `own_shim_refusal`'s rule, which `inspect` reports too), for `provider="auto"`:
- our shim wherever it provides every function the library imports, except a
  CPU library that calls a kernel libtorch runs measurably faster
  (LIBTORCH_FASTER: convolution; a small ResNet took 1.20x the time of
  torch's own package on the shim, 1.02x on libtorch, on the 2-core CPU
  machine; the shim's GEMMs, on OpenBLAS, and its vector math are as fast or
  faster, see docs/standalone.md), which goes to libtorch where it is installed,
  loads and defines every function the library imports; on the shim
  otherwise, so a broken or partial torch never stops a library the shim
  can run;
- libtorch where our shim lacks a function (a CUDA library bound to cuBLAS,
  cuDNN or libtorch's attention; mangled ATen imports);
- refused, with the functions our shim lacks, when neither can serve.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import machinery
from pathlib import Path

from ..errors import BundleError, DeviceError, InputError
from ..format.elf import LibraryFacts, read_library_facts, rename_imports
from ..format.manifest import LIBRARY_CHECKS_OPTION, MethodSpec
from .shim import TORCH_PREFIX, Shim, load_shim, missing_symbols

OWN_PREFIX = "cudarunner_"
SLEEF_PREFIX, OWN_SLEEF_PREFIX = "Sleef_", "cr_sl_"
# A CUDA library's kernel launches go through the shim, which launches its own
# kernels that wait for their inputs as programmatic dependents (crLaunchKernel
# in aoti_shim.cpp). The NUL makes it this name exactly, not a prefix. It is
# optional: where the library's names make it unsafe (another name ending in
# this one shares its bytes), the library launches its kernels itself.
LAUNCH, OWN_LAUNCH = "cuLaunchKernel\0", "crLaunchKernel\0"
REQUIRED_RENAMES = {TORCH_PREFIX: OWN_PREFIX, SLEEF_PREFIX: OWN_SLEEF_PREFIX}
RENAMES = {**REQUIRED_RENAMES, LAUNCH: OWN_LAUNCH}
PROVIDERS = ("auto", "shim", "libtorch")
SHIM_NAME = "cuda-runner shim"
LIBTORCH_NAME = "libtorch"
# Imports only libtorch's libraries define (mangled c10/ATen/torch names).
_LIBTORCH_ONLY = ("_ZN3c10", "_ZNK3c10", "_ZN2at", "_ZNK2at", "_ZN5torch", "_ZNK5torch")
_OWN_LIBRARY_STEM = "_aoti_shim"


@dataclass(frozen=True)
class Provider:
    name: str  # SHIM_NAME or LIBTORCH_NAME
    shim: Shim
    renames: bool

    def prepare(self, library: bytes) -> bytes | bytearray:
        """The bytes to load: for our shim, a copy whose imports name its functions."""
        return bound_to_own_shim(library) if self.renames else library

    @property
    def needs_torch(self) -> bool:
        return self.name == LIBTORCH_NAME


def bound_to_own_shim(library: bytes | memoryview) -> bytearray:
    """The library's copy whose imports name our shim's functions, its kernel
    launches too where that rename is safe (BundleError where the required
    ones are not)."""
    try:
        return rename_imports(library, RENAMES)
    except BundleError:
        return rename_imports(library, REQUIRED_RENAMES)


def default_provider(name: str | None) -> str:
    """`name`, else CUDA_RUNNER_PROVIDER, else "auto"."""
    if name is None:
        name = os.environ.get("CUDA_RUNNER_PROVIDER") or "auto"
    return check_provider(name)


def check_provider(name: str) -> str:
    if name not in PROVIDERS:
        raise InputError(f"unknown provider {name!r}; choose one of: {', '.join(PROVIDERS)}")
    return name


def own_shim_path() -> Path | None:
    """The shim library built with the package, or None where it was not built."""
    package = Path(__file__).resolve().parent.parent
    for suffix in machinery.EXTENSION_SUFFIXES:
        candidate = package / f"{_OWN_LIBRARY_STEM}{suffix}"
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def own_exports() -> frozenset[str]:
    """The functions our shim provides, spelled as libraries import them
    (aoti_torch_*, Sleef_*); empty where the shim was not built."""
    path = own_shim_path()
    if path is None:
        return frozenset()
    back = {new: old for old, new in RENAMES.items()}
    names = set()
    for name in read_library_facts(path.read_bytes(), exports=True).defined:
        for new, old in back.items():
            if name.startswith(new):
                names.add(old + name[len(new):])
    return frozenset(names)


def provider_imports(facts: LibraryFacts) -> list[str]:
    """The imports a shim provider has to satisfy: aoti_torch_* and Sleef_*, and any libtorch-only name."""
    return [name for name in facts.undefined if name.startswith((TORCH_PREFIX, SLEEF_PREFIX, *_LIBTORCH_ONLY))]


def missing_from_own_shim(facts: Iterable[LibraryFacts]) -> list[str]:
    """What our shim lacks for these libraries, sorted; [] when it serves them all."""
    exports = own_exports()
    if not exports:
        return ["(the shim library is not built in this install)"]
    return sorted({name for item in facts for name in provider_imports(item) if name not in exports})


def libtorch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def own_shim_refusal(library: bytes | memoryview, facts: LibraryFacts | None = None) -> str | None:
    """Why cuda-runner's shim cannot serve this library, or None: the one rule
    behind `inspect`, `compile --standalone`, `--provider shim` and `auto`.
    It lacks a function the library imports, or the library's imports cannot
    be renamed to bind to it (an import that asks for a symbol version, say)."""
    facts = facts if facts is not None else read_library_facts(library)
    return _renamed_for_own_shim(library, facts)[1]


def _renamed_for_own_shim(library: bytes | memoryview, facts: LibraryFacts) -> tuple[bytearray | None, str | None]:
    """(the library's copy bound to our shim, None) or (None, why it cannot be)."""
    missing = missing_from_own_shim([facts])
    if missing:
        return None, f"cuda-runner's shim lacks {_listed(missing)}"
    try:
        return bound_to_own_shim(library), None
    except BundleError as error:
        return None, f"its imports cannot be bound to cuda-runner's shim ({str(error).removeprefix('model library: ')})"


def runs_on(library: bytes | memoryview) -> tuple[bool, str]:
    """(needs libtorch, where it runs and why), as `inspect` reports a library under provider auto."""
    facts = read_library_facts(library)
    refusal = own_shim_refusal(library, facts)
    if refusal is not None:
        return True, f"libtorch ({refusal})"
    faster = libtorch_faster_kernels(facts)
    if faster:
        return False, f"libtorch where it is installed, for its {_listed(faster)} (faster there); else cuda-runner's shim (no torch needed)"
    return False, "cuda-runner's shim (no torch needed)"


# The kernels libtorch runs measurably faster than our shim, by
# scripts/bench_cpu.py on the 2-core CPU machine (docs/standalone.md): its
# oneDNN convolution against the shim's im2col + OpenBLAS, 1.4x on a ResNet
# block. The shim's GEMMs (OpenBLAS) and vector math are as fast or faster,
# and a library on the shim also spares the process torch's import.
LIBTORCH_FASTER = frozenset({"aoti_torch_cpu_convolution"})


def libtorch_faster_kernels(facts: LibraryFacts) -> list[str]:
    return sorted(name for name in provider_imports(facts) if name in LIBTORCH_FASTER)


def bind_library(library: bytes, device_type: str, preference: str = "auto", remedy: str | None = None) -> tuple[Provider, bytes | bytearray]:
    """The provider a model library runs on, loaded, and the bytes to load for
    it (for our shim, the copy with its imports renamed), by the rule above.
    `remedy`: what to tell a user without torch (libtorch_remedy)."""
    remedy = remedy or INSTALL_TORCH
    check_provider(preference)
    if preference == LIBTORCH_NAME:
        return load_libtorch_provider(device_type), library
    facts = read_library_facts(library)
    renamed, refusal = _renamed_for_own_shim(library, facts)
    if renamed is not None:
        if preference == "auto" and libtorch_faster_kernels(facts):
            libtorch = _usable_libtorch(facts, device_type)
            if libtorch is not None:
                return libtorch, library
        return load_own_provider(device_type), renamed
    if preference == "shim":
        raise DeviceError(f"{refusal}; run it with --provider auto or libtorch")
    if libtorch_installed():
        return load_libtorch_provider(device_type), library
    raise DeviceError(f"this model library needs libtorch ({refusal}); {remedy}")


def _usable_libtorch(facts: LibraryFacts, device_type: str) -> Provider | None:
    """libtorch, where it is installed, loads, and defines every shim function
    the library imports; None otherwise (the library then runs on our shim)."""
    if not libtorch_installed():
        return None
    names = [name for name in provider_imports(facts) if name.startswith(TORCH_PREFIX)]
    try:
        provider = load_libtorch_provider(device_type)
        missing, _ = missing_symbols(names, device_type)
    except (DeviceError, OSError):
        return None
    return provider if missing == [] else None


INSTALL_TORCH = "install it with: pip install 'cuda-runner[torch]'"


def libtorch_remedy(spec: MethodSpec) -> str:
    """What makes a library that needs libtorch run where torch is missing: torch;
    for a CUDA bundle built bound to libtorch by choice (--libtorch, or before
    standalone was the default), also compiling it again without --libtorch."""
    options = spec.compile_options
    built_bound = spec.device.type == "cuda" and spec.torch_version and not options.get("standalone") and "libtorch_because" not in options
    if built_bound and not options.get(LIBRARY_CHECKS_OPTION):  # not an ExecuTorch program: those are never bound to libtorch
        return f"{INSTALL_TORCH}, or compile it again without --libtorch (CUDA compiles need only cuda-runner's shim by default)"
    return INSTALL_TORCH


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:6])
    return shown + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def load_libtorch_provider(device_type: str) -> Provider:
    return Provider(LIBTORCH_NAME, load_shim(device_type), renames=False)


_lock = threading.Lock()


@functools.cache
def load_own_provider(device_type: str) -> Provider:
    """Our shim, loaded RTLD_GLOBAL once per process (its names are its own, so
    this shadows nothing), with the CUDA runtime for CUDA libraries."""
    with _lock:
        path = own_shim_path()
        if path is None:
            raise DeviceError("cuda-runner's shim is not built in this install; reinstall cuda-runner (pip builds it), or use --provider libtorch")
        if device_type == "cuda":
            load_cuda_runtime()
        _share_libstdcxx()
        try:
            library = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        except OSError as error:
            raise DeviceError(f"cannot load cuda-runner's shim {path.name}: {error}") from error
        last_error = library.cudarunner_shim_last_error
        last_error.restype = ctypes.c_char_p
        last_error.argtypes = ()
        _use_blas(library)
        shim = Shim([library], library, OWN_PREFIX, "cuda-runner", lambda: (last_error() or b"").decode("utf-8", "replace"))
        return Provider(SHIM_NAME, shim, renames=True)


def blas_candidates() -> list[str]:
    """Where an OpenBLAS for the shim's GEMMs may be, best first: CUDA_RUNNER_BLAS
    (a path, or "none" for the shim's own loops), the copy NumPy's wheels bundle
    (which NumPy itself uses: one thread pool for both), then the scipy-openblas64
    and -32 wheels. Found without importing any of them."""
    chosen = os.environ.get("CUDA_RUNNER_BLAS")
    if chosen:
        return [] if chosen == "none" else [chosen]
    found = []
    numpy = importlib.util.find_spec("numpy")
    if numpy is not None and numpy.origin:
        found += sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(numpy.origin)), "numpy.libs", "libscipy_openblas64_*.so")))
    for package, name in (("scipy_openblas64", "libscipy_openblas64_.so"), ("scipy_openblas32", "libscipy_openblas.so")):
        spec = importlib.util.find_spec(package)
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            found += sorted(glob.glob(os.path.join(folder, "lib", name)))
    return found


def _use_blas(library: ctypes.CDLL) -> None:
    """Give the shim the first BLAS it can load; without one its GEMMs run its own loops (correct, slower)."""
    use = library.cudarunner_shim_use_blas
    use.restype, use.argtypes = ctypes.c_int32, (ctypes.c_char_p,)
    for candidate in blas_candidates():
        if use(os.fsencode(candidate)) == 0:
            return


def shim_blas() -> str | None:
    """The BLAS the loaded shim's CPU GEMMs use, or None (its own loops, or no shim loaded)."""
    path = own_shim_path()
    if path is None or not load_own_provider.cache_info().currsize:
        return None
    library = ctypes.CDLL(str(path))
    library.cudarunner_shim_blas.restype = ctypes.c_char_p
    used = library.cudarunner_shim_blas() or b""
    return os.fsdecode(used) or None


def _share_libstdcxx() -> None:
    """Make the C++ runtime global before any library is bound to our shim, as
    libtorch's libraries make it when they load. AOTInductor CUDA libraries link
    libstdc++ statically and export it; loaded while the process has
    libstdc++.so.6 only privately (NumPy's extensions load it), a library bound
    some of its C++ runtime to one copy and some to the other, and std::regex
    then read a facet from the wrong locale table: the container's constructor
    crashed on the H200 machine. With libstdc++.so.6 global the library binds
    all of it there, as it does beside libtorch."""
    try:
        ctypes.CDLL("libstdc++.so.6", mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError:
        pass  # none on this machine: the libraries bring their own


_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12")


@functools.cache
def load_cuda_runtime() -> str:
    """Make the CUDA runtime's functions global, as libtorch's CUDA libraries
    would: link_libtorch=False libraries call cudaLaunchKernel and friends
    without naming the library that defines them. Returns the path loaded."""
    already = ctypes.CDLL(None)
    if hasattr(already, "cudaGetDevice"):
        return "(already loaded)"
    errors = []
    for candidate in cudart_candidates():
        try:
            ctypes.CDLL(candidate, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
            return candidate
        except OSError as error:
            errors.append(str(error))
    raise DeviceError(
        "cannot find the CUDA runtime (libcudart.so.13 or .12) that CUDA model libraries need; "
        "install it with: pip install 'cuda-runner[cuda13]' (or [cuda12])")


def cudart_candidates() -> list[str]:
    """Where the CUDA runtime may be: NVIDIA's pip wheels (the ones CuPy uses),
    the CUDA toolkit, then the loader's search path."""
    found: list[str] = []
    for root in sys.path:
        for pattern in ("nvidia/cu13/lib/libcudart.so.13*", "nvidia/cuda_runtime/lib/libcudart.so.1[23]*", "nvidia/cu12/lib/libcudart.so.12*"):
            found += sorted(glob.glob(os.path.join(root, pattern)))
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libcudart.so.1[23]")))
    found += sorted(glob.glob("/usr/local/cuda/lib64/libcudart.so.1[23]"))
    return found + list(_CUDART_NAMES)
