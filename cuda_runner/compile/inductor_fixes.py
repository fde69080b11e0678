"""Work-arounds for Inductor defects that break cuda-runner's compiles, each in
place only while a compile runs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def int_arrays_declared_per_writer() -> Iterator[None]:
    """Make AOTInductor's C++ wrapper declare every size/stride array in the
    code that uses it.

    The wrapper (torch 2.11-2.13, CppWrapperCpu.codegen_int_array_var) caches
    the name of each array it declared by the id() of the buffer the
    declaration was written to, and keeps no reference to that buffer. The
    arguments of a user-defined Triton kernel (cuda-runner's matrix-vector
    kernel) are written through short-lived buffers; once one is freed,
    Python can give its id() to the next, which then finds the earlier name
    cached and declares nothing: the library fails to build with "int_array_10
    was not declared in this scope". It came at random, in 1 of 4 compiles of
    the tiny decoder on the H200, each then built without the kernel. Here the
    cache keeps the buffer it names, so an id() cannot be reused while the
    name is remembered, and a hit must be the same buffer."""
    try:
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    except ImportError:  # another torch layout: nothing to mend
        yield
        return
    if not hasattr(CppWrapperCpu, "_codegen_int_array_var_impl") or "codegen_int_array_var" not in CppWrapperCpu.__dict__:
        yield  # a torch that caches otherwise (functools.cache keeps its keys alive) or elsewhere
        return
    with _MEND.lock:  # compiles in several threads: the first in puts the mend in, the last out takes it out
        if _MEND.holders == 0:
            _MEND.original = CppWrapperCpu.__dict__["codegen_int_array_var"]
            CppWrapperCpu.codegen_int_array_var = declared_per_writer  # type: ignore[method-assign,assignment]
        _MEND.holders += 1
    try:
        yield
    finally:
        with _MEND.lock:
            _MEND.holders -= 1
            if _MEND.holders == 0:
                CppWrapperCpu.codegen_int_array_var = _MEND.original  # type: ignore[method-assign]


class _Mend:
    """Whether the mend is in: the compiles holding it, and Inductor's own method to put back."""

    lock = threading.Lock()
    holders = 0
    original: Any = None


_MEND = _Mend()


def declared_per_writer(
    wrapper: Any, int_array: str, writeline: Callable[..., None], known_statically: bool = False, graph: Any = None,
) -> str:
    """CppWrapperCpu.codegen_int_array_var, its cache holding what its key names."""
    writer = getattr(writeline, "__self__", writeline)
    cache: dict[tuple, tuple[Any, Any, str]] = wrapper.__dict__.setdefault("_cuda_runner_int_arrays", {})
    key = (int_array, id(writer), known_statically, id(graph) if graph is not None else None)
    held = cache.get(key)
    if held is None or held[0] is not writer or held[1] is not graph:
        held = (writer, graph, wrapper._codegen_int_array_var_impl(int_array, writeline, known_statically))
        cache[key] = held
    return held[2]
