"""Read the real signature of an ExportedProgram for the manifest.

The model library only knows graph placeholder names and nothing about
dtypes or shapes, so names, dtypes, shapes, dynamic dimensions with their
bounds, and output names are all taken from the exported program here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..arrays import torch_dtype_name
from ..errors import CompileError, InputError
from ..format.manifest import DimSpec, TensorSpec, name_problem


@dataclasses.dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dims: dict[str, DimSpec]


def program_signature(program: Any, dim_names: Mapping[tuple[str, int], str] | None = None) -> Signature:
    """`dim_names` maps (input name, axis) to a user-chosen dim name, e.g. from
    torch.export.Dim("batch"); other dynamic dims are named '<input>_dim<axis>'."""
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    input_names = list(program.graph_signature.user_inputs)
    symbols = _SymbolNames(program, dim_names or {})
    inputs = []
    for name in input_names:
        if not isinstance(name, str) or name not in placeholders:  # a constant argument export folded into the program
            raise CompileError(f"the program takes a constant input ({name!r}); cuda-runner supports tensor inputs only: export with tensors")
        value = placeholders[name].meta.get("val")
        _require_tensor(value, f"input {name!r}")
        inputs.append(TensorSpec(_checked(name), torch_dtype_name(value.dtype), symbols.shape_of(name, value)))
    outputs = [
        TensorSpec(name, torch_dtype_name(value.dtype), symbols.shape_of(None, value))
        for name, value in zip(output_names(program), _output_values(program))
    ]
    example_sizes = _example_sizes(program, input_names)
    return Signature(tuple(inputs), tuple(outputs), symbols.dims(example_sizes))


def with_bounds(signature: Signature, bounds: Mapping[str, tuple[int, int]], spans: Mapping[str, tuple[int, int]] | None = None) -> Signature:
    """The signature with the inputs in `bounds` (compile/input_bounds.py) limited to those values,
    and those in `spans` to those spans (TensorSpec.span_bounds)."""
    spans = spans or {}
    inputs = tuple(dataclasses.replace(spec, bounds=bounds.get(spec.name, spec.bounds), span_bounds=spans.get(spec.name, spec.span_bounds))
                   for spec in signature.inputs)
    return dataclasses.replace(signature, inputs=inputs)


def with_positions(signature: Signature, positions: Sequence[tuple[str, int]]) -> Signature:
    """The signature with each input the fused attention takes as its position
    (name, the cache's length) limited to 0..length-1, within any bounds it
    had: the kernel is proven there only (a cache written with index_put_
    accepts -1 in eager, which picks a causal buffer's last row as the mask)."""
    limits: dict[str, tuple[int, int]] = {}
    for name, length in positions:
        low, high = limits.get(name, (0, length - 1))
        limits[name] = (low, min(high, length - 1))
    inputs = []
    for spec in signature.inputs:
        if spec.name in limits:
            low, high = limits[spec.name]
            if spec.bounds is not None:
                low, high = max(low, spec.bounds[0]), min(high, spec.bounds[1])
            spec = dataclasses.replace(spec, bounds=(low, high))
        inputs.append(spec)
    return dataclasses.replace(signature, inputs=tuple(inputs))


def output_names(program: Any) -> list[str]:
    """Key paths for a (nested) dict result ('logits', 'aux.loss'), else output_<i>."""
    import torch.utils._pytree as pytree

    count = len(program.graph_signature.user_outputs)
    tree = pytree.tree_unflatten(list(range(count)), program.call_spec.out_spec)
    if not isinstance(tree, dict):
        return [f"output_{index}" for index in range(count)]
    names = [".".join(_key_text(key) for key in path) for path, _ in pytree.tree_flatten_with_path(tree)[0]]
    return [_checked(name) for name in names]


def _key_text(key: Any) -> str:
    for attribute in ("key", "idx", "name"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _checked(name: str) -> str:
    problem = name_problem(name)
    if problem:
        raise CompileError(f"tensor name {name!r} {problem}")
    return name


def _require_tensor(value: Any, what: str) -> None:
    import torch

    if not isinstance(value, torch.Tensor):
        raise CompileError(f"{what} is a {type(value).__name__}, not a tensor; cuda-runner supports tensor inputs and outputs only")


def _output_values(program: Any) -> list[Any]:
    output_node = next(node for node in program.graph.nodes if node.op == "output")
    values = []
    for index, arg in enumerate(output_node.args[0]):
        value = getattr(arg, "meta", {}).get("val")
        _require_tensor(value, f"output {index}")
        values.append(value)
    return values


def _example_sizes(program: Any, input_names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    import torch.utils._pytree as pytree

    examples = getattr(program, "example_inputs", None)
    if not examples:
        return {}
    flat = pytree.tree_leaves(examples)
    return {name: tuple(leaf.shape) for name, leaf in zip(input_names, flat) if hasattr(leaf, "shape")}


class _SymbolNames:
    """Names sympy symbols after the user's Dims, or after where they first appear."""

    def __init__(self, program: Any, user_names: Mapping[tuple[str, int], str]):
        self._ranges = program.range_constraints
        self._user_names = user_names
        self._names: dict[Any, str] = {}
        self._first_use: dict[str, tuple[str, int]] = {}

    def shape_of(self, input_name: str | None, value: Any) -> tuple[int | str, ...]:
        return tuple(self._entry(input_name, axis, size) for axis, size in enumerate(value.shape))

    def _entry(self, input_name: str | None, axis: int, size: Any) -> int | str:
        import sympy

        if isinstance(size, int):
            return size
        expr = size.node.expr
        if isinstance(expr, sympy.Integer):
            return int(expr)
        if isinstance(expr, sympy.Symbol) and expr not in self._names and input_name is not None:
            name = self._user_names.get((input_name, axis), f"{input_name}_dim{axis}")
            self._names[expr] = _checked(name)
            self._first_use[name] = (input_name, axis)
        return str(expr.xreplace({symbol: sympy.Symbol(name) for symbol, name in self._names.items()}))

    def dims(self, example_sizes: Mapping[str, tuple[int, ...]]) -> dict[str, DimSpec]:
        dims = {}
        for symbol, name in self._names.items():
            bounds = self._ranges.get(symbol)
            low = _finite_or_none(bounds.lower) if bounds is not None else 0
            high = _finite_or_none(bounds.upper) if bounds is not None else None
            input_name, axis = self._first_use[name]
            example = example_sizes.get(input_name, ())
            dims[name] = DimSpec(name, max(low or 0, 0), high, example[axis] if axis < len(example) else None)
        return dims


def _finite_or_none(value: Any) -> int | None:
    """An integer bound, or None for an unbounded one. torch's int_oo raises
    AttributeError from int() (and sympy.oo from float() in some versions),
    so infinity is detected through float() first."""
    try:
        as_float = float(value)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None
    if not math.isfinite(as_float):
        return None
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None
    return number if number < 1 << 62 else None


def dim_names_from_dynamic_shapes(input_names: Sequence[str], dynamic_shapes: Any) -> dict[tuple[str, int], str]:
    """Map (input, axis) to torch.export.Dim names for top-level tensor inputs."""
    if dynamic_shapes is None:
        return {}
    per_input: Iterable[tuple[Any, Any]]
    if isinstance(dynamic_shapes, Mapping):
        per_input = dynamic_shapes.items()
    elif isinstance(dynamic_shapes, (list, tuple)):
        per_input = zip(input_names, dynamic_shapes)
    else:
        raise InputError("dynamic_shapes must be a dict keyed by input name, or a tuple in input order")
    names = {}
    for input_name, spec in per_input:
        axes = spec.items() if isinstance(spec, Mapping) else enumerate(spec or ())
        for axis, dim in axes:
            dim_name = getattr(dim, "__name__", None)
            if dim_name:
                names[(input_name, int(axis))] = dim_name
    return names
