"""Turn an input plan into one validated set of arrays.

An `InputPlan` says where inputs come from: given entries (`.npy` files, an
`.npz` archive, inline values), generated values (`RandomInputs`), or the
samples stored in the bundle (`StoredSamples`). Resolving a plan against a
method works in two steps: every input is first described (dtype and shape,
from file headers, literal shapes or the requested sizes) and checked against
the signature, and only then is its data read or generated. A wrong or huge
input is refused before anything is allocated for it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import numpy as np

from ..arrays import DTYPE_NAMES, FLOAT_DTYPES, allocation_problem, dtype_name, itemsize, numpy_dtype, shape_text, span_problem
from ..errors import BundleError, CudaRunnerError, InputError
from ..format.manifest import MethodSpec, TensorSpec
from ..format.validation import bounded_inputs, check_bounds, evaluate_shape_entry, validate_inputs
from .convert import convert, limits, position_text, range_text, value_text
from .npy import ArrayHeader, NpzArchive, load_array, read_array_header

# ---------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class ArrayFile:
    """An .npy file, for the input `name` or the next unnamed one."""

    path: Path
    name: str | None = None


@dataclass(frozen=True)
class ArchiveFile:
    """An .npz archive whose keys are input names."""

    path: Path


@dataclass(frozen=True)
class InlineValue:
    """A value written out: a number, a JSON list, or IREE's `2x3xf32=1 2 3 4 5 6`."""

    text: str
    name: str | None = None


InputEntry = Union[ArrayFile, ArchiveFile, InlineValue]


@dataclass(frozen=True)
class GivenInputs:
    entries: tuple[InputEntry, ...] = ()
    cast: bool = False  # allow dtype conversions that keep every value (float64 -> float32; io/convert.py)


@dataclass(frozen=True)
class RandomInputs:
    seed: int = 0
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # by input name
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # [low, high)


@dataclass(frozen=True)
class StoredSamples:
    """The sample inputs stored in the bundle at compile time."""


InputPlan = Union[GivenInputs, RandomInputs, StoredSamples]


@dataclass(frozen=True)
class InputSource:
    """Where one input came from, for reports."""

    name: str
    origin: str  # "file", "archive", "literal", "random", "sample"
    detail: str = ""


@dataclass
class ResolvedInputs:
    """Inputs read or generated for one method, already checked against its
    signature: Method.run given these for that method checks them no more."""

    arrays: dict[str, np.ndarray]
    sources: list[InputSource] = field(default_factory=list)
    dims: dict[str, int] = field(default_factory=dict)
    method: MethodSpec | None = None  # the signature they were checked against
    # The (dtype, shape) of each array when it was checked (set by resolving, never by hand):
    # an array replaced or reshaped since then is checked again.
    _checked: dict[str, tuple[np.dtype, tuple[int, ...]]] | None = field(default=None, init=False, repr=False, compare=False)

    def unchanged_arrays(self, names: list[str]) -> list[np.ndarray] | None:
        """The arrays in `names` order if each is still a NumPy array of the
        dtype and shape it was checked with; None if any is not (check them again)."""
        checked = self._checked
        if checked is None or len(self.arrays) != len(checked):
            return None
        ordered = []
        for name in names:
            array = self.arrays.get(name)
            if not isinstance(array, np.ndarray) or (array.dtype, array.shape) != checked.get(name):  # np.load's memmaps too
                return None
            ordered.append(array)
        return ordered


@dataclass
class _Pending:
    """An input described but not read yet."""

    source: InputSource
    dtype: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]
    # Made in memory from sizes alone (generated): the error for sizes no array can have
    # here, given why. None for data read from a file, whose size the file bounds.
    too_large: Callable[[str], CudaRunnerError] | None = None


IREE_ELEMENT_TYPES = {
    "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
    "i1": "bool", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "ui8": "uint8", "u8": "uint8", "si8": "int8", "si16": "int16", "si32": "int32", "si64": "int64",
}
IREE_LITERAL = re.compile(r"^((?:\d+x)*)([a-z]+\d+)=(.*)$", re.DOTALL)
MAX_INLINE_ELEMENTS = 1 << 27  # 128 Mi elements: a splat beyond this is not a typo-free literal


def resolve_inputs(method: MethodSpec, plan: InputPlan, samples: NpzArchive | None = None) -> ResolvedInputs:
    """Describe, check, then read or generate every input of `plan` for `method`."""
    if isinstance(plan, RandomInputs):
        pending = _random_pending(method, plan)
    elif isinstance(plan, StoredSamples):
        if samples is None:
            raise InputError(f"method {method.name!r} has no stored samples", subject="samples")
        pending = _sample_pending(method, samples)
    else:
        with contextlib.ExitStack() as archives:
            return _resolved(method, _given_pending(method, plan, archives))
    return _resolved(method, pending)


def _resolved(method: MethodSpec, pending: list[_Pending]) -> ResolvedInputs:
    given = {item.source.name: (item.dtype, item.shape) for item in pending}
    dims = validate_inputs(method, given)
    for item in pending:
        if item.too_large is not None:
            problem = allocation_problem(item.shape, itemsize(item.dtype))
            if problem is not None:
                raise item.too_large(problem)  # before anything is allocated: not NumPy's "array is too big" later
    arrays = {item.source.name: item.load() for item in pending}
    check_bounds(method.name, [arrays[spec.name] for spec in method.inputs], bounded_inputs(method))
    resolved = ResolvedInputs(arrays, [item.source for item in pending], dims, method)
    resolved._checked = {name: (array.dtype, array.shape) for name, array in arrays.items()}
    return resolved


def check_arrays(method: MethodSpec, arrays: Mapping[str, np.ndarray], sources: list[InputSource], *, cast: bool = False) -> ResolvedInputs:
    """Validate arrays already in memory (the Python API, compile-time samples)."""
    pending = [
        _conformed(method, InputSource(name, "array"), _array_header(array), functools.partial(_same, array), cast)
        for name, array in arrays.items()
    ]
    resolved = _resolved(method, pending)
    resolved.sources = sources
    return resolved


def _array_header(array: np.ndarray) -> ArrayHeader:
    return ArrayHeader(array.dtype, tuple(array.shape), False)


# ---------------------------------------------------------------------------
# Given inputs


def _given_pending(method: MethodSpec, plan: GivenInputs, archives: contextlib.ExitStack) -> list[_Pending]:
    """Positional entries fill, in order, the inputs that no entry names."""
    described: list[tuple[str | None, Callable[[str], _Pending]]] = []
    for entry in plan.entries:
        described.extend(_describe_entry(method, entry, plan.cast, archives))
    named = {name for name, _ in described if name is not None}
    positional = iter(spec.name for spec in method.inputs if spec.name not in named)
    targets = [name or _next_positional(method, positional) for name, _ in described]
    duplicates = sorted({target for target in targets if targets.count(target) > 1})
    if duplicates:
        raise InputError(f"input {duplicates[0]!r} is given twice")
    return [make(target) for target, (_, make) in zip(targets, described)]


def _describe_entry(
    method: MethodSpec, entry: InputEntry, cast: bool, archives: contextlib.ExitStack,
) -> Iterator[tuple[str | None, Callable[[str], _Pending]]]:
    if isinstance(entry, ArchiveFile):
        archive = archives.enter_context(NpzArchive(entry.path))
        for key in archive.keys:
            if method.input(key) is None:
                raise InputError(f"archive {entry.path} has key {key!r}, which is not an input of method {method.name!r} ({_names(method)})")
            yield key, functools.partial(_archive_member, method, archive, key, str(entry.path), cast)
    elif isinstance(entry, ArrayFile):
        if entry.name is not None:
            _declared(method, entry.name)
        yield entry.name, lambda name: _conformed(
            method, InputSource(name, "file", str(entry.path)), read_array_header(entry.path), lambda: load_array(entry.path), cast,
        )
    else:
        if entry.name is not None:
            _declared(method, entry.name)
        yield entry.name, lambda name: _inline_pending(method, name, entry.text)


def _same(array: np.ndarray) -> np.ndarray:
    return array


def _archive_member(method: MethodSpec, archive: NpzArchive, key: str, label: str, cast: bool, name: str) -> _Pending:
    return _conformed(method, InputSource(name, "archive", label), archive.header(key), functools.partial(archive.load, key), cast)


def _names(method: MethodSpec) -> str:
    return ", ".join(spec.name for spec in method.inputs) or "none"


def _declared(method: MethodSpec, name: str) -> TensorSpec:
    declared = method.input(name)
    if declared is None:
        raise InputError(f"{name!r} is not an input of method {method.name!r}; it takes: {_names(method)}")
    return declared


def _next_positional(method: MethodSpec, positional: Iterator[str]) -> str:
    name = next(positional, None)
    if name is None:
        raise InputError(f"too many inputs: method {method.name!r} takes {len(method.inputs)} ({_names(method)})")
    return name


def _dtype_label(dtype: np.dtype) -> str:
    try:
        return dtype_name(dtype)
    except InputError:
        return str(dtype)


def _conformed(method: MethodSpec, source: InputSource, header: ArrayHeader, load: Callable[[], np.ndarray], cast: bool) -> _Pending:
    """Accept the dtype as it is, reinterpret bfloat16 bits, or cast if allowed; never silently."""
    declared = method.input(source.name)
    given = _dtype_label(header.dtype)
    if declared is None or given == declared.dtype:
        return _Pending(source, given, header.shape, load)
    if declared.dtype == "bfloat16" and header.dtype.kind == "V" and header.dtype.itemsize == 2:
        return _Pending(source, "bfloat16", header.shape, lambda: load().view(numpy_dtype("bfloat16")))  # np.save writes '<V2'
    if not cast:
        raise InputError(f"input {source.name!r}: expected dtype {declared.dtype}, got {given}", subject="cast")
    if given not in DTYPE_NAMES:
        raise InputError(f"input {source.name!r}: cannot convert {given} to {declared.dtype}: {given} is not a supported dtype")
    # Checked value by value once read: a value the declared dtype cannot hold is refused, never wrapped or made inf.
    return _Pending(source, declared.dtype, header.shape, lambda: convert(source.name, load(), declared.dtype))


# ---------------------------------------------------------------------------
# Inline values


def _inline_pending(method: MethodSpec, name: str, text: str) -> _Pending:
    declared = _declared(method, name)
    source = InputSource(name, "literal", text if len(text) <= 40 else text[:37] + "...")
    match = IREE_LITERAL.match(text)
    if match:
        shape, element_type = _iree_shape(name, match), match.group(2)
        dtype = IREE_ELEMENT_TYPES.get(element_type)
        if dtype is None:
            raise InputError(f"input {name!r}: unknown element type {element_type!r} in the inline value")
        if dtype != declared.dtype:
            raise InputError(f"input {name!r}: expected dtype {declared.dtype}, got {dtype} in the inline value")
        problem = span_problem(shape, itemsize(dtype))
        if problem is not None:
            raise InputError(f"input {name!r}: the inline shape {shape_text(shape)}: {problem}")
        values = match.group(3)
        return _Pending(source, dtype, shape, lambda: _iree_values(name, shape, dtype, values))
    array = parse_inline_value(name, text, declared.dtype)
    return _Pending(source, declared.dtype, tuple(array.shape), lambda: array)


def _iree_shape(name: str, match: re.Match[str]) -> tuple[int, ...]:
    sizes = [int(size) for size in match.group(1).split("x") if size]
    if any(size >= 1 << 63 for size in sizes) or math.prod(sizes) > MAX_INLINE_ELEMENTS:
        raise InputError(f"input {name!r}: the inline shape {'x'.join(map(str, sizes))} is too large for an inline value")
    return tuple(sizes)


def _iree_values(name: str, shape: tuple[int, ...], dtype: str, text: str) -> np.ndarray:
    tokens = text.replace(",", " ").split()
    count = math.prod(shape)
    values = [_scalar(name, token, dtype) for token in tokens]
    if len(values) == 1 and count != 1:
        return np.full(shape, _typed(name, values[0], dtype), dtype=numpy_dtype(dtype))  # IREE splat: one value fills the tensor
    if len(values) != count:
        raise InputError(f"input {name!r}: shape {'x'.join(map(str, shape)) or 'scalar'} needs {count} values, got {len(values)}")
    return _typed(name, np.array(values, dtype=object).reshape(shape), dtype)


def _scalar(name: str, token: str, dtype: str) -> int | float | bool:
    lowered = token.lower()
    try:
        if dtype == "bool" and lowered in ("true", "false"):
            return lowered == "true"
        if dtype in FLOAT_DTYPES:
            return _decimal(name, dtype, token)
        return int(token)  # integers stay exact: never through float; bool takes 0 and 1 (checked in _typed)
    except ValueError:
        raise InputError(f"input {name!r}: {token[:30]!r} is not a {dtype} value") from None


def _decimal(name: str, dtype: str, text: str) -> float:
    """A float written out. Python reads 1e400 as inf: a finite number too large for any float is refused,
    while inf and nan, written as such, stay."""
    value = float(text)
    if math.isinf(value) and "inf" not in text.lower():
        raise InputError(f"input {name!r}: the value {text[:30]} is too large for {dtype} ({range_text(dtype)})")
    return value


def _float(name: str, item: float, dtype: str) -> float:
    try:
        return float(item)
    except OverflowError:  # an integer beyond every float
        raise InputError(f"input {name!r}: the value {value_text(item)} is too large for {dtype} ({range_text(dtype)})") from None


def parse_inline_value(name: str, text: str, dtype: str) -> np.ndarray:
    """A number or a JSON list, typed as the input is declared (the text has no dtype)."""
    stripped = text.strip()
    lowered = stripped.lower()
    try:
        value = json.loads(lowered if lowered in ("true", "false") else stripped, parse_float=functools.partial(_decimal, name, dtype))
    except RecursionError:
        raise InputError(f"input {name!r}: the inline value is nested too deeply") from None
    except ValueError:
        raise InputError(f"input {name!r}: cannot parse the inline value {text[:40]!r}") from None
    return _typed(name, value, dtype)


def _typed(name: str, value: object, dtype: str) -> np.ndarray:
    """Numbers as `dtype`, every value kept: floats may round to the nearest float of the dtype but
    never overflow to inf; integers and bools must be whole and in range (io/convert.py)."""
    target = numpy_dtype(dtype)
    try:
        array = np.array(value, dtype=object)
    except (ValueError, RecursionError):
        raise InputError(f"input {name!r}: inline lists must be rectangular") from None
    items = list(array.flat)
    if not all(isinstance(item, (int, float, bool)) for item in items):
        raise InputError(f"input {name!r}: inline values must be numbers (and lists must be rectangular)")
    if dtype in FLOAT_DTYPES:
        return convert(name, np.array([_float(name, item, dtype) for item in items], dtype=np.float64).reshape(array.shape), dtype)
    bounds = limits(dtype)
    for flat, item in enumerate(items):
        if isinstance(item, float) and not item.is_integer():
            problem = f"is not a whole number, as needed by {dtype}"
        elif not bounds.low <= int(item) <= bounds.high:
            problem = f"is out of range for {dtype} ({range_text(dtype)})"
        else:
            continue
        raise InputError(f"input {name!r}: the value {value_text(item)}{position_text(array.shape, flat)} {problem}")
    return np.array([int(item) for item in items], dtype=target).reshape(array.shape)


# ---------------------------------------------------------------------------
# Stored samples


def _sample_pending(method: MethodSpec, archive: NpzArchive) -> list[_Pending]:
    pending = []
    for key in archive.keys:
        try:
            header = archive.header(key)
        except InputError as error:
            raise BundleError(f"method {method.name!r}: stored samples are damaged: {error}") from None
        source = InputSource(key, "sample", "stored in the bundle")
        pending.append(_Pending(source, _dtype_label(header.dtype), header.shape, functools.partial(_sample, archive, key)))
    return pending


def _sample(archive: NpzArchive, key: str) -> np.ndarray:
    try:
        return archive.load(key)
    except InputError as error:  # damaged, or too large to read here
        raise BundleError(f"stored samples cannot be read: {error}") from None


# ---------------------------------------------------------------------------
# Generated inputs


DEFAULT_FLOAT_RANGE = (-1.0, 1.0)
DEFAULT_INT_RANGE = (0.0, 2.0)  # like Polygraphy: safe for indices into any table


def example_shapes(method: MethodSpec, overrides: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Concrete shapes: the requested ones, else each dim's example (or minimum) size."""
    for name in overrides:
        if method.input(name) is None:
            raise InputError(f"a shape is given for {name!r}, which is not an input of method {method.name!r} ({_names(method)})", subject="shape")
    dims = {name: dim.example if dim.example is not None else max(dim.min, 1) for name, dim in method.dims.items()}
    for name, shape in overrides.items():
        declared = method.inputs[[spec.name for spec in method.inputs].index(name)]
        if len(shape) != declared.rank:
            raise InputError(f"input {name!r}: expected rank {declared.rank} {declared.shape_text()}, got a shape of {len(shape)} dimensions", subject="shape")
        for entry, size in zip(declared.shape, shape):
            if isinstance(entry, str) and entry in dims:
                dims[entry] = size
    shapes = {}
    for spec in method.inputs:
        if spec.name in overrides:
            shapes[spec.name] = overrides[spec.name]
            continue
        sizes = [evaluate_shape_entry(entry, dims) for entry in spec.shape]
        if any(size is None for size in sizes):
            raise InputError(f"input {spec.name!r} has the shape {spec.shape_text()}; give its sizes", subject="shape")
        if any(size is not None and size < 0 for size in sizes):
            raise BundleError(f"input {spec.name!r}: the shape {spec.shape_text()} evaluates to a negative size")
        shapes[spec.name] = tuple(size for size in sizes if size is not None)
    return shapes


def _random_pending(method: MethodSpec, plan: RandomInputs) -> list[_Pending]:
    for name in plan.ranges:
        if method.input(name) is None:
            raise InputError(f"a value range is given for {name!r}, which is not an input of method {method.name!r}", subject="range")
    generator = np.random.default_rng(plan.seed)
    concrete = example_shapes(method, plan.shapes)
    pending = []
    for spec in method.inputs:
        low, high = plan.ranges.get(spec.name, _default_range(spec))
        bounds = _drawn_bounds(spec, low, high)
        source = InputSource(spec.name, "random", f"seed {plan.seed}, range [{low:g}, {high:g})")
        shape = concrete[spec.name]
        # Drawn in input order after every check, so a seed gives the same values.
        draw = functools.partial(_draw, generator, spec.dtype, shape, bounds)
        pending.append(_Pending(source, spec.dtype, shape, draw, functools.partial(_too_large, method, plan, spec, shape)))
    return pending


def _default_range(spec: TensorSpec) -> tuple[float, float]:
    """What to draw an input from where no --range says: DEFAULT_*_RANGE, within
    the values the input accepts where the bundle bounds them."""
    if spec.dtype in FLOAT_DTYPES:
        return DEFAULT_FLOAT_RANGE
    if spec.span_bounds is not None:  # a prompt's positions, counted from the first: all at the lowest start fits any length that fits
        lowest = spec.span_bounds[0] if spec.bounds is None else max(spec.span_bounds[0], spec.bounds[0])
        return float(lowest), float(lowest + 1)
    if spec.bounds is None:
        return DEFAULT_INT_RANGE
    low, high = max(DEFAULT_INT_RANGE[0], spec.bounds[0]), min(DEFAULT_INT_RANGE[1], spec.bounds[1] + 1)
    return (float(low), float(high)) if low < high else (float(spec.bounds[0]), float(spec.bounds[0] + 1))


def _too_large(method: MethodSpec, plan: RandomInputs, spec: TensorSpec, shape: tuple[int, ...], problem: str) -> CudaRunnerError:
    """Whose sizes cannot be generated: the user's (--shape), or the manifest's static or example sizes."""
    static = [entry for entry in spec.shape if isinstance(entry, int)]
    if allocation_problem(static, itemsize(spec.dtype)) is not None:
        return BundleError(f"input {spec.name!r}: the manifest declares the {spec.dtype} shape {spec.shape_text()}, which cannot be generated: {problem}")
    given = _dims_given(method, plan.shapes)
    if spec.name in plan.shapes or any(name in given for entry in spec.shape if isinstance(entry, str) for name in _DIM_NAME.findall(entry)):
        return InputError(f"input {spec.name!r}: cannot generate {spec.dtype} values of shape {shape_text(shape)}: {problem}", subject="shape")
    return BundleError(f"input {spec.name!r}: the manifest's example sizes give the {spec.dtype} shape {shape_text(shape)}, which cannot be generated: {problem}",
                       subject="shape")


_DIM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def _dims_given(method: MethodSpec, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
    """The dims whose sizes come from the requested shapes."""
    given: set[str] = set()
    for name in shapes:
        declared = method.input(name)
        given.update(entry for entry in (declared.shape if declared is not None else ()) if isinstance(entry, str) and entry in method.dims)
    return given


def _drawn_bounds(spec: TensorSpec, low: float, high: float) -> tuple[float, float] | tuple[int, int]:
    """What to draw from for [low, high): floats as given, integers (and bools, 0 and 1) from
    [ceil(low), ceil(high)). A range reaching past what the dtype holds is refused, not clamped
    or turned into infinities."""
    where = f"input {spec.name!r}: the range [{_bound_text(low)}, {_bound_text(high)})"
    bounds = limits(spec.dtype)
    if spec.dtype in FLOAT_DTYPES:
        if not -bounds.largest <= low < high <= bounds.largest:
            raise InputError(f"{where} reaches past {spec.dtype}, whose largest finite value is {bounds.largest:g}", subject="range")
        return low, high
    low_int, high_int = math.ceil(low), math.ceil(high)
    if low_int >= high_int:
        raise InputError(f"{where} holds no {spec.dtype} value", subject="range")
    if low_int < bounds.low or high_int > bounds.high + 1:
        raise InputError(f"{where} reaches past {spec.dtype}, which holds {bounds.low} to {bounds.high} (HI is exclusive)", subject="range")
    return low_int, high_int


def _bound_text(value: float) -> str:
    value = float(value)
    return str(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)


def _draw(generator: np.random.Generator, dtype: str, shape: tuple[int, ...], bounds: tuple[float, float] | tuple[int, int]) -> np.ndarray:
    target = numpy_dtype(dtype)
    if dtype in FLOAT_DTYPES:
        return generator.uniform(bounds[0], bounds[1], size=shape).astype(target)
    return generator.integers(int(bounds[0]), int(bounds[1]), size=shape, dtype=np.int64).astype(target)
