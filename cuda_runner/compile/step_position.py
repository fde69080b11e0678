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
from .graph_values import one_integer
from .graph_values import value as recorded_value


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
    beyond = (-1, positions, positions + 1, 2 * positions + 3,
              *(far for far in (1003, 65539, 2**31 + 3, 2**32 + 3, -(2**31) - 3, largest - 3) if abs(far) <= largest))
    with torch.no_grad():
        for step in (*range(positions), *beyond):
            if int(evaluate(torch.full(tuple(example.shape), step, dtype=example.dtype)).reshape(-1)[0]) != step:
                return False
    return True
