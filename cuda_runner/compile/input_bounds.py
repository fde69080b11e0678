"""The values a method's integer inputs may hold, where the graph refuses the
rest. An input that indexes a dimension of static size (a decoder's position
into its KV cache, its token ids into the embedding's rows, a position into a
rotary table) is refused by eager PyTorch outside that dimension. A compiled
library does not refuse it: Inductor's own kernel stops the process with a
device-side assert, and cuda-runner's fused attention writes nothing and
returns a result. So the bundle records the range (TensorSpec.bounds) and the
runtime refuses a value outside it before the library runs.

The ops, and the values eager accepts for a dimension of S:
- index_copy(_) writes: 0..S-1;
- index_put(_) writes and index reads (`cache[:, :, pos] = k`, `table[pos]`):
  -S..S-1, a negative index counting from the end;
- embedding lookups, index_select, gather, scatter(_), scatter_add(_) and
  index_add(_): 0..S-1 along their dimension;
- index_fill(_): -S..S-1.
These are eager's ranges in its default mode; with deterministic algorithms on
a GPU, eager's scatter, scatter_add and index_add go through index_put_ and
take negative indices too, which the bounds refuse.

An input bounds an op where the op's index holds the input's values element
for element: the input itself, or a view, reshape, expand or copy of it (of
one dtype, written by nothing; an expand only where the index it makes has
elements, since eager checks none of an empty one). For a write, it also
bounds the op where the index is one integer proven equal to the input at
every position 0..S-1 and a few past either end (compile/step_position.py:
Hugging Face's exports write at a counter the input is copied into); only
0..S-1 is proven then. Inputs bounded by several ops take the narrowest
range.

Hugging Face's prefill writes its cache at arange(n) plus a counter it
copies cache_position[0] into: no element of the index is an input's, so
none of the above bounds it. Where an index_copy_'s index is arange(n) plus
a start proven to be the input's first element, n the input's length
(step_position.counted_from), the input gets a span instead
(TensorSpec.span_bounds): its first element from 0 and its first + n - 1 to
S-1, which is what eager's index_copy_ accepts of first .. first + n - 1.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .graph_memory import GraphMemory
from .graph_values import static_shape
from .step_position import counted_from, step_position

_INTEGER_DTYPES = frozenset({"torch.int64", "torch.int32"})
# Ops whose result holds the values of their first argument element for element, and no others:
# an index made by them from an input holds the input's values (an expand, where it has elements).
_SAME_VALUES = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.unsqueeze.default", "aten.squeeze.default",
    "aten.squeeze.dim", "aten.squeeze.dims", "aten.flatten.using_ints", "aten.permute.default", "aten.transpose.int", "aten.t.default",
    "aten.expand.default", "aten.clone.default", "aten.alias.default", "aten.contiguous.default",
})
# Ops that take an index into one dimension (self, dim, index, ...): whether eager takes negative values from the end.
_ALONG_DIM = {
    "aten.index_select.default": False, "aten.gather.default": False, "aten.scatter.src": False, "aten.scatter.value": False,
    "aten.scatter_.src": False, "aten.scatter_.value": False, "aten.scatter_add.default": False, "aten.scatter_add_.default": False,
    "aten.index_add.default": False, "aten.index_add_.default": False, "aten.index_fill.int_Scalar": True,
    "aten.index_fill.int_Tensor": True, "aten.index_fill_.int_Scalar": True, "aten.index_fill_.int_Tensor": True,
}


class _Indexed(NamedTuple):
    """An index into a dimension of `length`, whose negative values eager takes from the end or not.
    `write`: a cache write, whose index may be proven equal to an input; a read's must be the input
    itself (proving a token id into a vocabulary of 150,000 would take as many evaluations)."""

    index: Any
    length: int
    negatives: bool
    write: bool = False


class InputBounds(NamedTuple):
    """What an ExportedProgram's inputs may hold, by their name in its signature:
    `values`, the lowest and highest value of every element (an index into a
    dimension of static size); `spans`, for an input whose first element a
    write's index counts up from (compile/step_position.py's counted_from),
    the lowest first element and the highest last one it may count to, its
    element count n making the span first .. first + n - 1."""

    values: dict[str, tuple[int, int]]
    spans: dict[str, tuple[int, int]]


def input_bounds(program: Any, written_elsewhere: frozenset[str] = frozenset()) -> dict[str, tuple[int, int]]:
    """The inputs of an ExportedProgram that index dimensions of static size,
    by their name in its signature: (lowest, highest) value the graph accepts.
    `written_elsewhere`: module tensors other methods write (an index offset
    by one is not what it was at compile time)."""
    return all_input_bounds(program, written_elsewhere).values


def all_input_bounds(program: Any, written_elsewhere: frozenset[str] = frozenset()) -> InputBounds:
    """input_bounds, and the spans of the inputs a write's index counts up from (InputBounds)."""
    try:
        module = program.module()  # module tensors as get_attr, which the position proof reads
    except Exception:  # a program torch cannot unlift is still compiled; its inputs are then unbounded
        return InputBounds({}, {})
    names = _input_names(module, [name for name in program.graph_signature.user_inputs if isinstance(name, str)])
    memory = GraphMemory(module.graph)
    proven: dict[tuple[Any, int], tuple[Any, bool] | None] = {}
    counted: dict[tuple[Any, int], Any] = {}
    bounds: dict[str, tuple[int, int]] = {}
    spans: dict[str, tuple[int, int]] = {}
    for node in module.graph.nodes:
        for indexed in _indexed_dims(node):
            key = (indexed.index, indexed.length)
            if key not in proven or (proven[key] is None and indexed.write):
                proven[key] = _input_at(indexed.index, indexed.length, memory, written_elsewhere if indexed.write else None)
            found = proven[key]
            if found is None:
                if indexed.write and not indexed.negatives:  # an index_copy_'s: a negative start is refused, not counted from the end
                    if key not in counted:
                        counted[key] = counted_from(indexed.index, indexed.length, written_elsewhere)
                    _narrow(spans, names.get(counted[key]) if _unwritten(counted[key], memory) else None, 0, indexed.length - 1)
                continue
            source, same_values = found
            # Negative values are the input's own only where the index holds its values, not where it was proven equal on 0..S-1.
            low = -indexed.length if indexed.negatives and same_values else 0
            _narrow(bounds, names.get(source) if _unwritten(source, memory) else None, low, indexed.length - 1)
    return InputBounds(bounds, spans)


def _unwritten(source: Any, memory: GraphMemory) -> bool:
    """An input the method changes in place (tokens[:, 0] = bos) is not what it indexes with."""
    return source is not None and not memory.written(source)


def _narrow(bounds: dict[str, tuple[int, int]], name: str | None, low: int, high: int) -> None:
    """Inputs bounded by several ops take the narrowest range."""
    if name is None:
        return
    held_low, held_high = bounds.get(name, (low, high))
    bounds[name] = (max(held_low, low), min(held_high, high))


def _input_names(module: Any, user_inputs: list[str]) -> dict[Any, str]:
    """The unlifted module's placeholders by the signature's input names: by
    name where they carry them (as torch names them), else in order where
    they are as many; none where neither holds (no input is then bounded)."""
    placeholders = [node for node in module.graph.nodes if node.op == "placeholder"]
    if sorted(node.name for node in placeholders) == sorted(user_inputs):
        return {node: node.name for node in placeholders}
    return dict(zip(placeholders, user_inputs)) if len(placeholders) == len(user_inputs) else {}


def _indexed_dims(node: Any) -> list[_Indexed]:
    """The indices `node` takes into dimensions of static size, for the ops
    whose eager form refuses an index outside them; none for anything else."""
    if node.op != "call_function" or node.kwargs:
        return []
    target = str(node.target)
    if target in ("aten.index_copy_.default", "aten.index_copy.default") and len(node.args) == 4:
        tensor, dim, index, _ = node.args
        return _one_dim(tensor, dim, index, negatives=False, write=True)
    if target in ("aten.embedding.default",) and len(node.args) >= 2:
        weight, index = node.args[:2]
        return _one_dim(weight, 0, index, negatives=False)
    if target in _ALONG_DIM and len(node.args) >= 3:
        tensor, dim, index = node.args[:3]
        return _one_dim(tensor, dim, index, negatives=_ALONG_DIM[target])
    if target in ("aten.index_put_.default", "aten.index_put.default") and len(node.args) in (3, 4):
        return _advanced_indices(node.args[0], node.args[1], write=True)
    if target == "aten.index.Tensor" and len(node.args) == 2:
        return _advanced_indices(node.args[0], node.args[1], write=False)
    return []


def _one_dim(tensor: Any, dim: Any, index: Any, negatives: bool, write: bool = False) -> list[_Indexed]:
    shape = static_shape(tensor)
    if shape is None or not isinstance(dim, int) or not -len(shape) <= dim < len(shape) or not hasattr(index, "op"):
        return []
    if 0 in shape:  # eager checks no index against a tensor of no elements
        return []
    return [_Indexed(index, shape[dim], negatives, write)]


def _advanced_indices(tensor: Any, indices: Any, write: bool) -> list[_Indexed]:
    """`tensor[indices]`'s integer index tensors, each into the dimension at
    its place in the list (None keeps a dimension whole). A mask (bool or
    uint8) spans as many dimensions as it has, so a list holding one is left."""
    shape = static_shape(tensor)
    if shape is None or 0 in shape or not isinstance(indices, (list, tuple)) or len(indices) > len(shape):
        return []
    if any(index is not None and not _integer(index) for index in indices):
        return []
    given = [index for index in indices if index is not None]
    if len(given) > 1 and not all(_never_empty(index) for index in given):
        return []  # indices broadcast together: beside one that may be empty, eager checks none of them
    return [_Indexed(index, shape[dim], True, write) for dim, index in enumerate(indices) if index is not None]


def _never_empty(node: Any) -> bool:
    shape = static_shape(node)
    return shape is not None and 0 not in shape


def _integer(node: Any) -> bool:
    return hasattr(node, "op") and str(getattr(node.meta.get("val"), "dtype", None)) in _INTEGER_DTYPES


def _input_at(index: Any, length: int, memory: GraphMemory, written_elsewhere: frozenset[str] | None) -> tuple[Any, bool] | None:
    """(the graph input whose values `index` holds, True), or (`written_elsewhere`
    given) (the input the one integer `index` equals at every position of the
    dimension, False); None if neither is found."""
    source = _values_of_input(index, memory)
    if source is not None:
        return source, True
    position = step_position(index, length, written_elsewhere) if written_elsewhere is not None else None
    return (position, False) if position is not None else None


def _values_of_input(index: Any, memory: GraphMemory) -> Any | None:
    """The integer graph input `index` holds the values of, element for
    element, through _SAME_VALUES ops none of whose results the graph writes
    (a copy added to in place holds other values); None if there is none.
    Through an expand only where the index has elements: expanded to none,
    eager checks nothing, and the input's values would still be checked."""
    node, expanded = index, False
    while node.op != "placeholder":
        if node.op != "call_function" or str(node.target) not in _SAME_VALUES or not node.args or not hasattr(node.args[0], "op"):
            return None
        if memory.written(node):
            return None
        expanded = expanded or str(node.target) == "aten.expand.default"
        node = node.args[0]
    if not _integer(node) or (expanded and not _never_empty(index)):
        return None
    return node
