"""The values a method's integer inputs may hold, where the graph refuses the
rest: a decoder writes its step's key and value into a cache of S positions
at the position it is given (index_copy_), and eager PyTorch raises for a
position outside 0..S-1. A compiled library does not raise: Inductor's own
kernel stops the process with a device-side assert, and cuda-runner's fused
attention writes nothing and returns a result. So the bundle records the
range (TensorSpec.bounds) and the runtime refuses a value outside it before
the library runs.

An input bounds a write where it is the write's index, or where the index is
proven equal to it at every position of the cache and a few past either end
(compile/step_position.py: Hugging Face's exports write at a counter the
input is copied into). Inputs bounded by several writes take the narrowest
range.
"""

from __future__ import annotations

from typing import Any

from .graph_values import static_shape
from .step_position import step_position

# The writes whose index eager checks against the size of the dimension written (negative indices included).
_INDEXED_WRITES = frozenset({"aten.index_copy_.default", "aten.index_copy.default"})
_INTEGER_DTYPES = frozenset({"torch.int64", "torch.int32"})


def input_bounds(program: Any, written_elsewhere: frozenset[str] = frozenset()) -> dict[str, tuple[int, int]]:
    """The inputs of an ExportedProgram that index cache writes, by their name
    in its signature: (lowest, highest) value the graph accepts.
    `written_elsewhere`: module tensors other methods write (an index offset
    by one is not what it was at compile time)."""
    try:
        module = program.module()  # module tensors as get_attr, which the position proof reads
    except Exception:  # a program torch cannot unlift is still compiled; its inputs are then unbounded
        return {}
    names = _input_names(module, [name for name in program.graph_signature.user_inputs if isinstance(name, str)])
    proven: dict[tuple[Any, int], Any] = {}
    bounds: dict[str, tuple[int, int]] = {}
    for node in module.graph.nodes:
        write = _indexed_write(node)
        if write is None:
            continue
        index, length = write
        if (index, length) not in proven:
            proven[index, length] = _input_at(index, length, written_elsewhere)
        name = names.get(proven[index, length])
        if name is not None:
            low, high = bounds.get(name, (0, length - 1))
            bounds[name] = (low, min(high, length - 1))
    return bounds


def _input_names(module: Any, user_inputs: list[str]) -> dict[Any, str]:
    """The unlifted module's placeholders by the signature's input names: by
    name where they carry them (as torch names them), else in order where
    they are as many; none where neither holds (no input is then bounded)."""
    placeholders = [node for node in module.graph.nodes if node.op == "placeholder"]
    if sorted(node.name for node in placeholders) == sorted(user_inputs):
        return {node: node.name for node in placeholders}
    return dict(zip(placeholders, user_inputs)) if len(placeholders) == len(user_inputs) else {}


def _indexed_write(node: Any) -> tuple[Any, int] | None:
    """(index, size of the dimension written) of an index_copy into a
    dimension of static size; None for anything else."""
    if node.op != "call_function" or str(node.target) not in _INDEXED_WRITES or len(node.args) != 4 or node.kwargs:
        return None
    target, dim, index, _ = node.args
    shape = static_shape(target)
    if shape is None or not isinstance(dim, int) or not -len(shape) <= dim < len(shape) or not hasattr(index, "op"):
        return None
    if 0 in shape:  # eager checks no index against a tensor of no elements
        return None
    return index, shape[dim]


def _input_at(index: Any, length: int, written_elsewhere: frozenset[str]) -> Any | None:
    """The graph input every element of `index` is, or that the one integer
    `index` equals at every position of the cache; None if none is."""
    if index.op == "placeholder":
        value = index.meta.get("val")
        return index if str(getattr(value, "dtype", None)) in _INTEGER_DTYPES else None
    return step_position(index, length, written_elsewhere)
