"""Masks that only say "up to the step's position": the fused decode attention
(compile/attention.py) takes the position instead of the mask, reads no key
past it, and no kernel a layer computes the mask.

A decoder with a KV cache masks a decode step's scores by where it is: the
query at position p sees cache positions 0..p. Models write that in many ways
(a comparison with an arange, a row of a causal buffer picked by the position,
an additive mask of -inf or the dtype's lowest value), so the mask is not
matched by its ops. It is proven by its values instead: a mask computed from
one input, a single integer position, and otherwise from constants, is
evaluated at every position the cache has, and is taken only if each one
allows exactly the positions up to it. Nothing it is computed from may be
written by an op of the graph: a mask kept in a buffer the step updates
would be proven on its compile-time contents, and one changed in place
through another view of its memory on values the step does not use.
"""

from __future__ import annotations

from typing import Any

from .evaluation import on_cpu
from .graph_memory import computed_alone, reads_written_elsewhere
from .graph_values import one_integer, static_elements, static_shape
from .graph_values import value as recorded_value

# The longest cache whose mask is proven position by position (each one a run of
# the mask's few ops): a longer one keeps its mask.
MAX_PROVEN_POSITIONS = 8192


def position_limit(mask: Any, target: tuple[int, int, int, int], written_elsewhere: frozenset[str] = frozenset()) -> Any | None:
    """The graph input p such that `mask`, broadcast to `target` ([B, H, 1, S]),
    allows exactly the positions 0..p for every p in [0, S); None where that is
    not so or cannot be shown. `written_elsewhere` names the module tensors
    that other methods of the bundle write: the methods share them (a mask
    buffer a prefill fills would be proven on its compile-time contents)."""
    _, _, rows, length = target
    if rows != 1 or length > MAX_PROVEN_POSITIONS or static_shape(mask) is None:
        return None
    ancestors = computed_alone(mask)  # nothing the step writes: a mask kept in a buffer it updates, or changed in place through a view
    if ancestors is None:
        return None
    inputs = [node for node in ancestors if node.op == "placeholder"]
    if len(inputs) != 1 or not one_integer(inputs[0]) or not all(_small(node, length) for node in ancestors):
        return None
    position = inputs[0]
    if reads_written_elsewhere(ancestors, written_elsewhere):
        return None
    try:
        return position if _allows_up_to_position(mask, ancestors, position, target) else None
    except Exception:  # a mask that does not evaluate on its own keeps its mask
        return None


def _small(node: Any, length: int) -> bool:
    """An op whose value has at most a few times the cache's positions: each is
    computed again at every position the proof evaluates (a [S, S] causal
    matrix built in the step would take minutes at S = 4096). Inputs and
    module tensors cost nothing there."""
    if node.op != "call_function":
        return True
    elements = static_elements(node)
    return elements is not None and elements <= 4 * length + 64


def _allows_up_to_position(mask: Any, ancestors: list[Any], position: Any, target: tuple[int, ...]) -> bool:
    import torch

    evaluate = on_cpu(mask, [position], ancestors)  # a table indexed past its end fails here, not on the device
    example = recorded_value(position)
    positions = torch.arange(target[-1])
    with torch.no_grad():
        for step in range(target[-1]):
            given = torch.full(tuple(example.shape), step, dtype=example.dtype)
            if not _allows_exactly(evaluate(given).expand(target), positions <= step):
                return False
    return True


def _allows_exactly(values: Any, allowed: Any) -> bool:
    """Whether a bool mask keeps just the allowed positions, or an additive one
    adds 0 to them and, to every other, -inf or, but for float16, its dtype's
    lowest value (which leaves exp() of the score 0, as -inf does, while some
    position is allowed)."""
    import torch

    if values.dtype == torch.bool:
        return bool(torch.equal(values, allowed.expand_as(values)))
    if not values.dtype.is_floating_point:
        return False
    kept = values == 0
    dropped = values == float("-inf")
    if torch.finfo(values.dtype).max > 1e38:
        # float32's, bfloat16's or float64's lowest: no score comes near it. float16's (-65504)
        # is not taken: a masked score over 65504 above the kept ones would win in eager.
        dropped |= values == torch.finfo(values.dtype).min
    return bool(torch.equal(kept, allowed.expand_as(values)) and torch.equal(dropped, ~allowed.expand_as(values)))
