"""Create a device's CUDA context early, on a thread, without holding the GIL.

A context costs about 0.3 s on the H200 machine, as much as importing NumPy, so
a cold `run` starts it before importing what the run needs and the two
overlap. It is made through the driver API with ctypes, which releases the
GIL for the length of each foreign call: a thread that makes it through a
binding that keeps the GIL (or imports one first) stalls the imports it was
meant to overlap. The driver's primary context is the one the CUDA runtime,
CuPy and libtorch all use, so whichever of them runs first later finds it made.

Nothing here imports NumPy, so the CLI can call it before NumPy is loaded.
"""

from __future__ import annotations

import ctypes
import os
import threading

_threads: dict[int, threading.Thread] = {}
_lock = threading.Lock()


def start_context(device_index: int) -> None:
    """Start making `device_index`'s primary context, once per process. Any
    failure (no driver, no such device) is left for the load to meet and report."""
    with _lock:
        if device_index not in _threads:
            thread = threading.Thread(target=_retain_primary_context, args=(device_index,), name="cuda-runner-context", daemon=True)
            _threads[device_index] = thread
            thread.start()


def start_context_for(path: str, requested: str | None) -> None:
    """Start the context a run of the model file `path` on device `requested`
    (None: the file's own) will use, before the modules of the run are even
    imported. A wrong guess costs a context made in the background, nothing else."""
    from ..errors import CudaRunnerError
    from ..format.source import device_types
    from .devices import parse_device

    if requested is not None:
        try:
            device = parse_device(requested)
        except CudaRunnerError:
            return
        if device.type == "cuda":
            start_context(device.index)
    elif device_types(path) == {"cuda"}:
        start_context(0)


def wait_for_context(device_index: int) -> None:
    thread = _threads.get(device_index)
    if thread is not None:
        thread.join()


def _load_without_the_gil(name: str) -> ctypes.CDLL:
    """ctypes.CDLL(name), with the load itself made while the GIL is free.

    ctypes keeps the GIL while it loads a library, and loading the driver
    takes about 40 ms on the H200 machine: the imports this thread is meant to
    overlap would wait for all of it. libc's dlopen called through ctypes is a
    foreign call, which releases the GIL; ctypes.CDLL then finds the library
    loaded and only takes another reference to it."""
    try:
        dlopen = ctypes.CDLL(None).dlopen
    except AttributeError:  # a libc without dlopen (it lives in libdl before glibc 2.34): load it the usual way
        return ctypes.CDLL(name)
    dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
    mode = os.RTLD_NOW | os.RTLD_LOCAL
    # Its reference is never dropped: the driver stays loaded for the life of the
    # process, as the context retained below does. A failure is left to the load
    # below, which raises with the loader's reason.
    dlopen(name.encode(), mode)
    return ctypes.CDLL(name, mode=mode)


def _retain_primary_context(device_index: int) -> None:
    try:
        driver = _load_without_the_gil("libcuda.so.1")
        device, context = ctypes.c_int(), ctypes.c_void_p()
        if driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(device), device_index) != 0:
            return
        # Retained for the life of the process, as the runtime's own use retains it.
        driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
    except Exception:  # an odd driver (a symbol missing): the load meets it and says so in one line
        return
