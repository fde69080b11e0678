"""The step's position, as a decode graph computes it: which graph input the
index a cache is written at stands for (compile/attention.py passes that input
to the fused kernel, and proves rotations by it).

Hugging Face's exports do not write the cache at their `cache_position`
input itself: each layer copies its first element into a counter of its
own (a module tensor, which it then increments) and adds an arange to it.
The index is taken where the copy leaves it a function of the input alone
(graph_memory.computed_alone) and it equals the input at every position of
the cache, by evaluation.
"""

from __future__ import annotations

from typing import Any

from .evaluation import on_cpu
from .graph_memory import computed_alone, reads_written_elsewhere
from .graph_values import ancestors_of, dtype_name, one_integer, static_shape
from .graph_values import value as recorded_value

_INTEGER_DTYPES = ("torch.int32", "torch.int64")
# Far values a position's dtype may hold: an index cast through int32 wraps there, one offset past some limit changes.
_FAR = (1003, 65539, 2**31 + 3, 2**32 + 3, -(2**31) - 3)


def step_position(index: Any, positions: int, written_elsewhere: frozenset[str] = frozenset()) -> Any | None:
    """The graph input of one integer that `index` (one integer) equals at
    every position 0..`positions`-1: `index` itself where it is one;
    None where there is no such input or that cannot be shown.
    `written_elsewhere`: module tensors other methods write (an offset
    another method sets is not what it was at compile time)."""
    if not one_integer(index):
        return None
    if index.op == "placeholder":
        return index
    ancestors = computed_alone(index)
    if ancestors is None:
        return None
    inputs = [node for node in ancestors if node.op == "placeholder"]
    if len(inputs) != 1 or not one_integer(inputs[0]) or reads_written_elsewhere(ancestors, written_elsewhere):
        return None
    try:
        return inputs[0] if _equal_at_every_position(index, inputs[0], ancestors, positions) else None
    except Exception:  # an index that does not evaluate on its own is not taken
        return None


def _equal_at_every_position(index: Any, given: Any, ancestors: list[Any], positions: int) -> bool:
    """Whether the index is the input at every position of the cache, and at
    a few past either end too: an index that wraps or clamps there (a ring
    buffer) writes where the kernel, which takes a position past the cache
    for one eager's index_copy_ would refuse, writes nothing."""
    import torch

    evaluate = on_cpu(index, [given], ancestors)
    example = recorded_value(given)
    # And far past them, where the dtype holds it: an index cast through int32 wraps there, one offset past some limit changes.
    largest = torch.iinfo(example.dtype).max
    beyond = (-1, positions, positions + 1, 2 * positions + 3, *(far for far in (*_FAR, largest - 3) if abs(far) <= largest))
    with torch.no_grad():
        for step in (*range(positions), *beyond):
            if int(evaluate(torch.full(tuple(example.shape), step, dtype=example.dtype)).reshape(-1)[0]) != step:
                return False
    return True


def counted_from(index: Any, positions: int, written_elsewhere: frozenset[str] = frozenset()) -> Any | None:
    """The graph input, of one dimension, that `index` counts up from:
    `index` is `arange(n) + start` (in either order), where n is the input's
    length (its own size, or another input's that export made the same
    symbol) and `start` is computed from the input's first element alone
    (`input[0]`; Hugging Face's prefill copies it into a counter first) and
    equals it at every position 0..`positions`-1 and a few past either end
    (by evaluation, as step_position proves a decode step's index). The
    positions written are then first .. first + n - 1, which eager's
    index_copy_ takes only within 0..`positions`-1 (a start that differs from
    the first element only at a value not evaluated makes the span refuse
    more than eager, never less). None where the index is not so, or that
    cannot be shown."""
    if index.op != "call_function" or str(index.target) != "aten.add.Tensor" or len(index.args) != 2 or index.kwargs:
        return None
    if dtype_name(index) != "torch.int64":  # the only index dtype eager's index_copy_ takes
        return None
    ancestors = computed_alone(index)
    if ancestors is None or reads_written_elsewhere(ancestors, written_elsewhere):
        return None
    for counted, start in (index.args, index.args[::-1]):
        length = _arange_length(counted)
        found = _from_first_element(start) if length is not None else None
        if found is None:
            continue
        given, firsts = found
        if not _same_size(length, recorded_value(given).shape[0]):
            return None
        try:
            return given if _start_is_first(start, given, firsts, positions) else None
        except Exception:  # a start that does not evaluate on its own is not taken
            return None
    return None


def _arange_length(node: Any) -> Any | None:
    """n, where `node` is arange(n) (from 0, by 1) of int32 or int64, which
    count to any n a cache has (an int8 or int16 one wraps): the size export
    recorded (an int, or a symbol); else None."""
    if getattr(node, "op", None) != "call_function" or set(node.kwargs) - {"dtype", "layout", "device", "pin_memory"}:
        return None
    if dtype_name(node) not in _INTEGER_DTYPES:
        return None
    target, arguments = str(node.target), node.args
    if target == "aten.arange.start_step" and len(arguments) == 3 and arguments[2] == 1:
        arguments = arguments[:2]
        target = "aten.arange.start"
    if target == "aten.arange.start" and len(arguments) == 2 and arguments[0] == 0 and not hasattr(arguments[0], "op"):
        arguments = arguments[1:]
        target = "aten.arange.default"
    if target != "aten.arange.default" or len(arguments) != 1:
        return None
    end = arguments[0]
    return recorded_value(end) if hasattr(end, "op") else end if isinstance(end, int) else None


def _from_first_element(start: Any) -> tuple[Any, list[Any]] | None:
    """(the input, the `input[0]` nodes) where `start`, one integer, reads one
    input of one dimension and only through `input[0]` (not its length, nor
    any other element, nor another input); else None."""
    if dtype_name(start) not in _INTEGER_DTYPES or static_shape(start) not in ((), (1,)):
        return None
    computed_from = ancestors_of(start)
    inputs = [node for node in computed_from if node.op == "placeholder"]
    if len(inputs) != 1 or dtype_name(inputs[0]) not in _INTEGER_DTYPES or len(getattr(recorded_value(inputs[0]), "shape", ())) != 1:
        return None
    readers = [user for user in inputs[0].users if user in computed_from]
    if not readers or any(str(reader.target) != "aten.select.int" or tuple(reader.args[1:]) != (0, 0) or reader.kwargs for reader in readers):
        return None
    return inputs[0], readers


def _start_is_first(start: Any, given: Any, firsts: list[Any], positions: int) -> bool:
    """Whether `start`, computed from the input's first element alone (the
    `firsts` nodes), is that element at every position of the cache and a
    few past either end, where an index that wraps or clamps would write
    where eager writes and the span refuses."""
    import torch

    nodes = [node for node in ancestors_of(start) if node is not given]
    evaluate = on_cpu(start, firsts, nodes)
    dtype = recorded_value(given).dtype
    largest = torch.iinfo(dtype).max
    beyond = (-1, positions, positions + 1, 2 * positions + 3, *(far for far in (*_FAR, largest - 3) if abs(far) <= largest))
    with torch.no_grad():
        for first in (*range(positions), *beyond):
            value = evaluate(*[torch.tensor(first, dtype=dtype)] * len(firsts))
            if value.numel() != 1 or int(value.reshape(-1)[0]) != first:
                return False
    return True


def _same_size(one: Any, other: Any) -> bool:
    """Two sizes export recorded, equal as plain ints or as one symbol."""
    if isinstance(one, int) or isinstance(other, int):
        return isinstance(one, int) and isinstance(other, int) and one == other
    expression = getattr(getattr(one, "node", None), "expr", None)
    return expression is not None and expression == getattr(getattr(other, "node", None), "expr", None)
