"""Which values of an exported graph may share memory, and which of them an op
of the graph may write: what cuda-runner's kernels take as read-only (a
weight fetched before the launch before has finished, a mask proven once at
compile time) rests on it.

An exported program keeps in-place ops as they are (a KV cache's
`index_copy_`, `mask.logical_and_(...)`) and need not list them among its
mutated buffers, so the graph itself is read. Two nodes are taken to share
memory where either of two things says so:
- the graph's structure: an op whose schema says its result aliases an
  argument (a view, a slice, an in-place op returning its input, the pieces of
  an unbind or split, taken out by getitem), and any op without a schema (a
  higher-order op, a Python callable), taken to alias all it is given;
- the storage of the values export traced, which also ties a second name of
  the same module tensor. torch.export.save and load do not keep that tie for
  views (a slice's traced value comes back with a storage of its own), which
  is why the structure is read too, and module tensors are also tied by where
  their memory is (a buffer registered as a view of another).
An op whose schema is unknown counts as writing everything it is given.
"""

from __future__ import annotations

import operator as python_operator
from typing import Any


class GraphMemory:
    """The memory of one graph's values, grouped by what may share it."""

    def __init__(self, graph: Any) -> None:
        self._parent: dict[Any, Any] = {}
        for node in graph.nodes:
            storage = storage_of(node)
            if storage is not None:
                self._join(node, ("storage", storage))  # tagged: a weak reference cannot be compared with a node
            address = _module_tensor_address(graph, node)
            if address is not None:
                self._join(node, ("address", address))
            for source in _aliased_operands(node):
                self._join(node, source)
        self._written = {self._root(operand) for node in graph.nodes for operand in _written_operands(node)}

    def written(self, node: Any) -> bool:
        """Whether an op of the graph may write `node`'s memory (through any view of it)."""
        return self._root(node) in self._written

    def shared(self, first: Any, second: Any) -> bool:
        """Whether two nodes' values may share memory."""
        return self._root(first) == self._root(second)

    def _root(self, key: Any) -> Any:
        parent = self._parent.setdefault(key, key)
        while parent != key:
            grandparent = self._parent[parent]
            self._parent[key] = grandparent  # halve the path: later finds are shorter
            key, parent = parent, grandparent
        return key

    def _join(self, first: Any, second: Any) -> None:
        first_root, second_root = self._root(first), self._root(second)
        if first_root != second_root:
            self._parent[first_root] = second_root


def computed_alone(target: Any) -> list[Any] | None:
    """The nodes `target` is computed from (itself included, in graph order)
    where its value, wherever and at whatever step the graph reads it, is a
    function of the graph's inputs and of module tensors as they were at
    compile time; None where a write could change it. Each of the nodes is an
    input, a module tensor or an op that writes nothing, but for one kind of
    write: `constant.copy_(value)` into a module tensor that none of them
    reads before (Hugging Face's decoders copy their `cache_position` into a
    counter that way), which leaves the constant holding the value whatever
    it held. No other op writes the target's memory or that of a module
    tensor it is computed from (the next step would read it changed), and
    none writes a counter so overwritten between the copy and the target."""
    from .graph_values import ancestors_of, pure_op

    graph = target.graph
    computed_from = ancestors_of(target)
    order = {node: index for index, node in enumerate(graph.nodes)}
    memory = GraphMemory(graph)
    overwrites = [node for node in computed_from if _overwrite(node, computed_from, memory, order)]
    if not all(node.op in ("placeholder", "get_attr") or pure_op(node) or node in overwrites for node in computed_from):
        return None
    counters = {overwrite.args[0]: order[overwrite] for overwrite in overwrites}
    for writer in graph.nodes:
        if writer in overwrites:
            continue
        for operand in _written_operands(writer):
            if memory.shared(operand, target):
                return None
            for reader in computed_from:
                for read in reader.all_input_nodes:
                    if memory.shared(operand, read) and _changes_what_it_reads(writer, reader, read, counters, memory, order):
                        return None
    return computed_from


def _changes_what_it_reads(writer: Any, reader: Any, read: Any, counters: dict[Any, int], memory: GraphMemory, order: dict[Any, int]) -> bool:
    """Whether `writer`, which writes memory `read` holds, changes what
    `reader` reads of it, this step or a later one: always, but for a counter
    (overwritten before it is read), which it changes only between the
    overwrite and the read."""
    copied = [at for counter, at in counters.items() if memory.shared(read, counter)]
    if not copied:
        return True
    return any(at < order[writer] < order[reader] for at in copied)


def _overwrite(node: Any, computed_from: list[Any], memory: GraphMemory, order: dict[Any, int]) -> bool:
    """`constant.copy_(value)`, where nothing `computed_from` holds reads the
    constant's memory before the copy, and the constant is the one name the
    graph reads of a storage it covers whole: the copy then writes every byte
    a read of that memory can see (a counter that is a slice of a larger
    buffer, or read under a second name, would be read partly or through a
    name the copy misses)."""
    if node.op != "call_function" or str(node.target) != "aten.copy_.default" or len(node.args) != 2 or node.kwargs:
        return False
    constant = node.args[0]
    if getattr(constant, "op", None) != "get_attr" or not _whole_storage(module_tensor(node.graph.owning_module, str(constant.target))):
        return False
    if any(other.op == "get_attr" and other is not constant and other.users and memory.shared(other, constant) for other in node.graph.nodes):
        return False  # a second name the graph reads (one it never reads, as Hugging Face's registered counter, is no matter)
    return not any(order[other] < order[node] and any(memory.shared(source, constant) for source in other.all_input_nodes)
                   for other in computed_from)


def _whole_storage(tensor: Any) -> bool:
    """A contiguous tensor that starts and ends where its storage does."""
    if tensor is None or tensor.storage_offset() or not tensor.is_contiguous():
        return False
    return bool(tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes())


def storage_of(node: Any) -> Any:
    """The storage of the tensor export traced for `node` (a weak reference, compared by identity), or None."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    traced = node.meta.get("val")
    return StorageWeakRef(traced.untyped_storage()) if isinstance(traced, torch.Tensor) else None


def _module_tensor_address(graph: Any, node: Any) -> tuple[str, int] | None:
    """Where a module tensor's memory is (its device and the address of its
    storage): a buffer registered as a view of another shares it, also after
    torch.export.save and load, which keep no traced storage shared."""
    if node.op != "get_attr" or graph.owning_module is None:
        return None
    return _address(module_tensor(graph.owning_module, str(node.target)))


def module_tensor(module: Any, name: str) -> Any:
    """The tensor a module holds under a dotted name, or None."""
    value: Any = module
    for part in name.split("."):
        value = getattr(value, part, None)
    return value if hasattr(value, "untyped_storage") else None


def _address(tensor: Any) -> tuple[str, int] | None:
    if tensor is None:
        return None
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr()) if storage.nbytes() else None


def reads_written_elsewhere(nodes: list[Any], written_elsewhere: frozenset[str]) -> bool:
    """Whether a module tensor among `nodes` (get_attr) is one that other
    methods write, by name or by memory (a table registered as a view of a
    buffer that another method fills). A counter `nodes` overwrite whole
    before they read it (computed_alone) is not: whatever another method
    left in it, this step reads what it copied there."""
    if not written_elsewhere:
        return False
    counters = _overwritten(nodes)
    tensors = [node for node in nodes if node.op == "get_attr" and node not in counters]
    if not tensors:
        return False
    module = tensors[0].graph.owning_module
    written = {_address(module_tensor(module, name)) for name in written_elsewhere} - {None} if module is not None else set()
    return any(node.target in written_elsewhere or _module_tensor_address(node.graph, node) in written for node in tensors)


def _overwritten(nodes: list[Any]) -> set[Any]:
    """The module tensors (get_attr) that a copy among `nodes` overwrites
    before any of them reads it, by _overwrite's rule."""
    copies = [node for node in nodes if node.op == "call_function" and str(node.target) == "aten.copy_.default"]
    if not copies:
        return set()
    graph = copies[0].graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    memory = GraphMemory(graph)
    return {copy.args[0] for copy in copies if _overwrite(copy, nodes, memory, order)}


def _guards(node: Any) -> bool:
    """The input checks ExportedProgram.module() adds: they read the inputs and keep nothing."""
    return node.op == "call_module" and node.target == "_guards_fn"


def _aliased_operands(node: Any) -> list[Any]:
    """The nodes whose memory `node`'s value may share."""
    if node.op not in ("call_function", "call_module", "call_method") or _guards(node):
        return []
    if node.op == "call_function" and node.target is python_operator.getitem:
        return [node.args[0]] if hasattr(node.args[0], "op") else []
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return list(node.all_input_nodes)
    unannotated = _UNANNOTATED_ALIASES.get(schema.name, ())
    returned: set[str] = set()
    for result in schema.returns:
        if result.alias_info is not None:
            returned |= set(result.alias_info.before_set)
    aliased: list[Any] = []
    for index, argument in enumerate(schema.arguments):
        info = argument.alias_info
        annotated = info is not None and bool(set(info.before_set) & returned or "*" in info.after_set)
        if not annotated and argument.name not in unannotated:
            continue
        aliased += _nodes(_argument(node, index, argument.name))
    return aliased


# ATen ops whose result may share an argument's memory though their schemas do
# not say so, and those arguments: type_as returns self where the dtype already
# matches, _unsafe_view is a view, and set_ makes self share its source's memory.
_UNANNOTATED_ALIASES = {"aten::type_as": ("self",), "aten::_unsafe_view": ("self",), "aten::set_": ("self", "source")}


def _written_operands(node: Any) -> list[Any]:
    """The graph nodes `node` may write: the arguments its schema marks written, every node argument without a schema."""
    if node.op not in ("call_function", "call_module", "call_method") or _guards(node):
        return []
    if node.op == "call_function" and node.target is python_operator.getitem:
        return []
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return list(node.all_input_nodes)
    written: list[Any] = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written += _nodes(_argument(node, index, argument.name))
    return written


def _argument(node: Any, index: int, name: str) -> Any:
    return node.args[index] if index < len(node.args) else node.kwargs.get(name)


def _nodes(value: Any) -> list[Any]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [item for item in values if hasattr(item, "op")]
