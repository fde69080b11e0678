"""Check inputs against a method's recorded signature before anything runs.

The container's Run checks none of this: a wrong count kills the process and
a wrong shape silently returns garbage (docs/aoti-abi.md, "Hazards"). Every mismatch is
reported with the input, what was expected and what was given.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from ..arrays import shape_text
from ..errors import InputError
from .manifest import DimSpec, MethodSpec, TensorSpec

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def evaluate_shape_entry(entry: int | str, dims: Mapping[str, int]) -> int | None:
    """An entry's size given dim values; None where it cannot be computed here."""
    if isinstance(entry, int):
        return entry
    if entry in dims:
        return dims[entry]
    try:
        return _evaluate(ast.parse(entry, mode="eval").body, dims)
    except (SyntaxError, KeyError, ValueError, ZeroDivisionError, RecursionError):
        return None


def _evaluate(node: ast.AST, dims: Mapping[str, int]) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return dims[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left, dims), _evaluate(node.right, dims))
    raise ValueError("unsupported expression")


def validate_inputs(method: MethodSpec, given: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    """`given` maps input names to (dtype name, shape). Returns the dynamic dim values."""
    _check_names(method, given)
    bindings: dict[str, tuple[int, str]] = {}  # dim -> (value, where it was bound)
    for spec in method.inputs:
        dtype, shape = given[spec.name]
        if dtype != spec.dtype:
            raise InputError(f"input {spec.name!r}: expected dtype {spec.dtype}, got {dtype}")
        if len(shape) != spec.rank:
            raise InputError(f"input {spec.name!r}: expected rank {spec.rank} {spec.shape_text()}, got shape {shape_text(shape)}")
        for axis, (entry, size) in enumerate(zip(spec.shape, shape)):
            _check_axis(method.dims, spec, axis, entry, size, bindings)
    values = {name: value for name, (value, _) in bindings.items()}
    _check_expressions(method, given, values)
    return values


#: What check_bounds checks of one input: (position, name, (low, high), span). Not a span: every element within
#: low..high. A span: the first element from low, and the first plus the element count less one up to high.
Bounded = tuple[int, str, tuple[int, int], bool]


def bounded_inputs(method: MethodSpec) -> list[Bounded]:
    """What check_bounds checks, for each input with bounds or span bounds (TensorSpec)."""
    bounded: list[Bounded] = []
    for position, spec in enumerate(method.inputs):
        if spec.bounds is not None:
            bounded.append((position, spec.name, spec.bounds, False))
        if spec.span_bounds is not None:
            bounded.append((position, spec.name, spec.span_bounds, True))
    return bounded


def check_bounds(method: str, arrays: Sequence[Any], bounded: list[Bounded]) -> None:
    """Refuse a value outside the bounds the bundle records for its input, or
    a prompt whose positions run outside its span bounds
    (`arrays` in the signature's order, of the dtypes and shapes validated).
    The library would not refuse it: a compiled index past its dimension (a
    position past the KV cache, a token id past the vocabulary) stops the
    process (Inductor's device-side assert) or writes nothing (cuda-runner's
    fused attention), where eager PyTorch raises."""
    for position, name, (low, high), span in bounded:
        array = arrays[position]
        if array.size == 0:
            continue
        if span:
            _check_span(method, name, array, low, high)
            continue
        if array.size == 1:  # a decode step's position: no reductions on the hot path
            smallest = largest = int(array.reshape(-1)[0])
        else:
            smallest, largest = int(array.min()), int(array.max())
        if smallest < low or largest > high:
            held = smallest if smallest < low else largest
            raise InputError(f"input {name!r} holds {held}; method {method!r} accepts {low} to {high} (an index into the model's tensors)",
                             subject="bounds")


def _check_span(method: str, name: str, array: Any, low: int, high: int) -> None:
    """The positions first .. first + n - 1 an input counts over (its first element, its n elements) within low..high."""
    first, count = int(array.reshape(-1)[0]), int(array.size)
    if first < low or first + count - 1 > high:
        raise InputError(f"input {name!r} counts {count} position(s) from {first}, to {first + count - 1}; method {method!r} accepts "
                         f"positions {low} to {high} (the cache it writes them to)", subject="bounds")


def _check_names(method: MethodSpec, given: Mapping[str, object]) -> None:
    expected = [spec.name for spec in method.inputs]
    missing = [name for name in expected if name not in given]
    unexpected = [name for name in given if name not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(map(repr, missing))}")
        if unexpected:
            parts.append(f"unexpected {', '.join(map(repr, unexpected))}")
        raise InputError(
            f"method {method.name!r} takes {len(expected)} input(s) ({', '.join(expected) or 'none'}), "
            f"got {len(given)}: {'; '.join(parts)}", subject="inputs" if missing else None,
        )


def _check_axis(dims: Mapping[str, DimSpec], spec: TensorSpec, axis: int, entry: int | str, size: int, bindings: dict) -> None:
    where = f"input {spec.name!r} axis {axis}"
    if isinstance(entry, int):
        if size != entry:
            raise InputError(f"{where}: expected size {entry}, got {size} (shape {spec.shape_text()})")
        return
    dim = dims.get(entry)
    if dim is None:
        return  # an expression; checked once every dim is bound
    if not dim.allows(size):
        raise InputError(f"{where} ({entry}): size {size} is outside the compiled range [{dim.min}, {'inf' if dim.max is None else dim.max}]")
    bound = bindings.get(entry)
    if bound is not None and bound[0] != size:
        raise InputError(f"{where} ({entry}): size {size} does not match {bound[0]} given for {entry} at {bound[1]}")
    bindings.setdefault(entry, (size, where))


def _check_expressions(method: MethodSpec, given: Mapping[str, tuple[str, tuple[int, ...]]], values: Mapping[str, int]) -> None:
    for spec in method.inputs:
        shape = given[spec.name][1]
        for axis, entry in enumerate(spec.shape):
            if isinstance(entry, str) and entry not in method.dims:
                expected = evaluate_shape_entry(entry, values)
                if expected is not None and expected != shape[axis]:
                    raise InputError(f"input {spec.name!r} axis {axis}: expected {entry} = {expected}, got {shape[axis]}")
