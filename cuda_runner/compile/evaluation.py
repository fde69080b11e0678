"""Pieces of an exported graph evaluated on their own, at compile time, on
the CPU: the proofs of position masks (compile/position_mask.py), of the
position a cache is written at (compile/attention.py) and of rotations
(compile/rotary.py) run a few ops of the graph at every position of a cache.

They run on copies of the module tensors they read, with every device the
ops name taken for the CPU: a table indexed past its end is then an error
that rules the proof out, where on the GPU it would be a device-side assert
that leaves the process unable to use the device (and the compile with it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .graph_memory import module_tensor


def on_cpu(output: Any, inputs: list[Any], nodes: Iterable[Any], in_float64: frozenset[Any] = frozenset()) -> Callable[..., Any]:
    """A function of `inputs` (graph nodes, given as tensors in that order)
    computing `output` from `nodes` (the ops and module tensors between,
    in graph order) on the CPU. The nodes in `in_float64` compute in
    float64: every floating dtype they name becomes float64."""
    import torch
    from torch import fx

    graph = fx.Graph()
    root = torch.nn.Module()
    copies: dict[Any, Any] = {node: graph.placeholder(f"input_{index}") for index, node in enumerate(inputs)}
    for node in nodes:
        if node in copies:
            continue
        if node.op == "get_attr":
            tensor = module_tensor(output.graph.owning_module, str(node.target))
            if tensor is None:
                raise LookupError(f"the graph reads {node.target}, which its module does not hold")
            name = f"tensor_{len(root._buffers)}"
            root.register_buffer(name, tensor.detach().to("cpu", copy=True))  # a copy even on the CPU: the proof's copies write it
            copies[node] = graph.get_attr(name)
            continue
        copied = graph.node_copy(node, lambda other: copies[other])
        if node in in_float64:
            copied.args, copied.kwargs = _in_float64(copied.args), _in_float64(copied.kwargs)
        copied.args, copied.kwargs = _on_cpu(copied.args), _on_cpu(copied.kwargs)
        _devices_on_cpu(copied)
        copies[node] = copied
    graph.output(copies[output])
    module = fx.GraphModule(root, graph)
    return lambda *given: module(*given)


def _in_float64(argument: Any) -> Any:
    """An op's arguments with every floating dtype it names made float64."""
    import torch

    if isinstance(argument, torch.dtype):
        return torch.float64 if argument.is_floating_point else argument
    return _each(argument, _in_float64)


def _on_cpu(argument: Any) -> Any:
    """An op's arguments with every device it names the CPU (an arange made on the GPU each step, say)."""
    import torch

    if isinstance(argument, torch.device):
        return torch.device("cpu")
    return _each(argument, _on_cpu)


def _devices_on_cpu(node: Any) -> None:
    """Every argument the op's schema types as a device made the CPU, however
    it is written: torch.export's move_to_device_pass writes a device as a
    string ('cuda:0'), which _on_cpu cannot tell from any other string."""
    import torch

    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return
    args, kwargs = list(node.args), dict(node.kwargs)
    for position, argument in enumerate(schema.arguments):
        if "Device" not in str(argument.type):
            continue
        if argument.kwarg_only or position >= len(args):
            if kwargs.get(argument.name) is not None:
                kwargs[argument.name] = torch.device("cpu")
        elif args[position] is not None:
            args[position] = torch.device("cpu")
    node.args, node.kwargs = tuple(args), kwargs


def _each(argument: Any, change: Callable[[Any], Any]) -> Any:
    if isinstance(argument, tuple):
        return tuple(change(item) for item in argument)
    if isinstance(argument, list):
        return [change(item) for item in argument]
    if isinstance(argument, dict):
        return {key: change(item) for key, item in argument.items()}
    return argument
