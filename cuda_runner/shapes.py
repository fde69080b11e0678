"""Shapes as text: the one spelling used in messages, tables and reports."""

from __future__ import annotations

from collections.abc import Iterable


def shape_text(shape: Iterable[object]) -> str:
    """[batch, 16] for a declared shape, [4, 16] for a concrete one, [] for a scalar."""
    return "[" + ", ".join(str(entry) for entry in shape) + "]"
