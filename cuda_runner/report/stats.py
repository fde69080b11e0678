"""Per-array summaries for `run --print` and reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..arrays import dtype_name


@dataclass(frozen=True)
class ArrayStats:
    shape: tuple[int, ...]
    dtype: str
    min: float | None
    max: float | None
    mean: float | None
    nan_count: int
    inf_count: int

    def to_json(self) -> dict:
        data = asdict(self)
        data["shape"] = list(self.shape)
        return data


def _finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def array_stats(array: np.ndarray) -> ArrayStats:
    """min/max/mean over finite values (NaN and Inf are counted apart)."""
    values = np.asarray(array)
    name = dtype_name(values.dtype)
    if values.dtype.kind == "V" or name in ("float16", "bfloat16"):
        values = values.astype(np.float32)
    nan_count = inf_count = 0
    if values.dtype.kind == "f":
        nan_count = int(np.isnan(values).sum())
        inf_count = int(np.isinf(values).sum())
        values = values[np.isfinite(values)]
    if values.size == 0:
        return ArrayStats(tuple(array.shape), name, None, None, None, nan_count, inf_count)
    numeric = values.astype(np.float64)
    return ArrayStats(
        tuple(array.shape), name,
        _finite_or_none(numeric.min()), _finite_or_none(numeric.max()), _finite_or_none(numeric.mean()),
        nan_count, inf_count,
    )
