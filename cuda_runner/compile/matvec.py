"""Products of one row in standalone CUDA builds: each becomes cuda-runner's
own matrix-vector kernel (matvec_kernel.py) instead of what Inductor
generates for it.

A decode step multiplies a single row by every weight of the model, so its
speed is how fast those products stream the weights from memory. Inductor
lowers them either as a GEMM template built for tiles of many rows, or (with
the coordinate-descent tuning a decode method gets) as reductions fused with
their neighbours; on the H200 those read the 1B decoder's weights at about
2.3 TB/s of the 4.8 the memory gives. The kernel, with the norm, gate and
residual around the products folded into its launches (matvec_fusion.py),
reads them at 3.3 TB/s, and the step took 0.85 ms with a CUDA graph against
1.15-1.5 (docs/benchmarks.md). It is on by default; {"cuda_runner.matvec":
False} turns it off.

A product qualifies when the kernel computes exactly it: a Linear, or a
matrix product with a transposed weight (as a decomposed program writes a
Linear: mm or addmm of t(W)), whose input holds one row (every dim but the
last is 1), with static shapes, one floating dtype, and a weight whose rows
are contiguous. `x @ W.t()` written out (matmul of a row and a transposed
weight) is taken as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import matvec_fusion
from .graph_memory import GraphMemory
from .graph_values import one_floating_dtype, static_shape, strides, value

# The compile option that turns the rewrite off in a standalone CUDA build ({"cuda_runner.matvec": False}); on by default.
OPTION = "cuda_runner.matvec"
_TRANSPOSES = frozenset({"aten.t.default", "aten.transpose.int", "aten.permute.default", "aten.numpy_T.default"})


@dataclass(frozen=True)
class ProductSite:
    """A product of one row the kernel takes over, with what the kernel reads."""

    node: Any
    row: Any  # [..., K], every leading dim 1
    weight: Any  # [N, K], each row contiguous
    bias: Any  # [N], or None
    transpose: Any  # the t(W) an mm read W through, dropped once unused; or None


def single_row_products(graph: Any) -> list[ProductSite]:
    """The products of an FX graph that the kernel computes exactly."""
    return [site for site in map(_site, graph.nodes) if site is not None]


@dataclass
class MatvecUse:
    """What the rewrite did: products taken, launches they became (several
    products share one, with the norm, gate or residual around them), and how
    many of each fusion (compile/matvec_fusion.py)."""

    products: int = 0
    launches: int = 0
    norms: int = 0
    gated: int = 0
    residuals: int = 0


def use_matvec(graph_module: Any, operator: Any = None, fused_operator: Any = None, written_elsewhere: frozenset[str] = frozenset()) -> MatvecUse:
    """Replace the qualifying products of `graph_module` (a copy the caller owns)
    by the kernel, with what surrounds them folded in where it can be
    (`operator`, `fused_operator`: cuda_runner::matvec and ::matvec_fused, or
    operators of the same schemas). A launch whose weights no op writes
    (read_only_tensors) may fetch them early (matvec_kernel.waits_for_inputs)."""
    graph = graph_module.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    # A tensor another method writes is not fetched early either: the launch
    # before this method's first may be that method's last.
    read_only = read_only_tensors(graph) - written_elsewhere
    sites = single_row_products(graph)
    if not sites:
        return MatvecUse()
    if operator is None or fused_operator is None:
        import torch

        from . import matvec_kernel  # noqa: F401  (registers the operators)

        operator = operator or torch.ops.cuda_runner.matvec.default
        fused_operator = fused_operator or torch.ops.cuda_runner.matvec_fused.default
    units = matvec_fusion.plan_units([site for site in sites if site.bias is None], order)
    launches: list[tuple[int, Any]] = [(order[site.node], site) for site in sites if site.bias is not None]
    launches += [(min(order[node] for node in unit.replaced), unit) for unit in units]
    replacements: dict[Any, Any] = {}
    used = MatvecUse(products=len(sites), launches=len(launches))
    # In graph order: a launch reading another's result (a product of a product) comes after it.
    for _, launch in sorted(launches, key=lambda pair: pair[0]):
        if isinstance(launch, ProductSite):
            _replace_plain(graph, launch, operator, replacements)
            continue
        matvec_fusion.emit(graph, launch, fused_operator, replacements, order, read_only)
        used.norms += launch.norm is not None
        used.gated += launch.gate is not None
        used.residuals += launch.residual is not None
    matvec_fusion.remove_unread(graph, {node for unit in units if unit.norm is not None for node in unit.norm.nodes}, order)
    graph.lint()
    graph_module.recompile()
    return used


def read_only_tensors(graph: Any) -> frozenset[str]:
    """The names of the module tensors (get_attr) whose memory no op of `graph`
    writes (graph_memory.GraphMemory, through any view or second name): the
    weights, not a KV cache written in place."""
    memory = GraphMemory(graph)
    return frozenset(node.target for node in graph.nodes if node.op == "get_attr" and not memory.written(node))


def written_tensors(graph: Any) -> frozenset[str]:
    """The names of the module tensors (get_attr) that an op of `graph` may
    write: every one not read-only (read_only_tensors), a KV cache."""
    return frozenset(node.target for node in graph.nodes if node.op == "get_attr") - read_only_tensors(graph)


def _replace_plain(graph: Any, site: ProductSite, operator: Any, replacements: dict[Any, Any]) -> None:
    """One product with a bias on the plain kernel (it reads the operands as they are now)."""
    def now(node: Any) -> Any:
        return replacements.get(node, node)

    node = site.node
    with graph.inserting_before(node):
        product = graph.call_function(operator, (now(site.row), now(site.weight), _flat(graph, now(site.bias))))
    # [..., N] from a row [..., K]: the shape of the Linear (or mm's [1, N]) it replaces.
    product.meta.update(node.meta)
    node.replace_all_uses_with(product)
    replacements[node] = product
    graph.erase_node(node)
    if site.transpose is not None and not site.transpose.users:
        graph.erase_node(site.transpose)


def _flat(graph: Any, bias: Any) -> Any:
    """addmm's bias [1, N] viewed as the [N] the kernel reads (inserted where the graph inserts now)."""
    if bias is None or len(static_shape(bias) or ()) != 2:
        return bias
    import torch

    flat = graph.call_function(torch.ops.aten.view.default, (bias, [-1]))
    flat.meta["val"] = value(bias).view(-1)  # what export would have recorded, for passes after this one
    return flat


def _site(node: Any) -> ProductSite | None:
    if node.op != "call_function":
        return None
    target = str(node.target)
    if target == "aten.linear.default" and not node.kwargs:
        row, weight, bias = (*node.args, None)[:3]
        transpose = None
    elif target in ("aten.mm.default", "aten.matmul.default") and not node.kwargs and len(node.args) == 2:
        row, bias = node.args[0], None
        weight, transpose = _untransposed(node.args[1])
    elif target == "aten.addmm.default" and not node.kwargs and len(node.args) == 3:
        bias, row = node.args[0], node.args[1]
        weight, transpose = _untransposed(node.args[2])
    else:
        return None
    if weight is None or not one_floating_dtype(row, weight, *([bias] if bias is not None else [])):
        return None
    row_shape, weight_shape = static_shape(row), static_shape(weight)
    if row_shape is None or weight_shape is None or len(weight_shape) != 2 or not row_shape:
        return None
    rows_n, columns_k = weight_shape
    if rows_n == 0 or columns_k == 0 or row_shape[-1] != columns_k or any(size != 1 for size in row_shape[:-1]):
        return None
    if strides(weight)[1:] != (1,):  # each row of W contiguous
        return None
    if bias is not None and static_shape(bias) not in ((rows_n,), (1, rows_n)):
        return None
    return ProductSite(node, row, weight, bias, transpose)


def _untransposed(operand: Any) -> tuple[Any, Any]:
    """(W, the transpose) where `operand` is W [N, K] transposed to [K, N]; (None, None) otherwise."""
    target = str(getattr(operand, "target", ""))
    if target not in _TRANSPOSES:
        return None, None
    source = operand.args[0]
    if len(static_shape(source) or ()) != 2:
        return None, None
    if target == "aten.transpose.int" and sorted(d % 2 for d in operand.args[1:3]) != [0, 1]:
        return None, None
    if target == "aten.permute.default" and [d % 2 for d in operand.args[1]] != [1, 0]:
        return None, None
    return source, operand
