"""Compare outputs with reference values, Polygraphy-style, with statistics per output.

An element passes when |actual - expected| <= atol + rtol * |expected|.
Relative error is |actual - expected| / (|expected| + RELATIVE_EPSILON), so a
zero reference gives a large but finite number, never NaN. NaN must meet NaN
and an infinity the same infinity. Integer and bool outputs are compared as
integers and must match exactly (2**53 and 2**53 + 1 differ, which they would
not after a trip through float64).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..arrays import FLOAT_DTYPES, dtype_name
from ..errors import InputError
from ..report.schema import SCHEMAS

RELATIVE_EPSILON = 1e-12

# (atol, rtol) by dtype; AOTInductor fuses and reorders arithmetic, so exact
# equality with eager is not expected for floating point.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1e-4, 1e-4),
    "float16": (1e-2, 1e-2),
    "bfloat16": (2e-2, 2e-2),
}
EXACT = (0.0, 0.0)


@dataclass(frozen=True)
class Tolerances:
    """Per-output overrides on top of the dtype defaults."""

    atol: Mapping[str, float] = field(default_factory=dict)  # output name, or "" for all
    rtol: Mapping[str, float] = field(default_factory=dict)
    exact: bool = False

    def for_output(self, name: str, dtype: str) -> tuple[float, float]:
        if self.exact:
            return EXACT
        atol, rtol = DEFAULT_TOLERANCES.get(dtype, EXACT)
        return self.atol.get(name, self.atol.get("", atol)), self.rtol.get(name, self.rtol.get("", rtol))


    def check_names(self, outputs: list[str]) -> None:
        """A tolerance for an output that does not exist is a typo, not a no-op."""
        for name in [*self.atol, *self.rtol]:
            if name and name not in outputs:
                raise InputError(f"a tolerance is given for {name!r}, which is not an output; outputs are: {', '.join(outputs)}", subject="tolerance")


@dataclass(frozen=True)
class OutputComparison:
    name: str
    passed: bool
    reason: str  # "" when passed
    atol: float
    rtol: float
    dtype: str
    shape: tuple[int, ...]
    max_abs_error: float | None = None
    mean_abs_error: float | None = None
    median_abs_error: float | None = None
    max_rel_error: float | None = None
    worst_index: tuple[int, ...] | None = None
    worst_actual: float | int | str | None = None
    worst_expected: float | int | str | None = None
    mismatched: int = 0
    nan_actual: int = 0
    nan_expected: int = 0
    inf_actual: int = 0
    inf_expected: int = 0

    @property
    def verdict(self) -> str:
        return "PASSED" if self.passed else "FAILED"

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["verdict"] = "PASSED" if self.passed else "FAILED"
        data["shape"] = list(self.shape)
        data["worst_index"] = None if self.worst_index is None else list(self.worst_index)
        return data


@dataclass(frozen=True)
class Comparison:
    outputs: tuple[OutputComparison, ...]
    not_compared: tuple[str, ...] = ()  # outputs without a reference, allowed by allow_missing

    @property
    def passed(self) -> bool:
        return bool(self.outputs) and all(output.passed for output in self.outputs)

    @property
    def verdict(self) -> str:
        return "PASSED" if self.passed else "FAILED"

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMAS["compare"],
            "verdict": self.verdict,
            "relative_error_epsilon": RELATIVE_EPSILON,
            "outputs": [output.to_json() for output in self.outputs],
            "not_compared": list(self.not_compared),
        }


def compare_outputs(
    actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], tolerances: Tolerances = Tolerances(), *, allow_missing: bool = False,
) -> Comparison:
    """Compare every output. One with no reference fails, unless `allow_missing`."""
    unknown = [name for name in expected if name not in actual]
    if unknown:
        raise InputError(f"the reference has {unknown[0]!r}, which is not an output; outputs are: {', '.join(actual)}")
    tolerances.check_names(list(actual))
    missing = tuple(name for name in actual if name not in expected)
    results = [compare_array(name, actual[name], expected[name], tolerances) for name in actual if name in expected]
    if not allow_missing:
        results += [_missing(name, actual[name], tolerances) for name in missing]
    if not results:
        raise InputError("the reference holds none of the outputs")
    return Comparison(tuple(results), missing if allow_missing else ())


def _missing(name: str, actual: np.ndarray, tolerances: Tolerances) -> OutputComparison:
    dtype = _dtype(actual)
    atol, rtol = tolerances.for_output(name, dtype)
    return OutputComparison(name=name, passed=False, reason="no reference value was given for this output", atol=atol, rtol=rtol, dtype=dtype, shape=tuple(actual.shape))


def _as_float64(array: np.ndarray) -> np.ndarray:
    return np.asarray(array).astype(np.float64)


def compare_array(name: str, actual: np.ndarray, expected: np.ndarray, tolerances: Tolerances) -> OutputComparison:
    actual_dtype, expected_dtype = _dtype(actual), _dtype(expected)
    atol, rtol = tolerances.for_output(name, actual_dtype)
    base: dict[str, Any] = {"name": name, "atol": atol, "rtol": rtol, "dtype": actual_dtype, "shape": tuple(actual.shape)}
    if actual_dtype != expected_dtype:
        return OutputComparison(passed=False, reason=f"dtype mismatch: got {actual_dtype}, expected {expected_dtype}", **base)
    if actual.shape != expected.shape:
        return OutputComparison(passed=False, reason=f"shape mismatch: got {list(actual.shape)}, expected {list(expected.shape)}", **base)
    if actual_dtype not in FLOAT_DTYPES:
        return _compare_exact(np.asarray(actual), np.asarray(expected), base)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: handled below, not a warning
        return _compare_floats(_as_float64(actual), _as_float64(expected), atol, rtol, base)


def _compare_floats(got: np.ndarray, want: np.ndarray, atol: float, rtol: float, base: dict[str, Any]) -> OutputComparison:
    counts: dict[str, Any] = {
        "nan_actual": int(np.isnan(got).sum()), "nan_expected": int(np.isnan(want).sum()),
        "inf_actual": int(np.isinf(got).sum()), "inf_expected": int(np.isinf(want).sum()),
    }
    finite = np.isfinite(got) & np.isfinite(want)
    special_ok = (np.isnan(got) & np.isnan(want)) | (np.isinf(got) & (got == want))
    abs_error = np.where(finite, np.abs(got - want), 0.0)
    allowed = atol + rtol * np.abs(np.where(finite, want, 0.0))
    bad = (finite & (abs_error > allowed)) | (~finite & ~special_ok)
    mismatched = int(bad.sum())
    stats = _error_stats(abs_error, want, finite)
    worst = _worst(bad, abs_error - allowed, got, want)
    reason = "" if mismatched == 0 else f"{mismatched} of {got.size} elements outside atol={atol:g}, rtol={rtol:g}"
    return OutputComparison(passed=mismatched == 0, reason=reason, mismatched=mismatched, **base, **stats, **worst, **counts)


def _compare_exact(actual: np.ndarray, expected: np.ndarray, base: dict[str, Any]) -> OutputComparison:
    """Integers and bools: equality in their own dtype, never through float64."""
    bad = actual != expected
    mismatched = int(bad.sum())
    stats: dict[str, Any] = {}
    if actual.size:
        # The verdict above is exact; these statistics are floats, as for every dtype.
        errors = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
        errors[bad & (errors == 0)] = 1.0  # differences below float64's resolution still count
        flat = int(np.argmax(bad)) if mismatched else 0
        index = tuple(int(i) for i in np.unravel_index(flat, actual.shape)) if actual.ndim else ()
        stats = {
            "max_abs_error": float(errors.max()), "mean_abs_error": float(errors.mean()), "median_abs_error": float(np.median(errors)),
            "max_rel_error": float((errors / (np.abs(expected.astype(np.float64)) + RELATIVE_EPSILON)).max()),
            "worst_index": index, "worst_actual": _exact_value(actual.flat[flat]), "worst_expected": _exact_value(expected.flat[flat]),
        }
    reason = "" if mismatched == 0 else f"{mismatched} of {actual.size} elements differ (integers must match exactly)"
    return OutputComparison(passed=mismatched == 0, reason=reason, mismatched=mismatched, **base, **stats)


def _exact_value(value: Any) -> int | bool:
    return bool(value) if isinstance(value, np.bool_) else int(value)


def _dtype(array: np.ndarray) -> str:
    try:
        return dtype_name(np.asarray(array).dtype)
    except InputError:
        return str(np.asarray(array).dtype)


def _error_stats(abs_error: np.ndarray, want: np.ndarray, finite: np.ndarray) -> dict[str, Any]:
    if not finite.any():
        return {}
    errors = abs_error[finite]
    relative = errors / (np.abs(want[finite]) + RELATIVE_EPSILON)
    return {
        "max_abs_error": float(errors.max()),
        "mean_abs_error": float(errors.mean()),
        "median_abs_error": float(np.median(errors)),
        "max_rel_error": float(relative.max()),
    }


def _worst(bad: np.ndarray, excess: np.ndarray, got: np.ndarray, want: np.ndarray) -> dict[str, Any]:
    """The element that fails by most (a non-finite mismatch first), else the largest error."""
    if got.size == 0:
        return {}
    score = np.where(bad, np.where(np.isfinite(excess), excess, np.inf), -np.inf)
    if not bad.any():
        score = np.where(np.isfinite(excess), excess, -np.inf)
    flat = int(np.argmax(score))
    index = tuple(int(i) for i in np.unravel_index(flat, got.shape)) if got.ndim else ()
    return {"worst_index": index, "worst_actual": _json_number(got.flat[flat]), "worst_expected": _json_number(want.flat[flat])}


def _json_number(value: float) -> float | str:
    """NaN and infinities are not JSON numbers: they are given as "nan", "inf", "-inf"."""
    return float(value) if np.isfinite(value) else str(float(value))
