"""Turn every way of giving inputs into one validated set of arrays.

Accepted forms, as users of iree-run-module, trtexec and Polygraphy expect:

    PATH.npy            by position
    NAME=PATH.npy       by name
    @PATH.npy           IREE's spelling (also NAME=@PATH)
    PATH.npz            an archive keyed by input names
    NAME=0.5            an inline scalar, or NAME=[1,2,3] a small JSON list
    NAME=2x3xf32=1 2 3 4 5 6    IREE's inline tensor literal
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..dtypes import FLOAT_DTYPES, dtype_name, numpy_dtype
from ..errors import InputError
from ..format.manifest import MethodSpec, TensorSpec
from ..validation import check_inputs, evaluate_shape_entry
from .npy import load_archive, load_array

_IREE_TYPES = {
    "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
    "i1": "bool", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "ui8": "uint8", "u8": "uint8", "si8": "int8", "si16": "int16", "si32": "int32", "si64": "int64",
}
_IREE_LITERAL = re.compile(r"^((?:\d+x)*)([a-z]+\d+)=(.*)$", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


@dataclass(frozen=True)
class InputSource:
    """Where one input came from, for reports."""

    name: str
    origin: str  # "file", "archive", "literal", "random"
    detail: str = ""


@dataclass
class ResolvedInputs:
    arrays: dict[str, np.ndarray]
    sources: list[InputSource] = field(default_factory=list)
    dims: dict[str, int] = field(default_factory=dict)


def resolve_inputs(method: MethodSpec, specs: Sequence[str], *, cast: bool = False, base: Path | None = None) -> ResolvedInputs:
    """Parse --inputs arguments for `method`, then validate them against its signature.

    Positional entries fill, in order, the inputs that no entry names."""
    entries = [entry for text in specs for entry in _parse_one(method, text, base)]
    named = {entry.name for entry in entries if entry.name is not None}
    positional = iter(spec.name for spec in method.inputs if spec.name not in named)
    arrays: dict[str, np.ndarray] = {}
    sources: list[InputSource] = []
    for entry in entries:
        name = entry.name or _next_positional(method, positional)
        if name in arrays:
            raise InputError(f"input {name!r} is given twice")
        arrays[name] = entry.load(name)
        sources.append(InputSource(name, entry.origin, entry.detail))
    return finish_inputs(method, arrays, sources, cast=cast)


@dataclass(frozen=True)
class _Entry:
    name: str | None  # None: positional
    load: Callable[[str], np.ndarray]
    origin: str
    detail: str


def finish_inputs(method: MethodSpec, arrays: dict[str, np.ndarray], sources: list[InputSource], *, cast: bool = False) -> ResolvedInputs:
    """Reinterpret, optionally cast, and validate a set of named arrays."""
    checked = {}
    for name, array in arrays.items():
        declared = method.input(name)
        checked[name] = _conform(name, array, declared.dtype, cast) if declared else array
    given = {name: (_dtype_label(array), tuple(array.shape)) for name, array in checked.items()}
    dims = check_inputs(method, given)
    return ResolvedInputs(checked, sources, dims)


def _dtype_label(array: np.ndarray) -> str:
    try:
        return dtype_name(array.dtype)
    except InputError:
        return str(array.dtype)


def _parse_one(method: MethodSpec, text: str, base: Path | None) -> list[_Entry]:
    name, value = _split_name(text)
    if value.startswith("@"):
        value = value[1:]
    elif name is None and _IREE_LITERAL.match(value):
        return [_Entry(None, lambda target: _literal(method, target, value), "literal", _short(value))]  # IREE's unnamed form
    if name is not None and _looks_literal(value):
        _literal_target(method, name)
        return [_Entry(name, lambda target: _literal(method, target, value), "literal", _short(value))]
    path = Path(value) if base is None or Path(value).is_absolute() else base / value
    if path.suffix == ".npz":
        if name is not None:
            raise InputError(f"{text!r}: an .npz archive supplies inputs by its keys; give it without a NAME=")
        entries = []
        for key, array in load_archive(path).items():
            if method.input(key) is None:
                raise InputError(f"archive {path} has key {key!r}, which is not an input of method {method.name!r} ({', '.join(s.name for s in method.inputs)})")
            entries.append(_Entry(key, lambda _, array=array: array, "archive", str(path)))
        return entries
    return [_Entry(name, lambda _: load_array(path), "file", str(path))]


def _short(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def _literal_target(method: MethodSpec, name: str) -> TensorSpec:
    declared = method.input(name)
    if declared is None:
        raise InputError(f"input {name!r} is not an input of method {method.name!r}; it takes: {', '.join(s.name for s in method.inputs)}")
    return declared


def _literal(method: MethodSpec, name: str, value: str) -> np.ndarray:
    return parse_literal(name, value, _literal_target(method, name).dtype)


def _next_positional(method: MethodSpec, positional) -> str:
    name = next(positional, None)
    if name is None:
        raise InputError(f"too many positional inputs: method {method.name!r} takes {len(method.inputs)}")
    return name


def _split_name(text: str) -> tuple[str | None, str]:
    """'x=a.npy' -> ('x', 'a.npy'); 'a.npy' -> (None, 'a.npy'). A path with '=' needs a NAME= or '@'."""
    if text.startswith("@"):
        return None, text
    name, sep, value = text.partition("=")
    if sep and _NAME.match(name):
        return name, value
    return None, text


def _looks_literal(value: str) -> bool:
    if _IREE_LITERAL.match(value):
        return True
    stripped = value.strip()
    if stripped.startswith("["):
        return True
    try:
        float(stripped)
        return True
    except ValueError:
        return stripped.lower() in ("true", "false")


def parse_literal(name: str, text: str, dtype: str) -> np.ndarray:
    """An inline value, typed as the input is declared (the text itself has no dtype)."""
    match = _IREE_LITERAL.match(text)
    if match:
        return _iree_literal(name, match, dtype)
    stripped = text.strip()
    try:
        value = json.loads(stripped.lower() if stripped.lower() in ("true", "false") else stripped)
    except ValueError:
        raise InputError(f"input {name!r}: cannot parse inline value {text!r}") from None
    return _typed(name, np.asarray(value), dtype)


def _iree_literal(name: str, match: re.Match, declared: str) -> np.ndarray:
    shape = tuple(int(size) for size in match.group(1).split("x") if size)
    dtype = _IREE_TYPES.get(match.group(2))
    if dtype is None:
        raise InputError(f"input {name!r}: unknown element type {match.group(2)!r} in {match.group(0)!r}")
    if dtype != declared:
        raise InputError(f"input {name!r}: expected dtype {declared}, got {dtype} in the inline literal")
    values = [float(token) for token in match.group(3).replace(",", " ").split()]
    count = int(np.prod(shape, dtype=np.int64))
    if len(values) == 1 and count != 1:
        values = values * count  # IREE splat: one value fills the tensor
    if len(values) != count:
        raise InputError(f"input {name!r}: shape {'x'.join(map(str, shape)) or 'scalar'} needs {count} values, got {len(values)}")
    return _typed(name, np.asarray(values).reshape(shape), dtype)


def _typed(name: str, values: np.ndarray, dtype: str) -> np.ndarray:
    if values.dtype == object or values.dtype.kind not in "biuf":
        raise InputError(f"input {name!r}: inline values must be numbers")
    target = numpy_dtype(dtype)
    if dtype not in FLOAT_DTYPES and values.dtype.kind == "f" and not np.all(np.mod(values, 1) == 0):
        raise InputError(f"input {name!r}: expected dtype {dtype}, got non-integer values")
    return values.astype(target)


def _conform(name: str, array: np.ndarray, declared: str, cast: bool) -> np.ndarray:
    """Accept the array as it is, reinterpret bf16 bits, or cast if allowed; never silently."""
    if declared == "bfloat16" and array.dtype.kind == "V" and array.dtype.itemsize == 2:
        return array.view(numpy_dtype("bfloat16"))  # np.save writes bfloat16 as '<V2'
    given = _dtype_label(array)
    if given == declared:
        return array
    if not cast:
        raise InputError(f"input {name!r}: expected dtype {declared}, got {given} (use --cast for a same-kind conversion)")
    if _kind(given) != _kind(declared):
        raise InputError(f"input {name!r}: cannot cast {given} to {declared}; --cast only converts within a kind (e.g. float64 to float32)")
    return array.astype(numpy_dtype(declared))


def _kind(dtype: str) -> str:
    if dtype in FLOAT_DTYPES:
        return "float"
    if dtype.startswith("int"):
        return "signed"
    return dtype  # uint8 and bool convert to nothing else


# --------------------------------------------------------------------------
# Generated inputs


DEFAULT_FLOAT_RANGE = (-1.0, 1.0)
DEFAULT_INT_RANGE = (0, 2)  # like Polygraphy: safe for indices into any table


def parse_shapes(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """--shape NAME=4x128 (a scalar is NAME=)."""
    shapes = {}
    for text in specs:
        name, sep, value = text.partition("=")
        if not sep or not name:
            raise InputError(f"--shape {text!r}: expected NAME=DIMS, e.g. x=4x128")
        try:
            shapes[name] = tuple(int(size) for size in value.split("x")) if value else ()
        except ValueError:
            raise InputError(f"--shape {text!r}: dimensions must be integers separated by 'x'") from None
    return shapes


def parse_ranges(specs: Sequence[str]) -> dict[str, tuple[float, float]]:
    """--range NAME=LO:HI (integers: HI exclusive)."""
    ranges = {}
    for text in specs:
        name, sep, value = text.partition("=")
        low, colon, high = value.partition(":")
        try:
            bounds = (float(low), float(high))
        except ValueError:
            bounds = None
        if not sep or not colon or bounds is None or not bounds[0] < bounds[1]:
            raise InputError(f"--range {text!r}: expected NAME=LO:HI with LO < HI, e.g. ids=0:30522")
        ranges[name] = bounds
    return ranges


def example_shapes(method: MethodSpec, overrides: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Concrete shapes: --shape overrides, else each dim's example (or minimum) size."""
    unknown = [name for name in overrides if method.input(name) is None]
    if unknown:
        raise InputError(f"--shape names {unknown[0]!r}, which is not an input of method {method.name!r}")
    dims = {name: dim.example if dim.example is not None else max(dim.min, 1) for name, dim in method.dims.items()}
    for name, shape in overrides.items():
        declared = method.input(name)
        if len(shape) != declared.rank:
            raise InputError(f"--shape {name}: expected rank {declared.rank} {declared.shape_text()}, got {len(shape)} dimensions")
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
            raise InputError(f"input {spec.name!r} has shape {spec.shape_text()}; give its size with --shape {spec.name}=...")
        shapes[spec.name] = tuple(sizes)
    return shapes


def random_inputs(
    method: MethodSpec,
    *,
    seed: int = 0,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    ranges: Mapping[str, tuple[float, float]] | None = None,
) -> ResolvedInputs:
    """Inputs drawn from the declared signature, repeatable for a given seed."""
    ranges = dict(ranges or {})
    unknown = [name for name in ranges if method.input(name) is None]
    if unknown:
        raise InputError(f"--range names {unknown[0]!r}, which is not an input of method {method.name!r}")
    generator = np.random.default_rng(seed)
    arrays, sources = {}, []
    concrete = example_shapes(method, shapes or {})
    for spec in method.inputs:
        shape = concrete[spec.name]
        low, high = ranges.get(spec.name, DEFAULT_FLOAT_RANGE if spec.dtype in FLOAT_DTYPES else DEFAULT_INT_RANGE)
        arrays[spec.name] = _draw(generator, spec.dtype, shape, low, high)
        sources.append(InputSource(spec.name, "random", f"seed {seed}, range [{low:g}, {high:g})"))
    return finish_inputs(method, arrays, sources)


def _draw(generator: np.random.Generator, dtype: str, shape: tuple[int, ...], low: float, high: float) -> np.ndarray:
    target = numpy_dtype(dtype)
    if dtype == "bool":
        return generator.integers(0, 2, size=shape).astype(bool)
    if dtype in FLOAT_DTYPES:
        return generator.uniform(low, high, size=shape).astype(target)
    info = np.iinfo(target)
    low_int, high_int = max(int(np.ceil(low)), info.min), min(int(np.ceil(high)), info.max + 1)
    if low_int >= high_int:
        raise InputError(f"range [{low:g}, {high:g}) holds no {dtype} value")
    return generator.integers(low_int, high_int, size=shape, dtype=np.int64).astype(target)
