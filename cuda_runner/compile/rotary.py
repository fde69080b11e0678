"""Rotary position embeddings (RoPE) the fused decode attention can apply
itself (compile/attention.py): a query or key that is a rotation of another
tensor by the step's position.

Models write RoPE in several forms: pairs of neighbouring elements (Meta's
Llama, ExecuTorch's exports), or the two halves of each head (Hugging Face's
rotate_half), with cos and sin read from a table, computed from the position
each step, in float32 or in the model's dtype. So the ops are not matched. The
rotation is proven by its values instead, as position masks are
(compile/position_mask.py): a value computed from one tensor X and otherwise
only from the position (a single integer) and constants is evaluated at every
position the cache has, and is taken only where, at each position p,

    result[..., d] = X[..., d] * cos[p, d] + X[..., partner(d)] * sin[p, d]

with partner(d) = d ^ 1 (neighbours) or (d + D/2) mod D (halves), and cos and
sin the same for every head and batch element. The ops on X's side are
evaluated in float64, so that the coefficients come out as the model's
position side computed them (float32, or bfloat16 where the model rounds its
cos and sin first), with no rounding of X's side in the way; the kernel then
computes the rotation in float32 and rounds once to the result's dtype.

Values cannot show that a map is linear everywhere (a clamp beyond the
probes' range looks like the identity), so X's side may hold only ops that
are: products and sums with the position side, negation, casts that lose
nothing of X's dtype, and ops that move elements. The proof runs on the CPU,
on copies of the tables it reads: an index past a table there is an error
that rules the rotation out, where on the GPU it would end the process's use
of the device.
"""

from __future__ import annotations

import operator as python_operator
from dataclasses import dataclass
from typing import Any

from .evaluation import on_cpu
from .graph_memory import GraphMemory, computed_alone, reads_written_elsewhere
from .graph_values import FLOATING_DTYPES, dtype_name, pure_op, static_elements, static_shape
from .graph_values import value as recorded_value

# How the kernel pairs the elements of a head (its PAIRS constant): none (no rotation), neighbours, halves.
NO_ROTATION, NEIGHBOURS, HALVES = 0, 1, 2
# The longest cache whose rotation is proven position by position (as masks are).
MAX_PROVEN_POSITIONS = 8192
# Two random probes per position, the second far larger: a map that is not linear in X fails one.
_PROBE_SCALES = (1.0, 1000.0)
# The most elements the position side's ops may compute, all together (each is computed at every position proven).
_MAX_POSITION_SIDE_ELEMENTS = 1 << 16
# The ops X's side may hold (by ATen name): linear in X for any values, given
# that a product has X on one side only and a quotient does not divide by it (_linear_op).
_LINEAR_OPS = frozenset({
    "aten::mul", "aten::add", "aten::sub", "aten::neg", "aten::div",  # with the position side or constants
    "aten::to", "aten::_to_copy", "aten::type_as", "aten::clone", "aten::contiguous", "aten::alias",  # casts (widening: _precise_enough)
    "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::flatten", "aten::unflatten", "aten::transpose", "aten::permute",
    "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::slice", "aten::select", "aten::narrow", "aten::cat", "aten::stack",
    "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::roll", "aten::flip",
})
# How far X's side, evaluated in float64, may stray from the formula (relative to the terms' size).
_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Rotation:
    """`result` (a node) as a rotation of `source` by the position: the tables
    hold, for each cache position (rows) and element of a head (columns), the
    coefficients of X[d] (cos) and X[partner(d)] (sin, with its sign)."""

    source: Any
    pairs: int  # NEIGHBOURS or HALVES
    cos: Any  # torch.Tensor [positions, head dim], float32
    sin: Any


def rotation(result: Any, position: Any, positions: int, written_elsewhere: frozenset[str] = frozenset(),
             proven: dict[Any, _Proven | None] | None = None) -> Rotation | None:
    """`result` ([B, H, 1, D]) as a rotation of one of the tensors it is computed
    from by `position` (a graph input of one integer), proven at positions
    0..`positions`-1; None where none is. The earliest such tensor is taken (the
    projection's view, not a cast of it). `proven` caches proofs by the
    structure of what was evaluated: the layers of a decoder rotate alike."""
    shape = static_shape(result)
    if shape is None or len(shape) != 4 or shape[3] % 2 or positions > MAX_PROVEN_POSITIONS or dtype_name(result) not in FLOATING_DTYPES:
        return None
    position_side = _PositionSide(position)
    memory: GraphMemory | None = None
    for source in _candidates(result, shape, position_side):
        between = _computed_between(result, source, position_side)
        if between is None:
            continue
        memory = memory or GraphMemory(result.graph)
        position_nodes = position_side.ancestors(between)
        computed = [static_elements(node) for node in position_nodes if node.op == "call_function"]
        if None in computed or sum(count or 0 for count in computed) > _MAX_POSITION_SIDE_ELEMENTS:
            continue  # computed again at every position proven: a table built each step over every position would take minutes
        if any(memory.written(node) for node in (source, *between)) or not _read_as_computed(between, position_side):
            continue  # a value changed in place: the proof would run on what the step does not use
        if reads_written_elsewhere(position_nodes, written_elsewhere):
            continue  # a table another method fills is not what it was at compile time
        key = (positions, _structure(result, source, between, position_side))
        if proven is not None and key in proven:
            found = proven[key]
        else:
            try:
                found = _proof(result, source, between, position_side, positions)
            except Exception:  # a value that does not evaluate on its own is not taken
                found = None
            if proven is not None:
                proven[key] = found
        if found is not None:
            return Rotation(source, found.pairs, found.cos, found.sin)
    return None


class _PositionSide:
    """Which nodes are computed from the position and constants alone, as far
    as their ops say (ops that write nothing, and copies into a module
    tensor: Hugging Face's position counter; whether a write elsewhere
    changes what they read is graph_memory.computed_alone's to say), and the
    graph's order."""

    def __init__(self, position: Any) -> None:
        self.position = position
        self.order: dict[Any, int] = {}
        self._holds: set[Any] = set()
        for index, node in enumerate(position.graph.nodes):  # inputs come first: one pass decides every node
            self.order[node] = index
            if node is position or node.op == "get_attr" or (
                    (pure_op(node) or _copy_into_module_tensor(node)) and all(source in self._holds for source in node.all_input_nodes)):
                self._holds.add(node)

    def holds(self, node: Any) -> bool:
        return node in self._holds

    def ancestors(self, between: list[Any]) -> list[Any]:
        """The position-side nodes the nodes `between` read, and what those are computed from, in graph order."""
        seen: set[Any] = set()
        pending = [source for node in between for source in node.all_input_nodes if self.holds(source)]
        while pending:
            node = pending.pop()
            if node not in seen:
                seen.add(node)
                pending.extend(node.all_input_nodes)
        return sorted(seen, key=self.order.__getitem__)


def _copy_into_module_tensor(node: Any) -> bool:
    return node.op == "call_function" and str(node.target) == "aten.copy_.default" and getattr(node.args[0], "op", None) == "get_attr"


def _read_as_computed(between: list[Any], position_side: _PositionSide) -> bool:
    """Whether each position-side value the rotation reads is, as it reads
    it, computed from the position and constants alone (no write of the step
    or an earlier one changes it: graph_memory.computed_alone)."""
    read = {source for node in between for source in node.all_input_nodes if position_side.holds(source)}
    for node in read:
        computed_from = computed_alone(node)
        if computed_from is None or any(other.op == "placeholder" and other is not position_side.position for other in computed_from):
            return False
    return True


def _candidates(result: Any, shape: tuple[int, ...], position_side: _PositionSide) -> list[Any]:
    """Tensors `result` is computed from that have its shape and a floating
    dtype of its own, earliest first (not `result` itself: that is no rotation)."""
    seen = {result}
    pending = [result]
    while pending:
        for source in pending.pop().all_input_nodes:
            if source not in seen and not position_side.holds(source):
                seen.add(source)
                pending.append(source)
    return [node for node in result.graph.nodes
            if node in seen and node is not result and static_shape(node) == shape and dtype_name(node) == dtype_name(result)]


def _computed_between(result: Any, source: Any, position_side: _PositionSide) -> list[Any] | None:
    """The ops that compute `result` from `source` and the position side, in
    graph order; None where it reads anything else (another input, an op that
    writes or draws random numbers, a call without a schema)."""
    seen = {result}
    pending = [result]
    earliest = position_side.order[source]
    while pending:
        node = pending.pop()
        # Each op between is computed from X (else from another input): none comes before it.
        if not _linear_op(node, position_side) or position_side.order[node] < earliest:
            return None
        for source_node in node.all_input_nodes:
            if source_node is source or position_side.holds(source_node) or source_node in seen:
                continue
            seen.add(source_node)
            pending.append(source_node)
    between = sorted(seen, key=position_side.order.__getitem__)
    return between if all(_precise_enough(node, source) for node in between) else None


def _linear_op(node: Any, position_side: _PositionSide) -> bool:
    """An op of _LINEAR_OPS (or the pick of one piece of a split), with X on
    one side only of a product or quotient."""
    if node.op != "call_function":
        return False
    if node.target is python_operator.getitem:
        return True
    if not pure_op(node) or node.target._schema.name not in _LINEAR_OPS:
        return False
    name = node.target._schema.name
    if name == "aten::mul":  # X times X is not linear
        return sum(1 for operand in node.args if hasattr(operand, "op") and not position_side.holds(operand)) <= 1
    if name == "aten::div":  # nor anything divided by X, nor a quotient rounded to an integer (Tensor_mode)
        return node.target._overloadname in ("Tensor", "Scalar") and all(
            position_side.holds(operand) for operand in node.args[1:] if hasattr(operand, "op"))
    return True


def _precise_enough(node: Any, source: Any) -> bool:
    """Whether an op of X's side computes in a dtype that loses nothing of X's
    (as fine a step and as wide a range): a round trip through float8 or
    float16 would otherwise be proven away in float64, and the kernel would
    skip the rounding the model does."""
    import torch

    computed, given = getattr(recorded_value(node), "dtype", None), getattr(recorded_value(source), "dtype", None)
    if not isinstance(computed, torch.dtype) or not isinstance(given, torch.dtype):
        return node.target is python_operator.getitem  # a piece of a split, typed by the split
    if not computed.is_floating_point or not given.is_floating_point:
        return False
    fine, coarse = torch.finfo(computed), torch.finfo(given)
    return fine.eps <= coarse.eps and fine.max >= coarse.max


def _structure(result: Any, source: Any, between: list[Any], position_side: _PositionSide) -> tuple[Any, ...]:
    """What the proof evaluates, with the nodes of X's side named by their
    place: two layers' rotations have one structure where they read the same
    position-side nodes through the same ops."""
    places: dict[Any, Any] = {source: ("source",), **{node: ("op", index) for index, node in enumerate(between)}}

    def named(argument: Any) -> Any:
        if isinstance(argument, (list, tuple)):
            return tuple(named(item) for item in argument)
        if hasattr(argument, "op") and hasattr(argument, "graph"):
            if argument not in places:  # the position side by what it computes: layers that compute their own tables alike share a proof
                places[argument] = ("position side", argument.op, str(argument.target), named(argument.args),
                                    tuple(sorted((key, named(value)) for key, value in argument.kwargs.items())))
            return places[argument]
        return repr(argument)

    ops = tuple((str(node.target), named(node.args), tuple(sorted((key, named(value)) for key, value in node.kwargs.items())))
                for node in between)
    return (static_shape(source), dtype_name(source), static_shape(result), dtype_name(result), ops)


@dataclass(frozen=True)
class _Proven:
    pairs: int
    cos: Any
    sin: Any


def _proof(result: Any, source: Any, between: list[Any], position_side: _PositionSide, positions: int) -> _Proven | None:
    import torch

    evaluate = _evaluator(result, source, between, position_side)
    as_the_model = _evaluator(result, source, between, position_side, in_float64=False)
    dtype = recorded_value(source).dtype
    shape = static_shape(result) or ()
    head_dim = shape[3]
    example = recorded_value(position_side.position)
    generator = torch.Generator().manual_seed(0)
    for pairs in (NEIGHBOURS, HALVES):
        first = _first_of_pairs(pairs, head_dim)
        partner = _partners(pairs, head_dim)
        probe = first.to(torch.float64).expand(shape)
        cos = torch.empty(positions, head_dim, dtype=torch.float64)
        sin = torch.empty(positions, head_dim, dtype=torch.float64)
        with torch.no_grad():
            for step in range(positions):
                given = torch.full(tuple(example.shape), step, dtype=example.dtype)
                on_first, on_second = evaluate(probe, given), evaluate(1.0 - probe, given)
                step_cos = torch.where(first, on_first, on_second).reshape(-1, head_dim)
                step_sin = torch.where(first, on_second, on_first).reshape(-1, head_dim)
                if not (torch.equal(step_cos, step_cos[:1].expand_as(step_cos)) and torch.equal(step_sin, step_sin[:1].expand_as(step_sin))):
                    break  # not the same for every head: no rotation the kernel computes
                cos[step], sin[step] = step_cos[0], step_sin[0]
                if not all(_agrees(evaluate, given, cos[step], sin[step], partner, shape, scale, generator) for scale in _PROBE_SCALES):
                    break
                if not all(_rounds_alike(as_the_model, given, cos[step], sin[step], partner, shape, dtype, scale, generator)
                           for scale in _PROBE_SCALES):
                    break
            else:
                if not sin.any():
                    return None  # a scale (a cast, say), not a rotation: the model's ops before it stay anyway
                return _Proven(pairs, cos.to(torch.float32), sin.to(torch.float32))
    return None


def _rounds_alike(evaluate: Any, given: Any, cos: Any, sin: Any, partner: Any, shape: tuple[int, ...], dtype: Any, scale: float,
                  generator: Any) -> bool:
    """Whether a random X in the model's dtype, rotated by the graph as the
    model computes it, is within a step or two of that dtype of what the
    kernel computes (float32, rounded once): a model that rounds each product
    in bfloat16 is, one whose scaling on X's side underflows or overflows
    in float16 is not."""
    import torch

    probe = (torch.randn(shape, dtype=torch.float64, generator=generator) * scale).to(dtype)
    rotated = evaluate(probe, given).to(torch.float64)
    wide = probe.to(torch.float32)
    expected = (wide * cos.to(torch.float32) + wide[..., partner] * sin.to(torch.float32)).to(dtype).to(torch.float64)
    size = wide.abs().to(torch.float64) * cos.abs() + wide[..., partner].abs().to(torch.float64) * sin.abs()
    step = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return rotated.shape == expected.shape and bool(((rotated - expected).abs() <= 2 * step * size + torch.finfo(dtype).tiny).all())


def _agrees(evaluate: Any, given: Any, cos: Any, sin: Any, partner: Any, shape: tuple[int, ...], scale: float, generator: Any) -> bool:
    """Whether a random X, rotated by the graph, is what the formula gives."""
    import torch

    probe = torch.randn(shape, dtype=torch.float64, generator=generator) * scale
    rotated = evaluate(probe, given).to(torch.float64)
    expected = probe * cos + probe[..., partner] * sin
    size = probe.abs() * cos.abs() + probe[..., partner].abs() * sin.abs()
    return rotated.shape == expected.shape and bool(((rotated - expected).abs() <= _TOLERANCE * size + 1e-300).all())


def _first_of_pairs(pairs: int, head_dim: int) -> Any:
    """Which elements of a head come first in their pair (even ones, or the first half)."""
    import torch

    dims = torch.arange(head_dim)
    return dims % 2 == 0 if pairs == NEIGHBOURS else dims < head_dim // 2


def _partners(pairs: int, head_dim: int) -> Any:
    import torch

    dims = torch.arange(head_dim)
    return dims ^ 1 if pairs == NEIGHBOURS else (dims + head_dim // 2) % head_dim


def _evaluator(result: Any, source: Any, between: list[Any], position_side: _PositionSide, in_float64: bool = True) -> Any:
    """The graph from (X, position) to `result`, on the CPU, X's side computed in float64 (or as the model computes it)."""
    nodes = [*position_side.ancestors(between), *between]
    return on_cpu(result, [source, position_side.position], nodes, in_float64=frozenset(between) if in_float64 else frozenset())
