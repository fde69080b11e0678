"""Loading a model library from bytes, never from a predictable path.

The library is written to an anonymous memfd and dlopened through
/proc/self/fd/N with RTLD_LOCAL: RTLD_GLOBAL would let a second model bind to
the first one's symbols and silently run the wrong code. Where memfd is not
available, a private 0700 directory is used and the file removed right after
loading.
"""

from __future__ import annotations

import _ctypes
import contextlib
import ctypes
import errno
import os
import shutil
import threading
from typing import Any

from ..errors import TOO_MANY_FILES, BundleError, DeviceError, ModelRuntimeError, too_many_open_files

try:  # hashlib's BLAKE2 itself, without hashlib, which loads OpenSSL: about 7 ms of every run's start
    from _blake2 import blake2b
except ImportError:  # an interpreter without the module
    from hashlib import blake2b

# Errors from memfd_create that mean "not allowed here" rather than a failure.
_MEMFD_REFUSED = (errno.ENOSYS, errno.EPERM, errno.EACCES)
# glibc finds an already-loaded object by the *path string* given to dlopen,
# and fd numbers are reused. A library that could not be unloaded (older
# bundles whose symbols are STB_GNU_UNIQUE) keeps its /proc/self/fd/N name, so
# a new library needs a path no loaded object has: the same fd reached through
# "fd/./N", "fd/././N", ... (each resolves to the same file). The limit only
# bounds the path length, far below PATH_MAX.
_MAX_PATH_VARIANTS = 1000


def _is_loaded(path: str) -> bool:
    try:
        handle = _ctypes.dlopen(path, os.RTLD_LAZY | os.RTLD_NOLOAD)
    except OSError:
        return False
    _ctypes.dlclose(handle)
    return True


def _unused_path(fd: int) -> str:
    for variant in range(_MAX_PATH_VARIANTS):
        path = f"/proc/self/fd/{'./' * variant}{fd}"
        if not _is_loaded(path):
            return path
    raise ModelRuntimeError(f"{_MAX_PATH_VARIANTS} model libraries that cannot be unloaded are loaded in this process; restart it")


def _dlopen_memfd(data: bytes | bytearray, label: str) -> ctypes.CDLL:
    # memfd names are limited to 249 bytes; the label is only for /proc/*/maps.
    name = f"cuda-runner:{label}".encode()[:200].decode("utf-8", "ignore")
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        _write_all(fd, data)
        return ctypes.CDLL(_unused_path(fd), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    finally:
        os.close(fd)  # the mapping keeps the memory alive


def _dlopen_private_file(data: bytes | bytearray, label: str) -> ctypes.CDLL:
    import tempfile  # only where memfd_create is refused

    directory = tempfile.mkdtemp(prefix="cuda-runner-")  # mode 0700, random name
    try:
        path = os.path.join(directory, "model.so")  # the folder is private and random: no need for the label
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o500)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        return ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class ModelLibrary:
    """A dlopened model library and its container entry points."""

    def __init__(self, data: bytes | bytearray, label: str):
        self.label = label
        try:
            self._cdll = self._open(data, label)
        except OSError as error:
            if too_many_open_files(error):  # dlopen says so only in its text
                raise DeviceError(f"cannot load model library {label!r}: {TOO_MANY_FILES}") from error
            raise ModelRuntimeError(f"cannot load model library {label!r}: {error}") from error
        self.handle: int | None = self._cdll._handle

    @staticmethod
    def _open(data: bytes | bytearray, label: str) -> ctypes.CDLL:
        if hasattr(os, "memfd_create"):
            try:
                return _dlopen_memfd(data, label)
            except OSError as error:
                if error.errno not in _MEMFD_REFUSED:
                    raise
        return _dlopen_private_file(data, label)

    def optional(self, name: str, argtypes: tuple[Any, ...]) -> Any | None:
        """An exported function returning int32, or None if the library lacks it."""
        try:
            function = getattr(self._cdll, name)
        except AttributeError:
            return None
        function.argtypes = argtypes
        function.restype = ctypes.c_int32
        return function

    def require(self, name: str, argtypes: tuple[Any, ...]) -> Any:
        function = self.optional(name, argtypes)
        if function is None:
            raise BundleError(f"model library {self.label!r} does not export {name}; it was not compiled by AOTInductor")
        return function

    def still_mapped(self) -> bool:
        """After dlclose: whether the library stayed loaded (STB_GNU_UNIQUE symbols,
        or thread-local destructors of threads still alive, keep it)."""
        return _is_loaded(self._cdll._name)

    def unload(self) -> bool:
        """dlclose; True if the library is gone from the process."""
        if self.handle is not None:
            with contextlib.suppress(OSError):
                _ctypes.dlclose(self.handle)
            self.handle = None
        return not self.still_mapped()


class _Entry:
    def __init__(self, library: ModelLibrary):
        self.library = library
        self.users = 0


# Libraries by digest. A library that could not be unloaded stays here, so
# loading the same bundle again reuses it instead of mapping another copy:
# load/run/close cycles then cost no memory, however many there are.
_libraries: dict[str, _Entry] = {}
_libraries_lock = threading.Lock()


class LibraryLease:
    """One user's hold on a shared model library; `release()` exactly once."""

    def __init__(self, digest: str, entry: _Entry):
        self._digest = digest
        self._entry: _Entry | None = entry
        self.library = entry.library
        self.label = entry.library.label

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is None:
            return
        with _libraries_lock:
            entry.users -= 1
            if entry.users or entry.library.handle is None:
                return
            if entry.library.unload():
                del _libraries[self._digest]
            else:
                # Still mapped: take a counted handle again and keep it for reuse.
                entry.library.handle = _ctypes.dlopen(entry.library._cdll._name, os.RTLD_NOW | os.RTLD_LOCAL | os.RTLD_NOLOAD)


def lease_library(data: bytes | bytearray, label: str, *, native_checks: bool = False, bound_to: str = "") -> LibraryLease:
    """The library with these bytes, loaded once per process while it is in use.

    Keyed by a cryptographic hash of the bytes themselves (not the bundle's
    digest), so that no other code can ever be mistaken for a loaded library.
    A library decides at its first Run whether its own input checks are on,
    for good (docs/aoti-abi.md), so copies with and without them are kept apart;
    so are copies bound to different shim providers (`bound_to`), even where
    renaming its imports left the bytes as they were."""
    digest = blake2b(data, digest_size=32).hexdigest() + (":checked" if native_checks else "") + f":{bound_to}"
    with _libraries_lock:
        entry = _libraries.get(digest)
        if entry is None:
            entry = _libraries[digest] = _Entry(ModelLibrary(data, label))
        entry.users += 1
        return LibraryLease(digest, entry)
