"""cuda_runner.report.stats: the per-array summary of `run --print` and the run document."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from cuda_runner.errors import InputError
from cuda_runner.report.stats import ArrayStats, array_stats


def test_integers_are_summarised_as_floats():
    stats = array_stats(np.array([[1, 2], [3, 6]], np.int32))
    assert stats == ArrayStats(shape=(2, 2), dtype="int32", min=1.0, max=6.0, mean=3.0, nan_count=0, inf_count=0)
    assert all(type(value) is float for value in (stats.min, stats.max, stats.mean))


def test_one_sample_is_its_own_min_max_and_mean():
    assert array_stats(np.array([-2.5], np.float32)) == ArrayStats((1,), "float32", -2.5, -2.5, -2.5, 0, 0)
    assert array_stats(np.array(7.0, np.float64)) == ArrayStats((), "float64", 7.0, 7.0, 7.0, 0, 0)  # a 0-d array


def test_an_empty_array_has_no_values_but_keeps_its_shape():
    assert array_stats(np.zeros((2, 0, 3), np.int8)) == ArrayStats((2, 0, 3), "int8", None, None, None, 0, 0)
    assert array_stats(np.array([], np.float32)) == ArrayStats((0,), "float32", None, None, None, 0, 0)


def test_nan_and_inf_are_counted_apart_from_the_finite_values():
    values = np.array([np.nan, np.inf, -np.inf, 1.0, 3.0, np.nan], np.float32)
    assert array_stats(values) == ArrayStats((6,), "float32", 1.0, 3.0, 2.0, nan_count=2, inf_count=2)


def test_no_finite_value_gives_none_and_the_counts():
    assert array_stats(np.array([np.nan, np.inf], np.float64)) == ArrayStats((2,), "float64", None, None, None, 1, 1)


def test_the_mean_of_large_float32_values_does_not_overflow():
    big = float(np.finfo(np.float32).max)
    stats = array_stats(np.full(4, big, np.float32))
    assert stats.inf_count == 0
    assert stats.min == stats.max == stats.mean == pytest.approx(big)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_is_summarised_and_named_by_its_manifest_name(dtype):
    stats = array_stats(np.array([1.0, 32768.0, np.nan], dtype))
    assert stats == ArrayStats((3,), np.dtype(dtype).name, 1.0, 32768.0, 16384.5, nan_count=1, inf_count=0)


def test_booleans_count_as_zero_and_one():
    stats = array_stats(np.array([True, False, True, True]))
    assert (stats.dtype, stats.min, stats.max, stats.mean) == ("bool", 0.0, 1.0, 0.75)


def test_an_unsupported_dtype_is_an_input_error():
    with pytest.raises(InputError, match="unsupported dtype"):
        array_stats(np.array([1 + 2j]))


def test_to_json_is_plain_json_with_the_shape_as_a_list():
    document = array_stats(np.array([[1.0, np.inf]], np.float32)).to_json()
    assert document == {"shape": [1, 2], "dtype": "float32", "min": 1.0, "max": 1.0, "mean": 1.0, "nan_count": 0, "inf_count": 1}
    assert json.loads(json.dumps(document, allow_nan=False)) == document
    empty = array_stats(np.array([], np.float32)).to_json()
    assert json.loads(json.dumps(empty, allow_nan=False)) == {"shape": [0], "dtype": "float32", "min": None, "max": None,
                                                               "mean": None, "nan_count": 0, "inf_count": 0}
