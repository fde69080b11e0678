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
import os
import shutil
import tempfile

from ..errors import ModelRuntimeError

_MAX_NAME_RETRIES = 64


def _is_loaded(path: str) -> bool:
    try:
        handle = _ctypes.dlopen(path, os.RTLD_LAZY | os.RTLD_NOLOAD)
    except OSError:
        return False
    _ctypes.dlclose(handle)
    return True


def _dlopen_memfd(data: bytes, label: str) -> ctypes.CDLL:
    fd = os.memfd_create(f"cuda-runner:{label}", os.MFD_CLOEXEC)
    extra_fds = []
    try:
        _write_all(fd, data)
        # glibc returns an already-loaded object when the *path* matches, and
        # fd numbers are reused; so make sure no library that was loaded from
        # an earlier memfd of the same number is still mapped under this name.
        for _ in range(_MAX_NAME_RETRIES):
            path = f"/proc/self/fd/{fd}"
            if not _is_loaded(path):
                break
            extra_fds.append(fd)
            fd = os.dup(fd)
        else:
            raise ModelRuntimeError("could not find an unused memfd name to load the model library")
        return ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    finally:
        # The mapping keeps the memory alive; the descriptors are not needed.
        for descriptor in [fd, *extra_fds]:
            os.close(descriptor)


def _dlopen_private_file(data: bytes, label: str) -> ctypes.CDLL:
    directory = tempfile.mkdtemp(prefix="cuda-runner-")  # mode 0700, random name
    try:
        path = os.path.join(directory, f"{label}.so")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o500)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        return ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class ModelLibrary:
    """A dlopened model library and its container entry points."""

    def __init__(self, data: bytes, label: str):
        self.label = label
        try:
            self._cdll = self._open(data, label)
        except OSError as error:
            raise ModelRuntimeError(f"cannot load model library {label!r}: {error}") from error
        self.handle = self._cdll._handle

    @staticmethod
    def _open(data: bytes, label: str) -> ctypes.CDLL:
        if hasattr(os, "memfd_create"):
            try:
                return _dlopen_memfd(data, label)
            except OSError as error:
                if error.errno not in (38, 1, 13):  # ENOSYS, EPERM, EACCES: memfd not allowed here
                    raise
        return _dlopen_private_file(data, label)

    def function(self, name: str, argtypes: tuple, *, required: bool = True) -> ctypes._CFuncPtr | None:
        try:
            function = getattr(self._cdll, name)
        except AttributeError:
            if required:
                raise ModelRuntimeError(f"model library {self.label!r} does not export {name}; was it compiled by AOTInductor?") from None
            return None
        function.argtypes = argtypes
        function.restype = ctypes.c_int32
        return function

    def close(self) -> None:
        if self.handle is not None:
            with contextlib.suppress(OSError):
                _ctypes.dlclose(self.handle)
            self.handle = None
