"""Shapes as text (the one spelling used in messages, tables and reports), and
whether an array of a shape can be made at all."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence

# NumPy refuses an array whose non-zero sizes multiply, in bytes, past this
# ("array is too big"), even when another size is zero.
MAX_ARRAY_BYTES = (1 << 63) - 1


def shape_text(shape: Iterable[object]) -> str:
    """[batch, 16] for a declared shape, [4, 16] for a concrete one, [] for a scalar."""
    return "[" + ", ".join(str(entry) for entry in shape) + "]"


def span_problem(shape: Sequence[int], itemsize: int) -> str | None:
    """Why no array can have this shape, or None."""
    if math.prod(size for size in shape if size) * itemsize > MAX_ARRAY_BYTES:
        return "its sizes multiply past 2^63 bytes, more than any array can hold"
    return None


def host_memory_bytes() -> int:
    """This machine's physical memory (MAX_ARRAY_BYTES where it cannot be told)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return MAX_ARRAY_BYTES


def allocation_problem(shape: Sequence[int], itemsize: int) -> str | None:
    """Why an array of this shape cannot be made in this machine's memory, or None."""
    problem = span_problem(shape, itemsize)
    if problem is not None:
        return problem
    nbytes, memory = math.prod(shape) * itemsize, host_memory_bytes()
    if nbytes > memory:
        return f"it would take {bytes_text(nbytes)}, more than this machine's memory ({bytes_text(memory)})"
    return None


def bytes_text(size: int) -> str:
    """4.0 GiB; 16.0 TiB; beyond EiB as a power of two."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024:
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"2^{size.bit_length() - 1} B or more"
