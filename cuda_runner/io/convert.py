"""Converting input values to the dtype a method declares, without changing any.

`--cast`, inline values and generated values all end here. A conversion may
round a float to a narrower float (float64 to float32 is what `--cast` is
for), and nothing else: a value the target dtype cannot hold is refused,
naming the input, the value, where it is, and the dtype, rather than wrapped
(int64 2^31 to int32), made infinite (float32 70000 to float16), truncated
(2.5 to an integer) or collapsed (2 to a bool). Infinities and NaNs already in
a float source stay what they are in a float target.

The rules, by target (README, "--cast"):

- float: a finite value beyond the target's largest finite value is refused;
  others are rounded to the nearest value (tiny ones may become zero).
  Integers must be held exactly (int64 2^53 + 1 has no float64).
- integer (int8 to int64, uint8): the value must be a whole number in the
  target's range; NaN and infinities have no integer.
- bool: 0 and 1 (or false and true) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..arrays import FLOAT_DTYPES, dtype_name, numpy_dtype
from ..errors import InputError


def kind(dtype: str) -> str:
    """'float', 'integer' or 'bool': what a conversion between two dtypes has to check."""
    if dtype in FLOAT_DTYPES:
        return "float"
    return "bool" if dtype == "bool" else "integer"


@dataclass(frozen=True)
class Limits:
    """The values a dtype holds: integers in [low, high]; floats up to `largest` in magnitude."""

    low: int
    high: int
    largest: float
    exact_bits: int  # floats: integers up to 2**exact_bits in magnitude are held exactly


def limits(dtype: str) -> Limits:
    if dtype == "bool":
        return Limits(0, 1, 1.0, 0)
    target = numpy_dtype(dtype)
    if dtype in FLOAT_DTYPES:
        info = _bfloat16_finfo() if dtype == "bfloat16" else np.finfo(target)
        return Limits(0, 0, float(info.max), int(info.nmant) + 1)
    integer = np.iinfo(target)
    return Limits(int(integer.min), int(integer.max), float(integer.max), 0)


def _bfloat16_finfo() -> Any:
    import ml_dtypes  # only for bfloat16: importing it costs about 1 s of CPU (io/npy.py)

    return ml_dtypes.finfo(ml_dtypes.bfloat16)


def range_text(dtype: str) -> str:
    bounds = limits(dtype)
    if kind(dtype) == "float":
        return f"its largest finite value is {bounds.largest:g}"
    return f"it holds {bounds.low} to {bounds.high}"


def convert(name: str, array: np.ndarray, dtype: str) -> np.ndarray:
    """`array` as `dtype`, every value kept (floats rounded), or an InputError naming the first value that cannot be."""
    source = dtype_name(array.dtype)
    if source == dtype:
        return array
    target = numpy_dtype(dtype)
    if np.can_cast(array.dtype, target, "safe") and not (kind(source) == "integer" and kind(dtype) == "float"):
        return array.astype(target)  # a wider dtype: every value is kept (NumPy calls int64 to float64 safe; it is not)
    if kind(dtype) == "float":
        with np.errstate(over="ignore", invalid="ignore"):  # overflows are found and refused below
            converted = array.astype(target)
        infinite = np.isinf(converted)
        if kind(source) == "float" and infinite.any():
            _refuse(name, array, infinite & np.isfinite(_float64(array)), dtype, "is too large for")
        elif kind(source) == "integer":
            _refuse(name, array, ~_held_exactly(array, converted), dtype, "cannot be held exactly by",
                    f"it holds every integer up to {2 ** limits(dtype).exact_bits} exactly; {range_text(dtype)}")
        return converted
    bounds = limits(dtype)
    if kind(source) == "float":
        values = _float64(array)
        whole = np.isfinite(values) & (np.floor(values) == values)
        _refuse(name, array, ~whole, dtype, "is not a whole number, as needed by")
        _refuse(name, array, (values < bounds.low) | (values >= bounds.high + 1.0), dtype, "is out of range for")
    elif kind(source) == "integer":
        wide = array.astype(np.int64)
        if wide.size and (int(wide.min()) < bounds.low or int(wide.max()) > bounds.high):
            _refuse(name, array, (wide < bounds.low) | (wide > bounds.high), dtype, "is out of range for")
    return array.astype(target)


def _float64(array: np.ndarray) -> np.ndarray:
    """Every float dtype, bfloat16 included, widens to float64 exactly."""
    return np.asarray(array, dtype=np.float64)


def _held_exactly(array: np.ndarray, converted: np.ndarray) -> np.ndarray:
    """Which integers `converted` (a float array) holds exactly."""
    back = _float64(converted)
    fits = np.abs(back) < 2.0**63  # false for inf: an overflow to infinity holds nothing
    exact = fits.copy()
    exact[fits] = back[fits].astype(np.int64) == np.asarray(array)[fits].astype(np.int64)
    return exact


def _refuse(name: str, array: np.ndarray, bad: np.ndarray, dtype: str, problem: str, detail: str | None = None) -> None:
    if not bad.any():
        return
    flat = int(np.flatnonzero(bad)[0])
    value = value_text(np.asarray(array).reshape(-1)[flat])
    count = int(bad.sum())
    where = position_text(array.shape, flat)
    more = f" (and {count - 1} more)" if count > 1 else ""
    raise InputError(f"input {name!r}: the value {value}{where}{more} {problem} {dtype} ({detail or range_text(dtype)})")


def position_text(shape: tuple[int, ...], flat: int) -> str:
    """' at [1, 3]' for the element `flat` (in C order) of an array of `shape`; '' for a scalar."""
    return f" at {[int(i) for i in np.unravel_index(flat, shape)]}" if shape else ""


def value_text(value: object) -> str:
    """A NumPy or Python scalar as the user would write it: 1099511627781, 70000.0, 1e+39, nan."""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        digits = str(int(value))
        return digits if len(digits) <= 40 else f"{digits[:12]}... ({len(digits.lstrip('-'))} digits)"
    if isinstance(value, np.generic):
        return str(value)  # NumPy's shortest text for its own precision: 3.4e+38 for a float32, not 3.3999999521443642e+38
    return repr(float(value))  # type: ignore[arg-type]
