"""What a decoder does around its products of one row, folded into the
matrix-vector kernel (matvec_kernel.matvec_fused), so that it costs no
kernel launch of its own.

On the 1B decoder the plain kernel read the weights faster than Inductor's
fused reductions, but the norms, activations and residuals those had fused
became small kernels of their own (261 kernels a step against 197), and the
step came out on par (docs/benchmarks.md). This module takes them back into the products:

- an RMS norm of the row, (x.float() * rsqrt(x.float().pow(2).mean(-1,
  keepdim=True) + eps)).to(dtype) * weight, as Llama-style models write it;
- SwiGLU: silu(row @ W0^T) * (row @ W1^T), two products of the same row;
- a residual added to a product's result (x + o_proj(...));
- up to three products of the same (normed) row in one launch (q, k, v).

Each is taken only where the graph computes exactly that (the same dtypes,
shapes and rounding steps) and the nodes it removes feed nothing else.
Products with a bias stay on the plain kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .graph_values import dtype_name, may_write, static_shape, value

_MAX_GROUP = 3  # weights one launch reads (the kernel's pointers)
_CASTS = frozenset({"aten.to.dtype", "aten._to_copy.default", "prims.convert_element_type.default"})


@dataclasses.dataclass(frozen=True)
class Norm:
    """An RMS norm of the row the products read: x, its weight, epsilon, and the
    graph's nodes that computed it (removed once nothing else reads them)."""

    x: Any
    weight: Any
    eps: float
    nodes: tuple[Any, ...]


@dataclasses.dataclass
class Unit:
    """One launch of the fused kernel: the products it computes (ProductSite,
    bias-free) and what it computes around them."""

    products: list[Any]
    norm: Norm | None = None
    gate: tuple[Any, Any] | None = None  # (silu node, mul node) of SwiGLU
    residual: tuple[Any, Any] | None = None  # (add node, the other operand)

    @property
    def replaced(self) -> list[Any]:
        """The nodes whose values the launch's outputs stand for, in output order."""
        if self.gate is not None:
            return [self.gate[1]]
        if self.residual is not None:
            return [self.residual[0]]
        return [site.node for site in self.products]


def rms_normed(x: Any, weight: Any, eps: float) -> Any:
    """The RMS norm the fusion takes, as the graphs it matches compute it."""
    import torch

    as_float = x.float()
    return (as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def reference(x: Any, weights: list[Any], norm_weight: Any, norm_eps: float, residual: Any, gated: bool) -> list[Any]:
    """What matvec_fused computes, in plain torch, rounding where the graphs it replaces round."""
    import torch

    row = x if norm_weight is None else rms_normed(x, norm_weight, norm_eps)
    products = [torch.nn.functional.linear(row, weight) for weight in weights]
    if gated:
        return [torch.nn.functional.silu(products[0]) * products[1]]
    if residual is not None:
        return [residual + products[0]]
    return products


def plan_units(sites: list[Any], order: dict[Any, int]) -> list[Unit]:
    """The launches for bias-free product sites (graph order): SwiGLU pairs and
    residuals first, then the rest grouped by the row they read. A launch
    reads all its operands at one place in the graph, where the graph read
    them at several: one whose span holds an op that writes in place (a cache's
    index_copy_, an add_) is taken apart into a launch per product, each reading
    its operands where its product did."""
    units: list[Unit] = []
    taken: set[Any] = set()  # products and the adds that residual launches took
    norms = {id(site): rms_norm_of(site.row) for site in sites}

    def key(site: Any) -> tuple[Any, ...]:
        norm = norms[id(site)]
        return (site.row,) if norm is None else (norm.x, norm.weight, norm.eps)

    for site in sites:
        pair = _swiglu_partner(site, sites, key)
        if pair is not None and site.node not in taken and pair[0].node not in taken:
            partner, silu, mul = pair
            units.append(Unit([site, partner], norms[id(site)], gate=(silu, mul)))
            taken.update((site.node, partner.node))
    for site in sites:
        if site.node in taken:
            continue
        residual = _residual_of(site)
        if residual is not None and residual[0] not in taken:  # p1(x) + p2(x): one of them takes the add
            units.append(Unit([site], norms[id(site)], residual=residual))
            taken.update((site.node, residual[0]))
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for site in sites:
        if site.node not in taken:
            groups.setdefault(key(site), []).append(site)
    for members in groups.values():
        while members:
            batch = _groupable(members, order)
            units.append(Unit(batch, norms[id(batch[0])]))
            members = [site for site in members if site not in batch]
    writes = sorted(order[node] for node in order if may_write(node))
    units = [piece for unit in units for piece in ([unit] if not _written_within(unit, order, writes) else _apart(unit))]
    return sorted(units, key=lambda unit: min(order[node] for node in unit.replaced))


def _written_within(unit: Unit, order: dict[Any, int], writes: list[int]) -> bool:
    """Whether an op that writes in place lies between the first and the last
    node of the graph the launch stands for (where the graph read its operands)."""
    nodes = [*unit.replaced, *(site.node for site in unit.products)]
    nodes += list(unit.norm.nodes) if unit.norm is not None else []
    nodes += [unit.gate[0]] if unit.gate is not None else []
    first, last = min(order[node] for node in nodes), max(order[node] for node in nodes)
    return any(first < position < last for position in writes)


def _apart(unit: Unit) -> list[Unit]:
    """A launch per product, each reading the row its product read."""
    return [Unit([site]) for site in unit.products]


def _groupable(members: list[Any], order: dict[Any, int]) -> list[Any]:
    """The first member and up to two more whose weights are the graph's own
    tensors (fetched before the first, or movable there: the launch goes where
    the first product was) of the first's dtype."""
    first = members[0]
    batch = [first]
    for site in members[1:]:
        if len(batch) == _MAX_GROUP:
            break
        weight = site.weight
        available = weight.op == "get_attr" or (weight.op == "placeholder" and order[weight] < order[first.node])
        if available and dtype_name(weight) == dtype_name(first.weight):
            batch.append(site)
    return batch


def emit(graph: Any, unit: Unit, operator: Any, replacements: dict[Any, Any], order: dict[Any, int], read_only: frozenset[str] = frozenset()) -> None:
    """Put one launch in the graph in place of the nodes it stands for, before
    the first of them (`order`: the graph's nodes' places before the rewrite).
    `replacements` maps nodes replaced earlier to what replaced them: a unit
    may read another's result (a product of a product). `read_only`: the
    module's tensors nothing writes (its parameters, its buffers that are never
    mutated); a launch whose weights are all among them may load them before
    the launch ahead of it has finished (matvec_kernel._await_inputs)."""
    import operator as python_operator

    def now(node: Any) -> Any:
        return replacements.get(node, node)

    first = unit.products[0]
    vector = now(unit.norm.x if unit.norm is not None else first.row)
    weights = [now(site.weight) for site in unit.products]
    norm_weight = now(unit.norm.weight) if unit.norm is not None else None
    residual = now(unit.residual[1]) if unit.residual is not None else None
    anchor = min(unit.replaced, key=order.__getitem__)
    for weight in weights:
        if weight.op == "get_attr" and order.get(weight, -1) > order[anchor]:
            anchor.prepend(weight)  # a grouped weight fetched later in the graph: a fetch reads nothing else
    eps = unit.norm.eps if unit.norm is not None else 0.0
    with graph.inserting_before(anchor):
        early = all(weight.op == "get_attr" and weight.target in read_only for weight in weights)
        launch = graph.call_function(operator, (vector, weights, norm_weight, eps, residual, unit.gate is not None, early))
        launch.meta["val"] = [value(node) for node in unit.replaced]
        for index, node in enumerate(unit.replaced):
            result = graph.call_function(python_operator.getitem, (launch, index))
            result.meta.update(node.meta)
            node.replace_all_uses_with(result)
            replacements[node] = result
    removed = [*unit.replaced, *([unit.gate[0]] if unit.gate is not None else []), *(site.node for site in unit.products)]
    for node in dict.fromkeys(removed):
        if not node.users:
            graph.erase_node(node)
    for site in unit.products:
        if site.transpose is not None and not site.transpose.users:
            graph.erase_node(site.transpose)


def remove_unread(graph: Any, nodes: set[Any], order: dict[Any, int]) -> None:
    """Erase those of `nodes` (the norms' computations) that nothing reads any
    more, last first; export's checks of a removed value's dtype go with it."""
    for node in sorted(nodes, key=order.__getitem__, reverse=True):
        checks = [user for user in node.users if _target(user) == "aten._assert_tensor_metadata.default"]
        if len(checks) < len(node.users):
            continue  # still read: it stays, and so do its checks
        for check in checks:
            graph.erase_node(check)
        graph.erase_node(node)


def rms_norm_of(row: Any) -> Norm | None:
    """The RMS norm `row` is the output of, where it is one exactly as the kernel
    computes it: (cast(cast(x, f32) * rsqrt(mean(cast(x, f32)^2, -1) + eps), dtype)) * weight,
    with x, weight and the row of one dtype and x a single row."""
    if _target(row) != "aten.mul.Tensor" or len(row.args) != 2 or row.kwargs:
        return None
    dtype = dtype_name(row)
    for normed, weight in (row.args, row.args[::-1]):
        shape = static_shape(row)
        if shape is None or static_shape(weight) != shape[-1:] or dtype_name(weight) != dtype:
            continue
        scaled = _uncast(normed, dtype)
        if scaled is None or _target(scaled) != "aten.mul.Tensor" or len(scaled.args) != 2 or scaled.kwargs:
            continue
        for as_float, root in (scaled.args, scaled.args[::-1]):
            found = _rsqrt_of_mean_square(root)
            if found is None:
                continue
            eps, squared_source, nodes = found
            x = _float_source(as_float)
            if x is None or x is not _float_source(squared_source) or dtype_name(x) != dtype:
                continue
            x_shape = static_shape(x)
            if x_shape != shape or any(size != 1 for size in x_shape[:-1]):
                continue
            casts = tuple(node for node in (as_float, squared_source, normed) if node is not x and node is not scaled)
            return Norm(x, weight, eps, (row, scaled, *nodes, *casts))
    return None


def _rsqrt_of_mean_square(node: Any) -> tuple[float, Any, tuple[Any, ...]] | None:
    """(eps, the fp32 tensor squared, the nodes) where node = rsqrt(mean(t^2, [-1], keepdim) + eps)."""
    if _target(node) != "aten.rsqrt.default":
        return None
    added = node.args[0]
    if _target(added) not in ("aten.add.Tensor", "aten.add.Scalar") or len(added.args) != 2 or added.kwargs:
        return None
    mean, eps = added.args
    if not isinstance(eps, float) or _target(mean) != "aten.mean.dim" or dtype_name(mean) != "torch.float32":
        return None
    squared, dims = mean.args[0], mean.args[1] if len(mean.args) > 1 else None
    rank = len(static_shape(squared) or ())
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not rank or not isinstance(dims, (list, tuple)) or list(dims) not in ([-1], [rank - 1]):
        return None  # a mean over all dims (None) or another one is not a norm of the row
    if keepdim is not True or set(mean.kwargs) - {"keepdim"}:
        return None
    is_square = (_target(squared) == "aten.pow.Tensor_Scalar" and squared.args[1] == 2) or (
        _target(squared) == "aten.mul.Tensor" and squared.args[0] is squared.args[1])
    if not is_square:
        return None
    return eps, squared.args[0], (node, added, mean, squared)


def _float_source(node: Any) -> Any:
    """x where node is x cast to fp32 (or x itself, already fp32)."""
    if dtype_name(node) != "torch.float32":
        return None
    return _uncast(node, "torch.float32", strict=False) or node


def _uncast(node: Any, dtype: str, strict: bool = True) -> Any:
    """What `node` casts to `dtype`; a node already of that dtype is its own
    source unless `strict` (then only a cast is undone)."""
    if _target(node) in _CASTS and dtype_name(node) == dtype and _plain_cast(node):
        return node.args[0]
    if strict and dtype_name(node) == dtype and _target(node) not in _CASTS:
        return node
    return None


def _plain_cast(node: Any) -> bool:
    """A cast that changes the dtype alone: not the device, nor the layout in memory."""
    import torch

    source = node.args[0]
    if getattr(value(node), "device", None) != getattr(value(source), "device", None):
        return False
    return node.kwargs.get("memory_format") in (None, torch.preserve_format) and node.kwargs.get("layout") in (None, torch.strided)


def _swiglu_partner(site: Any, sites: list[Any], key: Callable[[Any], tuple[Any, ...]]) -> tuple[Any, Any, Any] | None:
    """(up product, silu, mul) where site is the gate of silu(site) * up, both
    products of the same row and shape, read by nothing else."""
    users = list(site.node.users)
    if len(users) != 1 or _target(users[0]) != "aten.silu.default":
        return None
    silu = users[0]
    multiplied = list(silu.users)
    if len(multiplied) != 1 or _target(multiplied[0]) != "aten.mul.Tensor" or multiplied[0].kwargs:
        return None
    mul = multiplied[0]
    other = mul.args[1] if mul.args[0] is silu else mul.args[0]
    if other is silu:
        return None
    for partner in sites:
        if (partner.node is other and partner is not site and key(partner) == key(site) and list(other.users) == [mul]
                and static_shape(other) == static_shape(site.node) and dtype_name(other) == dtype_name(site.node)
                and static_shape(mul) == static_shape(site.node)):
            return partner, silu, mul
    return None


def _residual_of(site: Any) -> tuple[Any, Any] | None:
    """(add, the other operand) where the product's only reader is add(other, product)
    of the same shape and dtype."""
    users = list(site.node.users)
    if len(users) != 1 or _target(users[0]) != "aten.add.Tensor" or users[0].kwargs or len(users[0].args) != 2:
        return None
    add = users[0]
    other = add.args[1] if add.args[0] is site.node else add.args[0]
    if other is site.node or not hasattr(other, "op"):
        return None
    shape = static_shape(site.node)
    if static_shape(other) != shape or static_shape(add) != shape or not (dtype_name(other) == dtype_name(site.node) == dtype_name(add)):
        return None
    return add, other


def _target(node: Any) -> str:
    return str(getattr(node, "target", "")) if getattr(node, "op", None) == "call_function" else ""
