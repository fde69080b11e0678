"""Waits that interrupts cannot cut short (runtime/interrupts.py)."""

from __future__ import annotations

import pytest

from cuda_runner.errors import Interrupted
from cuda_runner.runtime import interrupts


def test_a_wait_is_finished_through_interrupts_and_the_first_raised_after():
    calls = []

    def step():
        calls.append(len(calls))
        if len(calls) == 1:
            raise KeyboardInterrupt("first")
        if len(calls) == 2:
            raise Interrupted(15)

    with pytest.raises(KeyboardInterrupt, match="first"):
        interrupts.finish_through(step)
    assert calls == [0, 1, 2]  # waited on after each, to its end
