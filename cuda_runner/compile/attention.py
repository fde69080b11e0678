"""Decode attention in standalone CUDA builds: SDPA calls over a few query
rows become one fused Triton kernel (attention_kernel.py) instead of SDPA's
math form.

A call qualifies when everything about it is known at compile time and the
kernel computes exactly what SDPA would: no dropout, not causal (a KV-cache
model masks by position instead), at most MAX_QUERY_ROWS query rows, static
shapes, one floating dtype, and a mask that is absent, bool or additive and
broadcasts to [B, H, L, S]. Keys and values that the model repeated per query
head (repeat_interleave along the heads, or Hugging Face's
unsqueeze-expand-reshape) are read from the unrepeated tensor, so
grouped-query attention copies nothing. A mask proven to allow just the cache
positions up to the step's (compile/position_mask.py) is replaced by that
position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .graph_values import FLOATING_DTYPES, dtype_name, one_floating_dtype, static_shape
from .graph_values import value as recorded_value
from .position_mask import position_limit

# The kernel runs one program per query row and reads every key for each:
# beyond a few rows (a prefill, an encoder) SDPA's own lowering does better.
MAX_QUERY_ROWS = 16
# The compile option that turns the fusion off ({"cuda_runner.fuse_decode_attention": False}); it is on by default.
OPTION = "cuda_runner.fuse_decode_attention"
# SDPA, and the fused kernel that took its place (which writes [B, H, L, D] contiguous, as the math form does).
_ATTENTION_CALLS = frozenset({"aten.scaled_dot_product_attention.default", "cuda_runner.decode_attention.default"})
_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


@dataclass(frozen=True)
class AttentionSite:
    """An SDPA call the fused kernel replaces, with what the kernel reads."""

    node: Any
    query: Any
    key: Any
    value: Any
    mask: Any
    scale: float
    group: int  # query heads per key/value head
    repeats: tuple[Any, ...]  # the nodes that repeated K/V per query head, dropped once unused


def decode_attention_sites(graph: Any) -> list[AttentionSite]:
    """The SDPA calls of an FX graph that the fused kernel computes exactly."""
    sites = []
    for node in graph.nodes:
        if node.op == "call_function" and str(node.target) == "aten.scaled_dot_product_attention.default":
            site = _site(node)
            if site is not None:
                sites.append(site)
    return sites


@dataclass(frozen=True)
class Fused:
    """What fuse_decode_attention replaced: SDPA calls, and of those the ones
    whose mask became the step's position."""

    calls: int = 0
    position_limits: int = 0


def fuse_decode_attention(graph_module: Any, written_elsewhere: frozenset[str] = frozenset()) -> Fused:
    """Replace the qualifying SDPA calls of `graph_module` (a copy the caller
    owns: ExportedProgram.module() makes a new one) by the fused kernel.
    `written_elsewhere`: module tensors other methods write (position_limit)."""
    sites = decode_attention_sites(graph_module.graph)
    if not sites:
        return Fused()
    import torch

    from . import attention_kernel  # noqa: F401  (registers the operator)

    operator = torch.ops.cuda_runner.decode_attention.default
    graph = graph_module.graph
    limits: dict[Any, Any] = {}  # (mask, its [B, H, L, S]) -> the position that stands for it (the layers share one mask)
    masks = set()
    position_limits = 0
    for site in sites:
        mask, limit = site.mask, None
        if mask is not None:
            key = (mask, _mask_target(site))
            if key not in limits:
                limits[key] = _position_on_device(position_limit(mask, key[1], written_elsewhere), site.query)
            limit = limits[key]
            if limit is not None:
                masks.add(mask)
                mask, position_limits = None, position_limits + 1
        with graph.inserting_before(site.node):
            fused = graph.call_function(operator, (site.query, site.key, site.value, mask, site.scale, site.group, limit))
        fused.meta.update(site.node.meta)  # its value as export saw it: pin_sdpa_layout reads the layout
        site.node.replace_all_uses_with(fused)
        graph.erase_node(site.node)
        for repeat in site.repeats:  # innermost last: each may free the one before
            if not repeat.users:
                graph.erase_node(repeat)
    for mask in masks:
        _erase_unused(mask)
    graph.lint()
    graph_module.recompile()
    return Fused(len(sites), position_limits)


def _position_on_device(position: Any, query: Any) -> Any:
    """The position, where it lives on the query's device (the kernel reads it there), else None."""
    if position is None or getattr(recorded_value(position), "device", None) != getattr(recorded_value(query), "device", None):
        return None
    return position


def _mask_target(site: AttentionSite) -> tuple[int, int, int, int]:
    """[B, H, L, S]: what the site's mask broadcasts to."""
    batch, heads, rows, _ = static_shape(site.query) or (0, 0, 0, 0)
    return batch, heads, rows, (static_shape(site.key) or (0, 0, 0))[2]


def _erase_unused(node: Any) -> None:
    """Erase `node` if nothing uses it, and so on up what it was computed from
    (only ops that write nothing: position_limit proved the mask's so)."""
    pending = [node]
    while pending:
        candidate = pending.pop()
        if candidate.users or candidate.op != "call_function":
            continue
        sources = candidate.all_input_nodes
        candidate.graph.erase_node(candidate)
        pending.extend(sources)


def pin_sdpa_layout(graph_module: Any) -> int:
    """Give the SDPA calls of `graph_module` (and the fused kernels that replaced
    some) the memory layout their export assumed where the math form would write
    another; the number of calls.

    Export computes SDPA's output as the kernel torch would pick lays it out:
    behind the [B, H, L, D] view, memory ordered [B, L, H, D] or [L, B, H, D].
    Code after it is traced against that layout: nn.MultiheadAttention
    permutes the output to [L, B, H, D], finds it contiguous, so drops its
    .contiguous(), and views it as [L*B, H*D]. The math form a standalone build
    lowers SDPA to writes [B, H, L, D] instead, and Inductor refused that view
    (ViT-B/16's and Whisper's encoders fell back to libtorch). A copy in the
    recorded order restores the layout."""
    import torch

    graph = graph_module.graph
    aten = torch.ops.aten
    pinned = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or str(node.target) not in _ATTENTION_CALLS:
            continue
        order = _memory_order(recorded_value(node))
        if order is None:
            continue
        users = list(node.users)
        inverse = [order.index(dim) for dim in range(len(order))]
        with graph.inserting_after(node):
            ordered = graph.call_function(aten.permute.default, (node, order))
        with graph.inserting_after(ordered):
            packed = graph.call_function(aten.clone.default, (ordered,), {"memory_format": torch.contiguous_format})
        with graph.inserting_after(packed):
            restored = graph.call_function(aten.permute.default, (packed, inverse))
        for user in users:
            user.replace_input_with(node, restored)
        pinned += 1
    if pinned:
        graph.lint()
        graph_module.recompile()
    return pinned


def _memory_order(value: Any) -> list[int] | None:
    """The dims of a dense tensor from the outermost in memory to the innermost,
    where that is not their order (None where it is, or the strides are not a
    dense permutation, or symbolic)."""
    shape, strides = getattr(value, "shape", None), value.stride() if hasattr(value, "stride") else None
    if shape is None or strides is None or not all(isinstance(size, int) for size in (*shape, *strides)):
        return None
    sized = [dim for dim in range(len(shape)) if shape[dim] != 1]  # a dim of one element sits anywhere
    order = sorted(sized, key=lambda dim: -strides[dim])
    expected = 1
    for dim in reversed(order):
        if strides[dim] != expected:
            return None
        expected *= shape[dim]
    if order == sized:
        return None  # contiguous already: the math form writes it so
    ones = [dim for dim in range(len(shape)) if shape[dim] == 1]
    return ones + order


def _site(node: Any) -> AttentionSite | None:
    arguments = _sdpa_arguments(node)
    if arguments is None or arguments["dropout_p"] != 0 or arguments["is_causal"]:
        return None
    query, key, value, mask = (arguments[name] for name in ("query", "key", "value", "attn_mask"))
    shapes = [shape for shape in map(static_shape, (query, key, value)) if shape is not None and len(shape) == 4]
    if len(shapes) != 3 or not one_floating_dtype(query, key, value):
        return None
    (batch, heads, rows, head_dim), (key_batch, kv_heads, length, key_dim), value_shape = shapes
    if rows > MAX_QUERY_ROWS or key_batch != batch or key_dim != head_dim or value_shape[:3] != (batch, kv_heads, length):
        return None
    if kv_heads == 0 or heads % kv_heads or (kv_heads != heads and not arguments["enable_gqa"]):
        return None
    if mask is not None and not _broadcast_mask(mask, (batch, heads, rows, length)):
        return None
    group, repeats = heads // kv_heads, ()
    unrepeated = _unrepeated(key), _unrepeated(value)
    if (unrepeated[0] is not None and unrepeated[1] is not None and unrepeated[0][2] == unrepeated[1][2]
            and not _written_between(node, unrepeated[0][1] + unrepeated[1][1])):
        (key, key_chain, repeat), (value, value_chain, _) = unrepeated  # type: ignore[misc]
        group, repeats = group * repeat, tuple(dict.fromkeys(key_chain + value_chain))  # K and V may be one repeat
    scale = arguments["scale"] if arguments["scale"] is not None else 1.0 / math.sqrt(head_dim)
    return AttentionSite(node, query, key, value, mask, float(scale), group, repeats)


def _written_between(call: Any, repeats: tuple[Any, ...]) -> bool:
    """Whether anything may write a tensor in place between the first repeat and
    the SDPA call: the repeat copied K/V as they were then, so the kernel must
    not read their source later (a cache updated after it was repeated)."""
    pending = set(repeats)
    node = call.prev
    while pending:  # walking back from the call: until the earliest repeat is passed
        if node in pending:
            pending.discard(node)
        elif node.op == "call_function" and getattr(getattr(node.target, "_schema", None), "is_mutable", True):
            return True  # a mutating op, or a call whose effects are not known
        node = node.prev
    return False


def _sdpa_arguments(node: Any) -> dict[str, Any] | None:
    if len(node.args) > len(_SDPA_PARAMETERS):
        return None
    arguments = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_PARAMETERS, node.args, strict=False)), **node.kwargs}
    return arguments if set(arguments) <= set(_SDPA_PARAMETERS) else None


def _broadcast_mask(mask: Any, target: tuple[int, ...]) -> bool:
    """A bool or floating mask whose static shape broadcasts to `target`."""
    shape = static_shape(mask)
    dtype = dtype_name(mask)
    if shape is None or len(shape) > len(target) or not (dtype == "torch.bool" or dtype in FLOATING_DTYPES):
        return False
    return all(size in (1, wanted) for size, wanted in zip(reversed(shape), reversed(target), strict=False))


def _unrepeated(node: Any) -> tuple[Any, tuple[Any, ...], int] | None:
    """(X, the nodes that repeated it, r) where `node` is X [B, Hk, S, D] with
    each head repeated r times along dim 1: repeat_interleave(X, r, dim=1), or
    reshape(expand(unsqueeze(X, 2), [B, Hk, r, S, D]), [B, Hk*r, S, D])."""
    target = str(getattr(node, "target", ""))
    if target == "aten.repeat_interleave.self_int":
        return _repeat_interleaved(node)
    if target in ("aten.reshape.default", "aten.view.default", "aten._unsafe_view.default"):
        return _expanded(node)
    return None


def _repeat_interleaved(node: Any) -> tuple[Any, tuple[Any, ...], int] | None:
    arguments = dict(zip(("self", "repeats", "dim"), node.args, strict=False)) | dict(node.kwargs)
    source, repeats, dim = arguments.get("self"), arguments.get("repeats"), arguments.get("dim")
    if not isinstance(repeats, int) or repeats < 1 or dim not in (1, -3) or static_shape(source) is None:
        return None
    if len(static_shape(source) or ()) != 4:
        return None
    return source, (node,), repeats


def _expanded(node: Any) -> tuple[Any, tuple[Any, ...], int] | None:
    expand = node.args[0]
    if str(getattr(expand, "target", "")) == "aten.clone.default":  # reshape of an expanded tensor may copy first
        chain: tuple[Any, ...] = (node, expand)
        expand = expand.args[0]
    else:
        chain = (node,)
    if str(getattr(expand, "target", "")) != "aten.expand.default":
        return None
    unsqueezed = expand.args[0]
    if str(getattr(unsqueezed, "target", "")) != "aten.unsqueeze.default" or unsqueezed.args[1] not in (2, -3):
        return None
    source = unsqueezed.args[0]
    source_shape, expanded_shape = static_shape(source), static_shape(expand)
    if source_shape is None or expanded_shape is None or len(source_shape) != 4 or len(expanded_shape) != 5:
        return None
    batch, kv_heads, length, dim = source_shape
    repeat = expanded_shape[2]
    if expanded_shape != (batch, kv_heads, repeat, length, dim) or static_shape(node) != (batch, kv_heads * repeat, length, dim):
        return None
    return source, (*chain, expand, unsqueezed), repeat

