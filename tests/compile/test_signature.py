"""Reading signatures from exported programs: bounds as torch states them."""

from __future__ import annotations

import pytest

from cuda_runner.compile.signature import _finite_or_none


def test_unbounded_dimensions_are_recorded_as_unbounded():
    sympy = pytest.importorskip("sympy")
    from torch.utils._sympy.numbers import int_oo

    assert _finite_or_none(int_oo) is None  # int() of it raises AttributeError
    assert _finite_or_none(sympy.oo) is None
    assert _finite_or_none(sympy.Integer(64)) == 64
    assert _finite_or_none(2) == 2
