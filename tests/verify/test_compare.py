from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cuda_runner.errors import InputError
from cuda_runner.verify import Tolerances, compare_outputs
from cuda_runner.verify.compare import compare_array


def test_identical_outputs_pass_with_zero_error():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    result = compare_array("a", a, a.copy(), Tolerances())
    assert result.passed and result.max_abs_error == 0 and result.mismatched == 0


def test_statistics_and_worst_element():
    expected = np.zeros((2, 3), np.float32)
    actual = expected.copy()
    actual[1, 2] = 0.5
    actual[0, 0] = 1e-5
    result = compare_array("a", actual, expected, Tolerances())
    assert not result.passed
    assert result.mismatched == 1
    assert result.worst_index == (1, 2) and result.worst_actual == 0.5 and result.worst_expected == 0.0
    assert result.max_abs_error == pytest.approx(0.5)
    assert result.median_abs_error == 0.0
    assert np.isfinite(result.max_rel_error)  # a zero reference does not give NaN
    assert result.max_rel_error == pytest.approx(0.5 / 1e-12)


def test_nan_meets_nan_and_is_counted():
    expected = np.array([1.0, np.nan, np.inf], np.float32)
    same = compare_array("a", expected.copy(), expected, Tolerances())
    assert same.passed and same.nan_actual == same.nan_expected == 1 and same.inf_actual == 1
    wrong = compare_array("a", np.array([1.0, 2.0, -np.inf], np.float32), expected, Tolerances())
    assert not wrong.passed and wrong.mismatched == 2 and wrong.nan_actual == 0
    assert wrong.worst_expected in ("nan", "inf")


def test_dtype_defaults_are_looser_for_half_precision():
    expected = np.array([1.0, 2.0, 3.0])
    nudged = expected * (1 + 5e-3)
    assert compare_array("a", nudged.astype(ml_dtypes.bfloat16), expected.astype(ml_dtypes.bfloat16), Tolerances()).passed
    assert not compare_array("a", nudged.astype(np.float32), expected.astype(np.float32), Tolerances()).passed


def test_integers_and_bools_are_exact():
    assert not compare_array("i", np.array([1, 2]), np.array([1, 3]), Tolerances()).passed
    assert compare_array("b", np.array([True]), np.array([True]), Tolerances()).passed


def test_per_output_tolerances_override_the_default():
    tolerances = Tolerances(atol={"logits": 0.5, "": 1e-9}, rtol={"": 0.0})
    assert tolerances.for_output("logits", "float32") == (0.5, 0.0)
    assert tolerances.for_output("other", "float32") == (1e-9, 0.0)
    assert Tolerances(exact=True).for_output("x", "float16") == (0.0, 0.0)


def test_a_tolerance_for_an_output_that_does_not_exist_is_refused():
    with pytest.raises(InputError) as info:
        compare_outputs({"a": np.zeros(1)}, {"a": np.zeros(1)}, Tolerances(atol={"typo": 1.0}))
    assert info.value.subject == "tolerance"


def test_int64_is_compared_as_integers_not_through_float64():
    big = np.array([2**53], np.int64)
    result = compare_array("i", big + 1, big, Tolerances(atol={"": 10.0}))
    assert not result.passed and result.mismatched == 1
    assert result.worst_actual == 2**53 + 1 and result.worst_expected == 2**53  # exact in the report too
    assert compare_array("i", big, big.copy(), Tolerances()).passed


def test_shape_and_dtype_mismatch_are_reported_as_such():
    assert "shape mismatch" in compare_array("a", np.zeros((2, 3)), np.zeros((3, 2)), Tolerances()).reason
    assert "dtype mismatch" in compare_array("a", np.zeros(3, np.float32), np.zeros(3), Tolerances()).reason


def test_unknown_reference_names_are_an_input_error():
    with pytest.raises(InputError, match="not an output"):
        compare_outputs({"a": np.zeros(1)}, {"b": np.zeros(1)})
    missing = compare_outputs({"a": np.zeros(1), "b": np.zeros(1)}, {"a": np.zeros(1)})
    assert not missing.passed and [output.name for output in missing.outputs if not output.passed] == ["b"]
    allowed = compare_outputs({"a": np.zeros(1), "b": np.zeros(1)}, {"a": np.zeros(1)}, allow_missing=True)
    assert allowed.passed and allowed.not_compared == ("b",)
