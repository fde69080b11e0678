"""The C shim functions the runtime itself calls, from either provider.

A link_libtorch=False model library leaves its aoti_torch_* symbols undefined,
to be bound when it is dlopened. libtorch provides them once its libraries are
loaded RTLD_GLOBAL (directly: about 0.3 s against 3.6 s for `import torch`;
docs/aoti-abi.md, "Tensor handles"); cuda-runner's own shim provides them
under another prefix (runtime/providers.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..arrays import SCALAR_TYPE_CODES
from ..errors import DeviceError, ModelRuntimeError

# The ctypes types of the C ABI, for every module that crosses it.
Handle = ctypes.c_void_p  # AtenTensorHandle, and the container's handle
Int64Pointer = ctypes.POINTER(ctypes.c_int64)  # sizes and strides

_LIBRARIES = {
    "cpu": ("libc10.so", "libtorch_cpu.so"),
    "cuda": ("libc10.so", "libtorch_cpu.so", "libc10_cuda.so", "libtorch_cuda.so"),
}

_STATUS = ctypes.c_int32

#: A bound shim function: ctypes arguments in, an AOTITorchError status (0 = success) out.
ShimFunction = Callable[..., int]


def _bind(library: Any, name: str, *argtypes: Any) -> ShimFunction:
    function = getattr(library, name)
    function.argtypes = argtypes
    function.restype = _STATUS
    return function


TORCH_PREFIX = "aoti_torch_"


def torch_library_dir() -> Path:
    """torch's lib/ folder, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise DeviceError("running a model needs libtorch from PyTorch 2.10 or newer; install it with: pip install 'cuda-runner[torch]'")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


class Shim:
    """The shim functions the runtime calls, and the dtype/device codes, read
    from one provider: `library` exports them as `prefix` + the name libtorch
    gives them after "aoti_torch_".

    Every function returns an AOTITorchError status (0 = success)."""

    def __init__(self, libraries: list[ctypes.CDLL], library: ctypes.CDLL, prefix: str = TORCH_PREFIX, label: str = "libtorch",
                 last_error: Callable[[], str] | None = None):
        self._libraries = libraries  # keep them loaded
        self.label = label
        self._last_error = last_error
        torch_cpu = _Prefixed(library, prefix)
        self.create_tensor_from_blob_v2 = _bind(
            torch_cpu, "aoti_torch_create_tensor_from_blob_v2",
            ctypes.c_void_p, ctypes.c_int64, Int64Pointer, Int64Pointer, ctypes.c_int64, ctypes.c_int32,
            ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(Handle), ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64,
        )
        self.get_data_ptr = _bind(torch_cpu, "aoti_torch_get_data_ptr", Handle, ctypes.POINTER(ctypes.c_void_p))
        self.get_dim = _bind(torch_cpu, "aoti_torch_get_dim", Handle, ctypes.POINTER(ctypes.c_int64))
        self.get_sizes = _bind(torch_cpu, "aoti_torch_get_sizes", Handle, ctypes.POINTER(Int64Pointer))
        self.get_strides = _bind(torch_cpu, "aoti_torch_get_strides", Handle, ctypes.POINTER(Int64Pointer))
        self.get_dtype = _bind(torch_cpu, "aoti_torch_get_dtype", Handle, ctypes.POINTER(ctypes.c_int32))
        self.get_device_type = _bind(torch_cpu, "aoti_torch_get_device_type", Handle, ctypes.POINTER(ctypes.c_int32))
        self.delete_tensor_object = _bind(torch_cpu, "aoti_torch_delete_tensor_object", Handle)
        self.dtype_codes = self._read_dtype_codes(torch_cpu)
        self.dtype_names = {code: name for name, code in self.dtype_codes.items()}
        self.device_cpu = self._code(torch_cpu, "aoti_torch_device_type_cpu")
        self.device_cuda = self._code(torch_cpu, "aoti_torch_device_type_cuda")
        self.layout_strided = self._code(torch_cpu, "aoti_torch_layout_strided")
        self.library_dir = Path(library._name).parent
        self._capture = _Capture.of(library)
        self._arena = _ArenaFunctions.of(library)

    @contextlib.contextmanager
    def capture(self, keep: Callable[[Callable[[], None]], None]) -> Iterator[None]:
        """Tensors the provider makes on this thread inside the block are
        released by the callable handed to `keep`, to be called once nothing
        that may hold them is left (cuda-runner's shim: the handles a
        container takes to user-managed constants and never deletes; libtorch
        offers no such thing, and the block is then only a block)."""
        if self._capture is None:
            yield
            return
        capture = self._capture
        group = capture.begin()
        try:
            yield
        finally:
            capture.end(group)
            keep(lambda: capture.release(group))

    def open_arena(self, device_index: int) -> GraphArena | None:
        """A graph arena for `device_index` (cuda-runner's shim: aoti_shim.cpp,
        `Arena`); None from libtorch, whose graphs take memory from its own
        allocator's pool."""
        if self._arena is None:
            return None
        return GraphArena(self._arena, device_index, self.failure)

    @staticmethod
    def _code(library: Any, symbol: str) -> int:
        function = getattr(library, symbol)
        function.restype = ctypes.c_int32
        function.argtypes = ()
        return int(function())

    def _read_dtype_codes(self, library: Any) -> dict[str, int]:
        codes = {name: self._code(library, f"aoti_torch_dtype_{name}") for name in SCALAR_TYPE_CODES}
        if codes != SCALAR_TYPE_CODES:
            raise ModelRuntimeError(f"{self.label} reports unexpected dtype codes {codes}")
        return codes

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise ModelRuntimeError(self.failure(what))

    def failure(self, what: str) -> str:
        """The message for a failed call: what the runtime was doing, and the provider's reason where it keeps one."""
        reason = self._last_error() if self._last_error is not None else ""
        return f"{self.label} shim call failed: {what}" + (f" ({reason})" if reason else "")


class _Capture:
    """cuda-runner's shim's tensor captures (aoti_shim.cpp, `Group`)."""

    def __init__(self, library: ctypes.CDLL):
        self.begin = library.cudarunner_shim_capture_begin
        self.begin.restype, self.begin.argtypes = ctypes.c_void_p, ()
        self.end = library.cudarunner_shim_capture_end
        self.end.restype, self.end.argtypes = None, (ctypes.c_void_p,)
        self.release = library.cudarunner_shim_capture_release
        self.release.restype, self.release.argtypes = ctypes.c_int64, (ctypes.c_void_p,)

    @staticmethod
    def of(library: ctypes.CDLL) -> _Capture | None:
        try:
            return _Capture(library)
        except AttributeError:
            return None


class _ArenaFunctions:
    """cuda-runner's shim's graph arenas (aoti_shim.cpp, `Arena`)."""

    def __init__(self, library: ctypes.CDLL):
        self.new = library.cudarunner_shim_arena_new
        self.new.restype, self.new.argtypes = ctypes.c_void_p, (ctypes.c_int32,)
        self.serve = library.cudarunner_shim_arena_serve
        self.serve.restype, self.serve.argtypes = None, (ctypes.c_void_p,)
        self.stop = library.cudarunner_shim_arena_stop
        self.stop.restype, self.stop.argtypes = _STATUS, (ctypes.c_void_p,)
        self.release = library.cudarunner_shim_arena_release
        self.release.restype, self.release.argtypes = None, (ctypes.c_void_p,)
        self.bytes = library.cudarunner_shim_arena_bytes
        self.bytes.restype, self.bytes.argtypes = ctypes.c_int64, (ctypes.c_void_p,)

    @staticmethod
    def of(library: ctypes.CDLL) -> _ArenaFunctions | None:
        try:
            return _ArenaFunctions(library)
        except AttributeError:
            return None


class GraphArena:
    """Device memory for CUDA graphs' own use (a method's graphs share one).
    Inside `serving()` the shim hands out the calling thread's device
    allocations from it, so a capture there records no allocation or free
    nodes. The memory stays until `release` (or this object is collected)
    and the last tensor holding a block of it are gone."""

    def __init__(self, functions: _ArenaFunctions, device_index: int, failure: Callable[[str], str]):
        self._functions = functions
        handle = functions.new(device_index)
        if not handle:
            raise ModelRuntimeError(failure("making a graph arena"))
        self._handle: int | None = handle
        self._failure = failure
        # A backstop for an arena its owner never released (an interrupted capture): its chunks go back to the pool.
        self._finalizer = weakref.finalize(self, functions.release, handle)

    @property
    def nbytes(self) -> int:
        """Device memory the arena holds."""
        return int(self._functions.bytes(self._handle)) if self._handle else 0

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """This thread's device allocations come from the arena inside the block;
        on leaving it the arena stops serving and its memory is ready for use."""
        self._functions.serve(self._handle)
        try:
            yield
        except BaseException:
            self._functions.stop(self._handle)
            raise
        if self._functions.stop(self._handle) != 0:
            raise ModelRuntimeError(self._failure("readying a graph arena's memory"))

    def release(self) -> None:
        """Give up this hold on the memory (once; the last holder frees it)."""
        self._handle = None
        self._finalizer()


class _Prefixed:
    """A library whose functions are looked up under another prefix than aoti_torch_."""

    def __init__(self, library: ctypes.CDLL, prefix: str):
        self._library = library
        self._prefix = prefix
        self._name = library._name

    def __getattr__(self, name: str) -> Any:
        if name.startswith(TORCH_PREFIX):
            name = self._prefix + name[len(TORCH_PREFIX):]
        return getattr(self._library, name)


_lock = threading.Lock()


@functools.cache
def load_shim(device_type: str) -> Shim:
    """Load libtorch for 'cpu' or 'cuda' once per process."""
    with _lock:
        lib_dir = torch_library_dir()
        try:
            return _load_global(lib_dir, _LIBRARIES[device_type])
        except OSError as direct_error:
            # Some installs need torch's own start-up (it preloads CUDA
            # libraries from pip wheels) before libtorch can be loaded.
            try:
                import torch  # noqa: F401
            except Exception:
                raise DeviceError(f"cannot load libtorch from {lib_dir}: {direct_error}") from direct_error
            try:
                return _load_global(lib_dir, _LIBRARIES[device_type])
            except OSError as error:
                raise DeviceError(f"cannot load libtorch's {device_type} libraries from {lib_dir}: {error}") from error


def _load_global(lib_dir: Path, names: tuple[str, ...]) -> Shim:
    mode = os.RTLD_NOW | os.RTLD_GLOBAL
    libraries = [ctypes.CDLL(str(lib_dir / name), mode=mode) for name in names]
    return Shim(libraries, libraries[1])


def missing_symbols(names: tuple[str, ...] | list[str], device_type: str) -> tuple[list[str] | None, str | None]:
    """Which of the shim functions `names` this machine's libtorch lacks, and
    which of its libraries were searched: "cuda", or "cpu" (also when the CUDA
    ones cannot be loaded here); (None, None) when there is no libtorch at all."""
    try:
        shim = load_shim(device_type)
    except Exception:
        if device_type == "cpu":
            return None, None
        return missing_symbols(names, "cpu")
    return [name for name in names if not any(hasattr(library, name) for library in shim._libraries)], device_type
