"""runtime/method.py: a failed load's digest checks, stopped and waited for through interrupts; which calls a lane's fast call makes."""

from __future__ import annotations

import threading
from concurrent import futures
from types import SimpleNamespace

import numpy as np
import pytest

from cuda_runner.errors import InputError, Interrupted
from cuda_runner.format.manifest import MUTATED_INPUTS_OPTION, DeviceSpec, MethodSpec, OutputSource, TensorSpec, Wiring
from cuda_runner.runtime import method
from cuda_runner.runtime.executor import Executor


def test_a_running_check_is_waited_for_through_an_interrupt(monkeypatch):
    reading = threading.Event()
    release = threading.Event()

    def check():
        reading.set()
        assert release.wait(10)

    with futures.ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(check)
        queued = pool.submit(check)
        assert reading.wait(10)
        real_wait = futures.wait
        calls = []

        def interrupted_once(waited, *args, **kwargs):
            calls.append(len(waited))
            if len(calls) == 1:
                release.set()
                raise Interrupted(15)
            return real_wait(waited, *args, **kwargs)

        monkeypatch.setattr(method.futures, "wait", interrupted_once)
        method._stop_checks([running, queued])  # the interrupt is dropped: the load's own error is raised
        assert running.done() and queued.cancelled() and calls == [2, 2]



class _Lane(Executor):
    """One lane whose run() records its calls; fast_call stands in for a graph's call in C."""

    stream = "the lane's stream"
    offers_fast_calls = True

    def __init__(self, fast_answer: dict | None):
        self.calls: list[tuple] = []
        self.fast_call = SimpleNamespace(run=lambda inputs: self.calls.append(("fast", sorted(inputs))) or fast_answer)

    def run(self, arrays: list[np.ndarray], phases: dict[str, float] | None = None) -> list[np.ndarray]:
        self.calls.append(("run", [array.tolist() for array in arrays]))
        return [np.zeros(2, np.float32)]

    def close(self) -> None:
        pass


def _decode_method(fast_answer: dict | None, written: list[str] | None = None, wiring: Wiring | None = None) -> tuple[method.Method, _Lane]:
    logits = TensorSpec("logits", "float32", (2,))
    spec = MethodSpec("decode", DeviceSpec("cuda"), "library", None,
                      (TensorSpec("tokens", "int64", (1, 1)), TensorSpec("input_pos", "int64", (1,), bounds=(0, 511))),
                      (logits,), {}, "2.11", compile_options={MUTATED_INPUTS_OPTION: written or []}, wiring=wiring)
    lane = _Lane(fast_answer)
    loaded = method.Method(spec, None, None, None, method._Lanes(lambda: lane, 1, lane), {})  # type: ignore[arg-type]
    loaded._first_run_done = True
    return loaded, lane


def _step(position: int = 3) -> dict[str, np.ndarray]:
    return {"tokens": np.array([[7]], np.int64), "input_pos": np.array([position], np.int64)}


def test_a_call_the_lanes_fast_call_takes_is_made_by_it_alone():
    answer = {"logits": np.ones(2, np.float32)}
    loaded, lane = _decode_method(answer)
    assert loaded.run(_step()) is answer
    assert lane.calls == [("fast", ["input_pos", "tokens"])] and loaded.stream == "the lane's stream"


def test_a_call_the_fast_call_leaves_is_made_and_checked_the_ordinary_way():
    loaded, lane = _decode_method(None)
    assert list(loaded.run(_step())) == ["logits"]
    assert lane.calls == [("fast", ["input_pos", "tokens"]), ("run", [[[7]], [3]])]
    lane.calls.clear()
    with pytest.raises(InputError, match="holds 512; method 'decode' accepts 0 to 511") as refused:
        loaded.run(_step(512))  # the C call leaves values past their bounds to this message
    assert refused.value.subject == "bounds" and lane.calls == [("fast", ["input_pos", "tokens"])]


def test_a_method_the_library_checks_takes_its_fast_call_once_its_first_call_is_done():
    """The library's checks run on a method's first call (an ExecuTorch program's); a graph's shape passed them before its capture."""
    answer = {"logits": np.ones(2, np.float32)}
    loaded, _ = _decode_method(answer)
    loaded.check_inputs = True
    assert loaded.run(_step()) is answer


@pytest.mark.parametrize("case", ["phases", "a list", "first run", "a written input", "wiring"])
def test_the_fast_call_is_not_tried_where_the_ordinary_call_does_more(case):
    """A written input is copied first; a wired library takes its inputs in its own order and its outputs are mapped back."""
    wiring = Wiring((1, 0), (TensorSpec("logits", "float32", (2,)),), (OutputSource(0),)) if case == "wiring" else None
    loaded, lane = _decode_method({"logits": np.ones(2, np.float32)}, written=["tokens"] if case == "a written input" else None, wiring=wiring)
    inputs: dict | list = _step()
    phases = None
    if case == "phases":
        phases = {}
    elif case == "a list":
        inputs = list(_step().values())
    elif case == "first run":
        loaded._first_run_done = False
    loaded.run(inputs, phases=phases)
    assert not [call for call in lane.calls if call[0] == "fast"]
