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

A decode step also writes its key and value into the caches it then reads
(index_copy_ at its position), and rotates its query and key first (RoPE):
in a standalone build of the 1B decoder that was one more launch a layer,
Inductor's kernel for the rotations and the two writes. Where the caches are
module buffers that nothing else in the step touches, the fused kernel takes
the writes over (cuda_runner::decode_attention_update), and where the query
or key is proven a rotation of the projection by the position
(compile/rotary.py) it rotates them itself, from tables made at compile time.
"""

from __future__ import annotations

import math
import operator as python_operator
from dataclasses import dataclass
from typing import Any

from . import rotary
from .graph_memory import GraphMemory, module_tensor
from .graph_values import FLOATING_DTYPES, dtype_name, one_floating_dtype, pure_op, static_shape
from .graph_values import value as recorded_value
from .position_mask import position_limit
from .step_position import step_position

# The kernel runs one program per query row and reads every key for each:
# beyond a few rows (a prefill, an encoder) SDPA's own lowering does better.
MAX_QUERY_ROWS = 16
# The compile option that turns the fusion off ({"cuda_runner.fuse_decode_attention": False}); it is on by default.
OPTION = "cuda_runner.fuse_decode_attention"
# The one that leaves a step's cache writes and rotations to Inductor (the attention stays fused); on by default.
UPDATE_OPTION = "cuda_runner.fuse_cache_update"
# SDPA, and the fused kernel that took its place (which writes [B, H, L, D] contiguous, as the math form does).
_ATTENTION_CALLS = frozenset({"aten.scaled_dot_product_attention.default", "cuda_runner.decode_attention.default",
                              "cuda_runner.decode_attention_update.default"})
_CACHE_WRITE = "aten.index_copy_.default"
# What export puts after a cast to check its result: nothing reads it, so it keeps no value alive once that is not used.
_METADATA_CHECK = "aten._assert_tensor_metadata.default"
# The names of the rotation tables a build adds to the module (one pair per distinct table).
TABLE_PREFIX = "cuda_runner_rotary_"
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
    """What fuse_decode_attention replaced: SDPA calls; of those the ones whose
    mask became the step's position, and the ones that write the step's key
    and value into the caches themselves; and the queries and keys they rotate."""

    calls: int = 0
    position_limits: int = 0
    cache_updates: int = 0
    rotations: int = 0
    tables: tuple[tuple[str, Any], ...] = ()  # the rotation tables added to the module: (buffer name, tensor)
    # The inputs that became a position limit, and the length of the cache each limits: the proof
    # holds for positions 0..length-1 only (graph input name, length).
    positions: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class CacheWrite:
    """A decode step's key and value written into the caches its attention
    reads: key_cache.index_copy_(2, position, key), the same for the value."""

    key_cache: Any  # module buffers (get_attr)
    value_cache: Any
    key: Any  # [B, Hk, 1, D]
    value: Any
    position: Any  # a graph input of one integer
    writes: tuple[Any, Any]


def inline_grad_mode_regions(graph_module: Any) -> int:
    """Inline each region the export wrapped to turn gradients off
    (torch.ops.higher_order.wrap_with_set_grad_enabled(False, body, ...)): the
    proofs follow values op by op and cannot see into a call of a submodule,
    and an inference build computes the same either way. transformers 5.17's
    Llama computes RoPE's cos and sin in such a region (no rotation was proven
    in its static-cache export; 5.25 computes them inline). A body that reads
    attributes of its own (a nested region, a constant) is left as it is.
    Returns how many regions were inlined."""
    import torch

    region = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    graph, inlined = graph_module.graph, 0
    for node in list(graph.nodes):
        if region is None or node.op != "call_function" or node.target is not region or node.args[0] is not False:
            continue
        body = getattr(graph_module, str(node.args[1].target), None)
        if body is None or any(inner.op == "get_attr" for inner in body.graph.nodes):
            continue
        placeholders = [inner for inner in body.graph.nodes if inner.op == "placeholder"]
        operands = list(node.args[2:])
        if len(placeholders) != len(operands) or any(user.target is not python_operator.getitem for user in node.users):
            continue
        with graph.inserting_before(node):
            results = graph.graph_copy(body.graph, dict(zip(placeholders, operands)))
        results = results if isinstance(results, (tuple, list)) else (results,)
        for user in list(node.users):
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        body_node = node.args[1]
        graph.erase_node(node)
        if not body_node.users:
            graph.erase_node(body_node)
        inlined += 1
    if inlined:
        graph_module.recompile()
    return inlined


def fuse_decode_attention(graph_module: Any, written_elsewhere: frozenset[str] = frozenset(), update_caches: bool = True) -> Fused:
    """Replace the qualifying SDPA calls of `graph_module` (a copy the caller
    owns: ExportedProgram.module() makes a new one) by the fused kernel.
    `written_elsewhere`: module tensors other methods write (position_limit).
    `update_caches`: let the kernel write the step's key and value and rotate
    them where it can."""
    sites = decode_attention_sites(graph_module.graph)
    if not sites:
        return Fused()
    import torch

    from . import attention_kernel  # noqa: F401  (registers the operators)

    inline_grad_mode_regions(graph_module)
    graph = graph_module.graph
    limits: dict[Any, Any] = {}  # (mask, its [B, H, L, S]) -> the position that stands for it (the layers share one mask)
    masks = set()
    position_limits = cache_updates = rotations = 0
    positions: set[tuple[str, int]] = set()
    shared = _Shared(graph_module)
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
                positions.add((str(limit.name), key[1][3]))
        cache_write = _cache_write(site, shared, written_elsewhere) if update_caches else None
        with graph.inserting_before(site.node):
            if cache_write is None:
                fused = graph.call_function(torch.ops.cuda_runner.decode_attention.default,
                                            (site.query, site.key, site.value, mask, site.scale, site.group, limit))
            else:
                fused, rotated = _updating_call(graph, site, cache_write, mask, limit, shared, written_elsewhere)
                cache_updates, rotations = cache_updates + 1, rotations + rotated
        fused.meta.update(site.node.meta)  # its value as export saw it: pin_sdpa_layout reads the layout
        site.node.replace_all_uses_with(fused)
        graph.erase_node(site.node)
        for repeat in site.repeats:  # innermost last: each may free the one before
            if not repeat.users:
                graph.erase_node(repeat)
        if cache_write is not None:
            for write in cache_write.writes:
                graph.erase_node(write)  # the kernel writes instead (_cache_write saw that only this call read them)
            _erase_dead([site.query, cache_write.key, cache_write.value])
    _erase_dead(list(masks))
    graph.lint()
    graph_module.recompile()
    return Fused(len(sites), position_limits, cache_updates, rotations, shared.added(), tuple(sorted(positions)))


def _updating_call(graph: Any, site: AttentionSite, cache_write: CacheWrite, mask: Any, limit: Any, shared: _Shared,
                   written_elsewhere: frozenset[str]) -> tuple[Any, int]:
    """The call of decode_attention_update that stands for `site` and its cache
    writes, and how many of its query and key it rotates itself."""
    import torch

    positions = (static_shape(cache_write.key_cache) or (0, 0, 0))[2]
    device = recorded_value(site.query).device  # where the kernel runs: _cache_write saw the position there too
    operands = []
    for node in (site.query, cache_write.key):
        found = rotary.rotation(node, cache_write.position, positions, written_elsewhere, shared.proven)
        operands.append((node, None, None, rotary.NO_ROTATION) if found is None else
                        (found.source, shared.node(found.cos, device), shared.node(found.sin, device), found.pairs))
    (query, query_cos, query_sin, query_pairs), (key, key_cos, key_sin, key_pairs) = operands
    # What the kernel may read before it waits for the launch ahead of it: nothing unless it is not the
    # step's first launch, whose predecessor is whatever the caller queued last (run_device takes the
    # caller's arrays as they are; the last call's cache writes); then the caches' first tiles, and
    # the position and limit where they are graph inputs the step does not write.
    memory = GraphMemory(graph)
    unwritten = all(node.op == "placeholder" and not memory.written(node) for node in (cache_write.position, limit) if node is not None)
    after_a_launch = _after_a_product(graph, [query, key, cache_write.value])
    call = graph.call_function(torch.ops.cuda_runner.decode_attention_update.default, (
        query, key, cache_write.value, cache_write.key_cache, cache_write.value_cache, cache_write.position, mask, site.scale, site.group,
        limit, query_cos, query_sin, key_cos, key_sin, query_pairs, key_pairs, unwritten, after_a_launch))
    return call, (query_pairs != rotary.NO_ROTATION) + (key_pairs != rotary.NO_ROTATION)


# Ops that always launch a kernel of the step: the products a decoder's query, key and value come
# from (a copy or an elementwise op may be dropped by Inductor as doing nothing, a product never is).
_PRODUCTS = frozenset({
    "linear", "mm", "addmm", "bmm", "matmul", "baddbmm", "einsum", "mv", "addmv", "_scaled_mm", "_int_mm", "_weight_int4pack_mm",
    "_weight_int8pack_mm", "convolution", "conv1d", "conv2d", "conv3d",
})
# Ops that take only the shape (and dtype, device) of their tensor argument: what they make does
# not wait for that tensor's kernel, which Inductor may then drop.
_SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
                         "new_zeros", "new_ones", "new_empty", "new_full", "sym_size", "sym_numel", "sym_stride"})


def _op_name(node: Any) -> str:
    """`mm` for aten.mm.default: the op without its namespace and overload."""
    parts = str(node.target).split(".")
    return parts[1] if node.op == "call_function" and len(parts) >= 2 and parts[0] == "aten" else ""


def _value_inputs(node: Any) -> list[Any]:
    """The nodes whose values `node` is computed from (not those it takes only the shape of)."""
    return [] if _op_name(node) in _SHAPE_ONLY else node.all_input_nodes


def _after_a_product(graph: Any, operands: list[Any]) -> bool:
    """Whether one of `operands` is computed from a product of a graph input: a
    kernel of the step that comes before any launch reading them (a product of
    constants alone may be folded away at compile time)."""
    from_inputs: set[Any] = set()
    for node in graph.nodes:  # in order: each node after the ones it reads
        if node.op == "placeholder" or any(source in from_inputs for source in _value_inputs(node)):
            from_inputs.add(node)
    seen: set[Any] = set()
    pending = [node for node in operands if hasattr(node, "op")]
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        if _op_name(node) in _PRODUCTS and node in from_inputs:
            return True
        pending.extend(_value_inputs(node))
    return False


class _Shared:
    """What the sites of one rewrite share: the rotation tables it adds to the
    module, one buffer for each distinct table (the layers of a decoder share
    theirs), and the proofs so far (the layers' rotations and positions)."""

    def __init__(self, graph_module: Any) -> None:
        self.graph_module = graph_module
        self.proven: dict[Any, Any] = {}
        self.steps: dict[tuple[Any, int], Any] = {}  # (a cache write's index, the cache's length) -> the graph input it stands for
        self._nodes: list[tuple[Any, Any]] = []

    def node(self, table: Any, device: Any) -> Any:
        """A get_attr node of the module's buffer holding `table` on `device`, added where none does yet."""
        import torch

        for held, node in self._nodes:
            if held.shape == table.shape and torch.equal(held, table) and getattr(self.graph_module, node.target).device == device:
                return node
        name = f"{TABLE_PREFIX}{len(self._nodes)}"
        while hasattr(self.graph_module, name):
            name += "_"
        self.graph_module.register_buffer(name, table.to(device).contiguous())
        graph = self.graph_module.graph
        with graph.inserting_before(next(iter(graph.nodes))):
            node = graph.get_attr(name)
        node.meta["val"] = getattr(self.graph_module, name)
        self._nodes.append((table, node))
        return node

    def added(self) -> tuple[tuple[str, Any], ...]:
        return tuple((node.target, getattr(self.graph_module, node.target)) for _, node in self._nodes)


def _cache_write(site: AttentionSite, shared: _Shared, written_elsewhere: frozenset[str] = frozenset()) -> CacheWrite | None:
    """The cache writes `site` reads the result of, where the fused kernel can
    make them instead: one query row; keys and values each a module buffer
    that index_copy_ writes at one integer index (the same for both) along
    the positions, from a tensor of one position; the index equal to a graph
    input at every position of the cache (compile/step_position.py: that
    input is the kernel's position); and nothing else in the graph reads or
    writes those buffers, or writes anything between the writes and the
    call (the kernel writes later than the graph did)."""
    writes = (site.key, site.value)
    if (static_shape(site.query) or (0, 0, 0))[2] != 1 or site.key is site.value:
        return None
    if not all(str(getattr(write, "target", "")) == _CACHE_WRITE and len(write.args) == 4 and not write.kwargs for write in writes):
        return None
    (key_cache, key_dim, index, key), (value_cache, value_dim, value_index, value) = (write.args for write in writes)
    if index is not value_index or key_dim not in (2, -2) or value_dim not in (2, -2):
        return None
    if key_cache.op != "get_attr" or value_cache.op != "get_attr" or key_cache is value_cache:
        return None
    for cache, new in ((key_cache, key), (value_cache, value)):
        shape, new_shape = static_shape(cache), static_shape(new)
        if shape is None or new_shape is None or len(shape) != 4 or new_shape != (shape[0], shape[1], 1, shape[3]) or dtype_name(new) != dtype_name(cache):
            return None
    if not all(_read_only_by(write, site) for write in writes) or _written_between(site.node, (*writes, *site.repeats)):
        return None
    length = (static_shape(key_cache) or (0, 0, 0))[2]
    if (index, length) not in shared.steps:
        shared.steps[index, length] = step_position(index, length, written_elsewhere)
    position = shared.steps[index, length]
    if position is None or _position_on_device(position, site.query) is None:
        return None
    memory = GraphMemory(site.node.graph)
    for cache, write in ((key_cache, writes[0]), (value_cache, writes[1])):
        allowed = {cache, write, site.node, *site.repeats}
        for node in site.node.graph.nodes:
            if node in allowed:
                continue
            # Another name for the cache's memory, or an op that reads it (its sum, a copy): something would
            # read or write it besides this step's write, which the kernel makes later than the graph did.
            if (memory.shared(node, cache) and not _unread_name(node)) or any(memory.shared(source, cache) for source in node.all_input_nodes):
                return None
        if not _apart_in_memory(module_tensor(site.node.graph.owning_module, str(cache.target))):
            return None  # one program's write could land where another reads
    return CacheWrite(key_cache, value_cache, key, value, position, writes)


def _unread_name(node: Any) -> bool:
    """A module tensor the graph names and never reads (Hugging Face's caches
    are registered buffers that the graph reads through another name)."""
    return node.op == "get_attr" and not node.users


def _apart_in_memory(tensor: Any) -> bool:
    """Whether no two elements of a tensor share memory (each dim, by stride,
    steps past everything the smaller strides reach): the kernel writes one
    position of a head while other programs read the others'."""
    if tensor is None:
        return False
    reach = 1
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1):
        if stride < reach:
            return False
        reach = stride * size
    return True


def _read_only_by(write: Any, site: AttentionSite) -> bool:
    """Whether the cache's write is read only by the attention call, directly or through its repeats."""
    pending, allowed = [write], {site.node, *site.repeats}
    while pending:
        for user in pending.pop().users:
            if user not in allowed:
                return False
            if user is not site.node:
                pending.append(user)
    return True


def _erase_dead(nodes: list[Any]) -> None:
    """Erase what computed `nodes` where nothing reads it any more (export's
    checks of a cast's result do not count), up through ops that write nothing."""
    pending, erased = list(nodes), set()
    while pending:
        node = pending.pop()
        if node in erased or node.op != "call_function" or not pure_op(node):
            continue
        if not all(str(user.target) == _METADATA_CHECK for user in node.users):
            continue
        for check in list(node.users):
            node.graph.erase_node(check)
        sources = node.all_input_nodes
        node.graph.erase_node(node)
        erased.add(node)
        pending.extend(sources)


def _position_on_device(position: Any, query: Any) -> Any:
    """The position, where it lives on the query's device (the kernel reads it there), else None."""
    if position is None or getattr(recorded_value(position), "device", None) != getattr(recorded_value(query), "device", None):
        return None
    return position


def _mask_target(site: AttentionSite) -> tuple[int, int, int, int]:
    """[B, H, L, S]: what the site's mask broadcasts to."""
    batch, heads, rows, _ = static_shape(site.query) or (0, 0, 0, 0)
    return batch, heads, rows, (static_shape(site.key) or (0, 0, 0))[2]


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

