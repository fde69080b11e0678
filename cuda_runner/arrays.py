"""How arrays are described, before any array exists: dtype names shared by
the manifest, NumPy and the AOTInductor C shim; shapes as text (the one
spelling used in messages, tables and reports); and whether an array of a
shape can be made at all.

The manifest spells dtypes as torch does without the prefix ("float32",
"bfloat16"). NumPy has no bfloat16, so `ml_dtypes` supplies it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .errors import InputError

if TYPE_CHECKING:  # NumPy is imported where arrays are handled, not at CLI start-up
    import numpy as np

# name -> c10::ScalarType code, as recorded in docs/aoti-abi.md. The runtime
# re-reads the codes from the shim's aoti_torch_dtype_* functions and checks
# them against this table before trusting it.
SCALAR_TYPE_CODES: dict[str, int] = {
    "uint8": 0,
    "int8": 1,
    "int16": 2,
    "int32": 3,
    "int64": 4,
    "float16": 5,
    "float32": 6,
    "float64": 7,
    "bool": 11,
    "bfloat16": 15,
}

DTYPE_NAMES = tuple(SCALAR_TYPE_CODES)
ITEM_SIZES: dict[str, int] = {
    "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "float32": 4, "float64": 8, "bool": 1, "bfloat16": 2,
}


def itemsize(name: str) -> int:
    """Bytes per element of a dtype, without importing NumPy."""
    return ITEM_SIZES[name]
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


def _bfloat16() -> np.dtype:
    import ml_dtypes
    import numpy as np

    return np.dtype(ml_dtypes.bfloat16)


_NUMPY_DTYPES: dict = {}  # np.dtype(name) costs 0.5 us (bfloat16 1.5 us), twice per output of every call


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype for a manifest dtype name."""
    dtype = _NUMPY_DTYPES.get(name)
    if dtype is None:
        dtype = _NUMPY_DTYPES[name] = _numpy_dtype_uncached(name)
    return dtype


def _numpy_dtype_uncached(name: str) -> np.dtype:
    if name == "bfloat16":
        return _bfloat16()
    if name not in SCALAR_TYPE_CODES:
        raise InputError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPE_NAMES)}")
    import numpy as np

    return np.dtype(name)


_NAMES_BY_DTYPE: dict = {}  # np.dtype.name is slow, and this sits on the per-call path


def dtype_name(dtype: np.dtype) -> str:
    """The manifest name of a NumPy dtype, or an InputError naming it."""
    name = _NAMES_BY_DTYPE.get(dtype)
    if name is None:
        name = _NAMES_BY_DTYPE[dtype] = _dtype_name_uncached(dtype)
    return name


def _dtype_name_uncached(dtype: np.dtype) -> str:
    import numpy as np

    dtype = np.dtype(dtype)
    if dtype.kind == "V" and dtype.name == "bfloat16":
        return "bfloat16"
    if dtype.name in SCALAR_TYPE_CODES and dtype.name != "bfloat16":
        return dtype.name
    raise InputError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPE_NAMES)}")


def torch_dtype_name(torch_dtype: object) -> str:
    """'torch.float32' -> 'float32', refusing dtypes the runtime cannot wrap."""
    name = str(torch_dtype).removeprefix("torch.")
    if name not in SCALAR_TYPE_CODES:
        raise InputError(f"dtype {torch_dtype} is not supported by cuda-runner")
    return name


# ---------------------------------------------------------------------------
# Shapes

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
