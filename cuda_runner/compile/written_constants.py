"""Tensors a program writes but reads as constants become its buffers.

torch.export lifts a tensor that a module holds in a plain attribute, not
registered as a buffer, as a constant of the program. transformers 5 keeps
its static KV cache so (tensors of a cache object, not of a module), and its
export for ExecuTorch (TorchExportableModuleWithStaticCache) registers the
same tensors as buffers of its wrapper, which the graph never reads: every
layer writes its cache and a position counter in place through constants.
AOTInductor refuses such a program ("mutating a non-functional tensor with a
functional tensor", torch's own aoti_compile_and_package too), and nothing
would record those tensors as the state a run writes. In eager PyTorch they
are state: what a call writes, the next reads.

So each constant that an op of the graph may write is read as the buffer
that holds the same tensor, where one does (transformers' wrapper), or else
becomes a non-persistent buffer itself, as if the module had registered it.
Nothing else of the program changes.
"""

from __future__ import annotations

import copy
from typing import Any

from .graph_memory import GraphMemory


def written_constants_as_buffers(program: Any) -> tuple[Any, list[str]]:
    """The program with the constants its graph may write read as buffers,
    and their names; the program itself where there are none."""
    from torch.export.graph_signature import InputKind

    signature = program.graph_signature
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    memory = GraphMemory(program.graph)
    written = [spec for spec in signature.input_specs if spec.kind == InputKind.CONSTANT_TENSOR and spec.arg.name in placeholders
               and memory.written(placeholders[spec.arg.name])]
    if not written:
        return program, []
    tensors = {**program.state_dict, **program.constants}
    buffers = [spec for spec in signature.input_specs if spec.kind == InputKind.BUFFER and spec.target in tensors]
    twins = {spec.arg.name: next((buffer for buffer in buffers if _same_tensor(tensors[buffer.target], tensors[spec.target])), None)
             for spec in written}
    return _rewritten(program, written, twins), sorted(spec.target for spec in written)


def _same_tensor(first: Any, second: Any) -> bool:
    """Whether two tensors are one: the same memory, dtype, sizes and strides."""
    return bool(first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr() and first.storage_offset() == second.storage_offset()
                and first.dtype == second.dtype and first.shape == second.shape and first.stride() == second.stride())


def _rewritten(program: Any, written: list[Any], twins: dict[str, Any]) -> Any:
    """A new program (the given one stays as it was) where each written
    constant's reads go to its twin buffer, or the constant is a buffer."""
    import torch
    from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec

    graph_module = copy.deepcopy(program.graph_module)
    nodes = {node.name: node for node in graph_module.graph.nodes if node.op == "placeholder"}
    constants = dict(program.constants)
    specs = []
    changed = {spec.arg.name for spec in written}
    for spec in program.graph_signature.input_specs:
        twin = twins.get(spec.arg.name) if spec.arg.name in changed else None
        if twin is not None:
            nodes[spec.arg.name].replace_all_uses_with(nodes[twin.arg.name])
            graph_module.graph.erase_node(nodes[spec.arg.name])
            constants.pop(spec.target, None)
        elif spec.arg.name in changed:
            specs.append(InputSpec(InputKind.BUFFER, spec.arg, spec.target, persistent=False))  # its tensor stays among the constants
        else:
            specs.append(spec)
    graph_module.recompile()
    return torch.export.ExportedProgram(
        root=graph_module, graph=graph_module.graph, graph_signature=ExportGraphSignature(input_specs=specs, output_specs=list(program.graph_signature.output_specs)),
        state_dict=program.state_dict, range_constraints=program.range_constraints, module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs, constants=constants, verifiers=program.verifiers,
    )
