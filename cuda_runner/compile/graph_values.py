"""What export recorded of an FX node's value (node.meta["val"]), as the
graph rewrites of standalone CUDA builds read it: static shapes, strides and
dtypes; and whether a node may write a tensor. Each answers None or False
where the value is missing or symbolic (True where a write cannot be ruled
out), so that a rewrite leaves what it cannot know alone."""

from __future__ import annotations

import math
from typing import Any

# The dtypes cuda-runner's own kernels compute in (as str(torch.dtype)).
FLOATING_DTYPES = frozenset({"torch.float16", "torch.bfloat16", "torch.float32"})


def value(node: Any) -> Any:
    return getattr(node, "meta", {}).get("val")


def static_shape(node: Any) -> tuple[int, ...] | None:
    """The node's shape where every size is a plain int, else None."""
    shape = getattr(value(node), "shape", None)
    if shape is None or not all(isinstance(size, int) for size in shape):
        return None
    return tuple(shape)


def static_elements(node: Any) -> int | None:
    """How many elements the node's value has, where its shape is static, else None."""
    shape = static_shape(node)
    return math.prod(shape) if shape is not None else None


def strides(node: Any) -> tuple[Any, ...]:
    recorded = value(node)
    return tuple(recorded.stride()) if hasattr(recorded, "stride") else ()


def dtype_name(node: Any) -> str:
    return str(getattr(value(node), "dtype", None))


def one_floating_dtype(*nodes: Any) -> bool:
    """Whether the nodes share one dtype, and it is one of FLOATING_DTYPES."""
    dtypes = {dtype_name(node) for node in nodes}
    return len(dtypes) == 1 and dtypes <= FLOATING_DTYPES


def may_write(node: Any) -> bool:
    """Whether an FX node may write to a tensor: an ATen op whose schema says so,
    or a call whose writes no schema tells (a higher-order op, such as the one
    export wraps a `torch.no_grad()` block in, or another Python callable)."""
    if node.op in ("call_module", "call_method"):  # code no schema describes
        return True
    # operator.getitem and the like (module _operator) pick values; they write nothing.
    if node.op != "call_function" or getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return False
    import torch

    return not isinstance(node.target, torch._ops.OpOverload) or bool(node.target._schema.is_mutable)


def pure_op(node: Any) -> bool:
    """Whether an FX node is an ATen op whose value depends on its operands
    alone: it writes nothing and draws no random numbers."""
    if node.op != "call_function":
        return False
    import torch

    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags


def ancestors_of(node: Any) -> list[Any]:
    """The nodes `node` is computed from, itself included, in graph order."""
    seen = {node}
    pending = [node]
    while pending:
        for source in pending.pop().all_input_nodes:
            if source not in seen:
                seen.add(source)
                pending.append(source)
    return [candidate for candidate in node.graph.nodes if candidate in seen]


def one_integer(node: Any) -> bool:
    """A tensor of shape [1] (one per query row, as the kernel takes it) of int32 or int64."""
    return static_shape(node) == (1,) and dtype_name(node) in ("torch.int32", "torch.int64")
