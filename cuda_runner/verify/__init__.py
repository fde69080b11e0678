"""Verification: comparing outputs with references, and bundle self-tests."""

from .compare import DEFAULT_TOLERANCES, Comparison, OutputComparison, Tolerances, compare_outputs
from .reference import load_reference

__all__ = ["DEFAULT_TOLERANCES", "Comparison", "OutputComparison", "Tolerances", "compare_outputs", "load_reference"]
