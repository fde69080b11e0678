"""The AOTInductor model container, through its C ABI.

The ABI crashes the process rather than fail on misuse (docs/aoti-abi.md, "Hazards"), so
this class makes misuse impossible: the weights are fed exactly once, before
any Run; the input and output counts are checked against the library once, at
creation; and Run is given exactly the counts the library reported.

Thread safety: the container's Run may be called from several threads at once
(it hands each call one of its `num_models` model instances, and waits while
all are busy). Nothing in this class is shared between calls: each Run gets
its own handle arrays.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import BundleError, ModelRuntimeError
from .library import ModelLibrary
from .shim import Handle

_SIZE_P = ctypes.POINTER(ctypes.c_size_t)
_PREFIX = "AOTInductorModelContainer"
_BUFFER_CONSTANT = 2  # torch::aot_inductor::ConstantType::Buffer


class Container:
    def __init__(self, library: ModelLibrary, device: str, num_models: int = 1):
        self.library = library
        self._bind()
        self._after_delete: list[Callable[[], None]] = []
        self._handle = Handle()
        self._check(self._create(ctypes.byref(self._handle), num_models, device.encode(), None), f"create the model container on {device}")
        self.num_models = num_models
        self.num_inputs = self._count(self._get_num_inputs)
        self.num_outputs = self._count(self._get_num_outputs)
        self._weights_loaded = False
        self.capture_errors = False
        self._input_array_type = Handle * max(1, self.num_inputs)
        self._output_array_type = Handle * max(1, self.num_outputs)

    def _bind(self) -> None:
        lib = self.library
        self._create = lib.require(f"{_PREFIX}CreateWithDevice", (ctypes.POINTER(Handle), ctypes.c_size_t, ctypes.c_char_p, ctypes.c_char_p))
        self._delete = lib.require(f"{_PREFIX}Delete", (Handle,))
        run_argtypes = (Handle, ctypes.POINTER(Handle), ctypes.c_size_t, ctypes.POINTER(Handle), ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
        self._run = lib.require(f"{_PREFIX}Run", run_argtypes)
        # No model pool and no event: what a CUDA graph capture wants.
        self._run_single_threaded = lib.optional(f"{_PREFIX}RunSingleThreaded", run_argtypes)
        self._get_num_inputs = lib.require(f"{_PREFIX}GetNumInputs", (Handle, _SIZE_P))
        self._get_num_outputs = lib.require(f"{_PREFIX}GetNumOutputs", (Handle, _SIZE_P))
        self._get_num_constants = lib.require(f"{_PREFIX}GetNumConstants", (Handle, _SIZE_P))
        self._blob_size = lib.optional(f"{_PREFIX}GetConstantsBlobSize", (Handle, ctypes.POINTER(ctypes.c_uint64)))
        self._update_from_blob = lib.optional("AOTInductorModelUpdateConstantsFromBlob", (Handle, ctypes.c_void_p))
        self._last_error = lib.optional("AOTInductorGetLastError", (ctypes.POINTER(ctypes.c_char_p),))
        index_query = (Handle, ctypes.c_size_t)
        self._constant_name = lib.require(f"{_PREFIX}GetConstantName", (*index_query, ctypes.POINTER(ctypes.c_char_p)))
        self._constant_fqn = lib.require(f"{_PREFIX}GetConstantOriginalFQN", (*index_query, ctypes.POINTER(ctypes.c_char_p)))
        self._constant_dtype = lib.require(f"{_PREFIX}GetConstantDtype", (*index_query, ctypes.POINTER(ctypes.c_int32)))
        self._constant_size = lib.require(f"{_PREFIX}GetConstantDataSize", (*index_query, _SIZE_P))
        self._constant_type = lib.optional(f"{_PREFIX}GetConstantType", (*index_query, ctypes.POINTER(ctypes.c_int32)))
        self._constant_folded = lib.optional(f"{_PREFIX}GetConstantFromFolded", (*index_query, ctypes.POINTER(ctypes.c_bool)))
        self._bind_user_managed = lib.optional(
            f"{_PREFIX}UpdateUserManagedConstantBufferPairs",
            (Handle, ctypes.POINTER(ConstantEntry), ctypes.c_size_t, ctypes.c_bool, ctypes.c_bool),
        )

    def _count(self, getter: Any) -> int:
        value = ctypes.c_size_t()
        self._check(getter(self._handle, ctypes.byref(value)), "query the model container")
        return value.value

    @property
    def reports_errors(self) -> bool:
        """Whether the library can say why a call failed (AOTInductorGetLastError, torch 2.13+)."""
        return self._last_error is not None

    def _check(self, status: int, what: str, printed: str = "") -> None:
        if status == 0:
            return
        detail = ""
        if self._last_error is not None:
            message = ctypes.c_char_p()
            if self._last_error(ctypes.byref(message)) == 0 and message.value:
                detail = ": " + message.value.decode("utf-8", "replace").strip().splitlines()[0]
        if not detail and printed:
            detail = ": " + printed
        raise ModelRuntimeError(f"could not {what} (model library {self.library.label!r}){detail}")

    @property
    def num_constants(self) -> int:
        return self._count(self._get_num_constants)

    def expected_blob_size(self) -> int | None:
        if self._blob_size is None:
            return None
        size = ctypes.c_uint64()
        self._check(self._blob_size(self._handle, ctypes.byref(size)), "query the weights blob size")
        return size.value

    def load_weights(self, blob_address: int, blob_size: int) -> None:
        """Feed the weights blob. Calling it twice is a use-after-free in the library, so it is refused."""
        if self._weights_loaded:
            raise ModelRuntimeError("weights were already loaded into this container")
        if self.num_constants == 0:
            self._weights_loaded = True
            return
        if self._update_from_blob is None:
            raise BundleError("model library has no AOTInductorModelUpdateConstantsFromBlob; it was built by torch older than 2.10")
        expected = self.expected_blob_size()
        if expected is not None and expected != blob_size:
            raise BundleError(f"weights segment is {blob_size} bytes but the model library expects {expected}")
        self._check(self._update_from_blob(self._handle, ctypes.c_void_p(blob_address)), "load the weights")
        self._weights_loaded = True

    def constants(self) -> list[ConstantInfo]:
        """What the library says about each of its constants."""
        found = []
        for index in range(self.num_constants):
            name, fqn = ctypes.c_char_p(), ctypes.c_char_p()
            dtype, size, folded = ctypes.c_int32(), ctypes.c_size_t(), ctypes.c_bool(False)
            self._check(self._constant_name(self._handle, index, ctypes.byref(name)), "query a constant's name")
            self._check(self._constant_fqn(self._handle, index, ctypes.byref(fqn)), "query a constant's original name")
            self._check(self._constant_dtype(self._handle, index, ctypes.byref(dtype)), "query a constant's dtype")
            self._check(self._constant_size(self._handle, index, ctypes.byref(size)), "query a constant's size")
            if self._constant_folded is not None:
                self._check(self._constant_folded(self._handle, index, ctypes.byref(folded)), "query whether a constant is folded")
            found.append(ConstantInfo(
                (name.value or b"").decode("utf-8", "replace"), (fqn.value or b"").decode("utf-8", "replace"), dtype.value, size.value, folded.value,
            ))
        return found

    def has_buffers(self) -> bool | None:
        """Whether any constant is a module buffer (state a run may change); None if the library cannot say."""
        buffers = self.buffer_fqns()
        return None if buffers is None else bool(buffers)

    def buffer_fqns(self) -> frozenset[str] | None:
        """The original names of the constants that are module buffers; None if the library cannot say."""
        if self._constant_type is None:
            return None
        found = set()
        for index in range(self.num_constants):
            kind = ctypes.c_int32()
            self._check(self._constant_type(self._handle, index, ctypes.byref(kind)), "query a constant's type")
            if kind.value == _BUFFER_CONSTANT:
                fqn = ctypes.c_char_p()
                self._check(self._constant_fqn(self._handle, index, ctypes.byref(fqn)), "query a constant's original name")
                found.add((fqn.value or b"").decode("utf-8", "replace"))
        return frozenset(found)

    def bind_constants(self, pairs: list[tuple[str, int]]) -> None:
        """Point the library's constants at tensors the caller keeps alive
        (the library takes its own handle to each; the memory stays ours).
        Every constant must be given: the library checks that too."""
        if self._weights_loaded:
            raise ModelRuntimeError("weights were already loaded into this container")
        if self._bind_user_managed is None:
            raise BundleError("model library has no AOTInductorModelContainerUpdateUserManagedConstantBufferPairs; it was built by torch older than 2.10")
        names = [name.encode() for name, _ in pairs]  # kept alive for the call
        entries = (ConstantEntry * max(1, len(pairs)))(*[ConstantEntry(name, handle) for name, (_, handle) in zip(names, pairs)])
        self._check(self._bind_user_managed(self._handle, entries, len(pairs), False, True), "bind the constants")
        self._weights_loaded = True

    def run(self, inputs: list[int], stream: int | None, *, single_threaded: bool = False, outputs: Any = None, inputs_array: Any = None) -> list[int]:
        """Run; input handles are stolen by the library, output handles are new and ours.
        `outputs`: where the library writes them (an OwnedHandles' slots), so that
        they are owned from the moment they exist; `inputs_array`: the slots the
        inputs are in (Run nulls each one it steals).

        With `capture_errors` set, a library that cannot report why a call
        failed has the error it prints to fd 2 during the call read instead
        (calls are then serialised: fd 2 belongs to the whole process)."""
        if single_threaded and self._run_single_threaded is None:
            raise ModelRuntimeError("this model library has no RunSingleThreaded entry point")
        if not self._weights_loaded:
            raise ModelRuntimeError("weights must be loaded before Run")
        if len(inputs) != self.num_inputs:
            raise ModelRuntimeError(f"internal error: {len(inputs)} input handles for {self.num_inputs} inputs")
        input_array = self._input_array_type(*inputs) if inputs_array is None else inputs_array
        output_array = self._output_array_type() if outputs is None else outputs
        run = self._run if not single_threaded or self._run_single_threaded is None else self._run_single_threaded
        status, printed = self.guarded(lambda: run(self._handle, input_array, self.num_inputs, output_array, self.num_outputs, stream, None))
        if status != 0:
            self.check_run(status, printed)
        return [handle or 0 for handle in output_array[:self.num_outputs]]

    def guarded(self, call: Callable[[], int]) -> tuple[int, str]:
        """Call something that runs the model; with `capture_errors` set and a
        library that cannot report why a call failed, also what it printed."""
        if self.capture_errors and not self.reports_errors:
            with _printed_errors() as captured:
                status = call()
            return status, captured.text
        return call(), ""

    def check_run(self, status: int, printed: str = "") -> None:
        """Raise for a failed Run, with the library's reason where it gives one."""
        self._check(status, "run the model", printed)

    @property
    def ready(self) -> bool:
        """Whether Run may be called: the weights are in place."""
        return self._weights_loaded

    @property
    def handle_address(self) -> int:
        return int(self._handle.value or 0)

    @property
    def run_address(self) -> int:
        """The address of the library's Run, for native callers (the call helper)."""
        return int(ctypes.cast(self._run, ctypes.c_void_p).value or 0)

    def release_after_delete(self, release: Callable[[], None]) -> None:
        """Call `release` once the container is deleted (what it held and never let go)."""
        self._after_delete.append(release)

    def delete(self) -> None:
        if self._handle:
            self._delete(self._handle)
            self._handle = Handle()
        releases, self._after_delete = self._after_delete, []
        for release in releases:
            release()


class ConstantEntry(ctypes.Structure):
    """AOTInductorConstantMapEntry: an internal constant name and a tensor handle."""

    _fields_ = [("name", ctypes.c_char_p), ("handle", ctypes.c_void_p)]


@dataclasses.dataclass(frozen=True)
class ConstantInfo:
    name: str  # the library's internal name
    fqn: str  # the original module attribute path
    dtype_code: int
    nbytes: int
    folded: bool  # computed by constant folding: never given from outside


class _Captured:
    text = ""


_stderr_lock = threading.Lock()  # fd 2 is the process's: one capture at a time


@contextlib.contextmanager
def _printed_errors() -> Iterator[_Captured]:
    """Send fd 2 to an anonymous file for the duration; keep the library's
    "Error: ..." line, and pass anything else printed back to the real stderr."""
    captured = _Captured()
    with _stderr_lock:
        try:
            scratch = os.memfd_create("cuda-runner-stderr", os.MFD_CLOEXEC)
        except (AttributeError, OSError):  # no memfd here: run without capturing
            yield captured
            return
        saved = os.dup(2)
        try:
            os.dup2(scratch, 2)
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.lseek(scratch, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(scratch, 1 << 16):
                chunks.append(chunk)
            text = b"".join(chunks).decode("utf-8", "replace")
            os.close(scratch)
            errors = [line.removeprefix("Error: ").strip() for line in text.splitlines() if line.startswith("Error: ")]
            captured.text = errors[-1] if errors else ""
            rest = "\n".join(line for line in text.splitlines() if not line.startswith("Error: "))
            if rest.strip():
                os.write(2, (rest + "\n").encode())
