"""A graphed method's host calls in C (native/graph_call.c), driven without a GPU.

The module takes the CUDA driver's functions as addresses: these tests give it
ctypes callbacks that record what is launched and waited for, over pinned
buffers that are plain NumPy arrays here. The GPU suite replays real graphs
through it (tests/runtime/test_cuda_runtime.py).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest

from cuda_runner.arrays import numpy_dtype
from cuda_runner.errors import ModelRuntimeError

graph_call = pytest.importorskip("cuda_runner._graph_call", reason="built by pip install (scripts/test.sh)")

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_SYNCHRONIZE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_CURRENT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
_MAKE_CURRENT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_GRAPH, _STREAM, _CONTEXT = 0x5000, 0x6000, 0x7000
_VOCAB = 6


def _address(function: object) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value or 0


class Driver:
    """Stands in for libcuda: records launches and waits; a launch "runs" the
    model by writing the logits it is given into the output's pinned buffer."""

    def __init__(self, output: np.ndarray):
        self.events: list[tuple] = []
        self.launch_status = self.synchronize_status = self.make_current_status = 0
        self.context = _CONTEXT
        self.output = output
        self.logits = np.zeros(0, np.uint8)
        self.staged: list[bytes] = []
        self.inputs: list[np.ndarray] = []
        self.on_launch = lambda: None
        # Kept as attributes: the callbacks must outlive every call through them.
        self.launch = _LAUNCH(self._launch)
        self.synchronize = _SYNCHRONIZE(self._synchronize)
        self.current = _CURRENT(self._current)
        self.make_current = _MAKE_CURRENT(self._make_current)

    def parts(self) -> dict:
        """The GraphCall arguments that stand for the driver."""
        return {"launch": _address(self.launch), "synchronize": _address(self.synchronize), "current": _address(self.current),
                "make_current": _address(self.make_current), "graph": _GRAPH, "stream": _STREAM, "context": _CONTEXT, "fail": _fail}

    def _launch(self, graph: int, stream: int) -> int:
        self.events.append(("launch", graph, stream))
        self.staged = [buffer.tobytes() for buffer in self.inputs]
        if self.launch_status == 0:
            self.output[: self.logits.nbytes] = self.logits.view(np.uint8)
        self.on_launch()
        return self.launch_status

    def _synchronize(self, stream: int) -> int:
        self.events.append(("synchronize", stream))
        return self.synchronize_status

    def _current(self, context: ctypes.Array) -> int:
        context[0] = self.context
        return 0

    def _make_current(self, context: int) -> int:
        self.events.append(("make current", context))
        if self.make_current_status == 0:
            self.context = context
        return self.make_current_status


def _fail(function: str, status: int) -> None:
    raise ModelRuntimeError(f"{function} failed: {status}")


def _decode_call(*, bounds: tuple[int, int] | None = (0, 511)):
    """A GraphCall for decode(tokens int64 [1, 1], input_pos int64 [1]) -> logits bfloat16 [1, 6]."""
    staged_in = [np.zeros(8, np.uint8), np.zeros(8, np.uint8)]
    staged_out = np.zeros(2 * _VOCAB, np.uint8)
    driver = Driver(staged_out)
    driver.inputs = staged_in
    int64 = numpy_dtype("int64")
    inputs = [("tokens", int64, (1, 1), staged_in[0].ctypes.data, 8, (0, 31999, 8), None),
              ("input_pos", int64, (1,), staged_in[1].ctypes.data, 8, None if bounds is None else (*bounds, 8), None)]
    outputs = [("logits", numpy_dtype("bfloat16"), (1, _VOCAB), staged_out.ctypes.data, 2 * _VOCAB)]
    call = graph_call.GraphCall(**driver.parts(), inputs=inputs, outputs=outputs, array_type=np.ndarray,
                                empty=np.empty, keep=(staged_in, staged_out, driver))
    return call, driver


def _step(token: int = 7, position: int = 3) -> dict[str, np.ndarray]:
    return {"tokens": np.array([[token]], np.int64), "input_pos": np.array([position], np.int64)}


def test_a_call_stages_the_inputs_then_launches_then_waits_then_copies_the_outputs_into_fresh_arrays():
    call, driver = _decode_call()
    driver.logits = np.arange(_VOCAB, dtype=np.float32).astype(numpy_dtype("bfloat16")).reshape(1, _VOCAB)
    outputs = call.run(_step(7, 3))
    assert driver.events == [("launch", _GRAPH, _STREAM), ("synchronize", _STREAM)]
    assert driver.staged == [np.int64(7).tobytes(), np.int64(3).tobytes()]  # in place before the launch
    assert list(outputs) == ["logits"]
    logits = outputs["logits"]
    assert type(logits) is np.ndarray and logits.dtype == numpy_dtype("bfloat16") and logits.shape == (1, _VOCAB)
    np.testing.assert_array_equal(logits.astype(np.float32), np.arange(_VOCAB, dtype=np.float32).reshape(1, _VOCAB))
    again = call.run(_step(8, 4))["logits"]
    assert again is not logits and logits.flags.owndata  # each call's outputs are the caller's own
    assert driver.staged == [np.int64(8).tobytes(), np.int64(4).tobytes()]


@pytest.mark.parametrize("inputs", [
    pytest.param([("tokens", np.array([[7]], np.int32))], id="another dtype"),
    pytest.param([("tokens", np.array([[7]], np.int64).astype(">i8"))], id="big-endian"),
    pytest.param([("tokens", np.array([7], np.int64))], id="another shape"),
    pytest.param([("extra", np.zeros(1))], id="an input too many"),
    pytest.param([("tokens", None)], id="an input missing"),
    pytest.param([("tokens", [[7]])], id="a list"),
    pytest.param([("tokens", np.ma.masked_array([[7]], dtype=np.int64))], id="an ndarray subclass"),
    pytest.param([("input_pos", np.array([512], np.int64))], id="past its bounds"),
    pytest.param([("input_pos", np.array([-1], np.int64))], id="below its bounds"),
    pytest.param([("tokens", np.array([[32000]], np.int64))], id="a token past the vocabulary"),
])
def test_a_call_it_does_not_take_returns_none_having_launched_nothing(inputs):
    """The caller's ordinary path then refuses it with its own message, or makes it."""
    call, driver = _decode_call()
    given = _step()
    for name, value in inputs:
        if value is None:
            del given[name]
        else:
            given[name] = value
    assert call.run(given) is None
    assert driver.events == []


def test_a_strided_input_is_not_taken_but_a_row_major_view_is():
    call, driver = _decode_call()
    pair = np.array([[3], [9]], np.int64)
    assert call.run({"tokens": np.array([[7]], np.int64), "input_pos": pair[:, 0][1:]}) is not None  # one element: row-major
    staged_in = [np.zeros(16, np.uint8)]
    call2 = graph_call.GraphCall(**driver.parts(), inputs=[("x", np.dtype(np.int64), (2,), staged_in[0].ctypes.data, 16, None, None)],
                                 outputs=[], array_type=np.ndarray, empty=np.empty, keep=staged_in)
    driver.events.clear()
    assert call2.run({"x": np.arange(4, dtype=np.int64)[::2]}) is None and driver.events == []
    assert call2.run({"x": np.arange(2, dtype=np.int64)}) == {} and staged_in[0].view(np.int64).tolist() == [0, 1]


def test_bounds_are_checked_on_every_element_of_int32_and_int64_inputs():
    staged = np.zeros(12, np.uint8)
    driver = Driver(np.zeros(0, np.uint8))
    call = graph_call.GraphCall(**driver.parts(), inputs=[("x", np.dtype(np.int32), (3,), staged.ctypes.data, 12, (-2, 5, 4), None)],
                                outputs=[], array_type=np.ndarray, empty=np.empty, keep=staged)
    assert call.run({"x": np.array([-2, 0, 5], np.int32)}) == {}
    assert call.run({"x": np.array([-2, 6, 5], np.int32)}) is None
    assert call.run({"x": np.array([0, 0, -3], np.int32)}) is None
    assert driver.events == [("launch", _GRAPH, _STREAM), ("synchronize", _STREAM)]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_span_bounds_are_checked_on_the_first_element_and_the_element_count(dtype):
    """A prompt's positions, where the method writes its cache at first .. first + n - 1 of 0..31;
    the other elements are not what it writes at, and are not checked."""
    size = np.dtype(dtype).itemsize
    staged = np.zeros(4 * size, np.uint8)
    driver = Driver(np.zeros(0, np.uint8))
    call = graph_call.GraphCall(**driver.parts(), inputs=[("cache_position", np.dtype(dtype), (4,), staged.ctypes.data, 4 * size, None, (0, 31, size))],
                                outputs=[], array_type=np.ndarray, empty=np.empty, keep=staged)
    for first, taken in ((0, True), (28, True), (29, False), (-1, False), (np.iinfo(dtype).max, False)):
        given = np.array([first, -50, 99, 7], dtype)
        assert (call.run({"cache_position": given}) is not None) is taken, first
    assert len(driver.events) == 2 * 2  # launched and waited for the two spans inside
    lowest = graph_call.GraphCall(**driver.parts(), inputs=[("p", np.dtype(np.int64), (2,), staged.ctypes.data, 16, None, (-2**63, -2**63, 8))],
                                  outputs=[], array_type=np.ndarray, empty=np.empty, keep=staged)
    assert lowest.run({"p": np.array([-2**63, 0], np.int64)}) is None  # no span of two fits: nothing overflows in finding that


def test_another_context_current_is_replaced_by_the_graphs_as_the_callers_path_would():
    call, driver = _decode_call()
    driver.context = 0  # a thread that has used no device yet, or another device
    assert call.run(_step()) is not None
    assert driver.events == [("make current", _CONTEXT), ("launch", _GRAPH, _STREAM), ("synchronize", _STREAM)]
    driver.events.clear()
    assert call.run(_step()) is not None and ("make current", _CONTEXT) not in driver.events  # current now


def test_a_context_that_cannot_be_made_current_sends_the_call_back_to_the_caller():
    call, driver = _decode_call()
    driver.context, driver.make_current_status = 0, 201
    assert call.run(_step()) is None and driver.events == [("make current", _CONTEXT)]


def test_keys_other_than_exact_strings_are_not_taken():
    """A str subclass's __eq__ would run Python code in the middle of the call, while the lane is held."""

    class Name(str):
        def __eq__(self, other: object) -> bool:
            raise AssertionError("compared")

        __hash__ = str.__hash__

    call, driver = _decode_call()
    given = _step()
    given[Name("tokens")] = given.pop("tokens")
    assert call.run(given) is None and driver.events == []


def test_a_closed_call_refuses_every_call_and_forgets_its_buffers():
    call, driver = _decode_call()
    held = sys.getrefcount(driver.inputs)
    call.close()
    let_go = sys.getrefcount(driver.inputs)  # outside the assert, whose rewriting holds its operands
    assert let_go == held - 1  # `keep` let go
    with pytest.raises(RuntimeError, match="closed"):
        call.run(_step())
    assert driver.events == []
    call.close()  # twice: nothing more


@pytest.mark.parametrize("failing", ["launch", "synchronize"])
def test_a_cuda_error_is_raised_through_fail(failing):
    call, driver = _decode_call()
    setattr(driver, f"{failing}_status", 700)
    function = {"launch": "cuGraphLaunch", "synchronize": "cuStreamSynchronize"}[failing]
    with pytest.raises(ModelRuntimeError, match=f"{function} failed: 700"):
        call.run(_step())
    assert driver.events[-1][0] == failing  # a failed launch is not waited for


def test_fail_that_returns_still_raises():
    driver = Driver(np.zeros(0, np.uint8))
    driver.launch_status = 1
    staged = np.zeros(8, np.uint8)
    parts = {**driver.parts(), "fail": lambda function, status: None}
    quiet = graph_call.GraphCall(**parts, inputs=[("x", np.dtype(np.int64), (1,), staged.ctypes.data, 8, None, None)],
                                 outputs=[], array_type=np.ndarray, empty=np.empty, keep=staged)
    with pytest.raises(RuntimeError, match="cuGraphLaunch failed: CUDA error 1"):
        quiet.run({"x": np.zeros(1, np.int64)})


def test_a_second_call_while_one_runs_is_refused():
    """The staging buffers are the call's: a call from inside the launch (or another thread while the GPU is waited for) must not rewrite them."""
    call, driver = _decode_call()
    refused: list[BaseException] = []

    def reenter() -> None:
        try:
            call.run(_step())
        except RuntimeError as error:
            refused.append(error)

    driver.on_launch = reenter
    assert call.run(_step()) is not None
    assert [str(error) for error in refused] == ["the graph call is already running a call"]


@pytest.mark.parametrize("entry", [
    pytest.param(("x", np.dtype(np.int64), (1,), 0, 8, None, None), id="no staging buffer"),
    pytest.param(("x", np.dtype(np.int64), (1,), 64, 8, (0, 1, 2), None), id="bounds of another size"),
    pytest.param(("x", np.dtype(np.int64), (1,), 64, 8, None, (0, 1, 3)), id="span bounds of no integer size"),
    pytest.param(("x", np.dtype(np.int64), [1], 64, 8, None, None), id="a shape that is not a tuple"),
])
def test_a_bad_description_is_refused_when_made(entry):
    driver = Driver(np.zeros(0, np.uint8))
    with pytest.raises((ValueError, TypeError)):
        graph_call.GraphCall(**driver.parts(), inputs=[entry], outputs=[], array_type=np.ndarray, empty=np.empty,
                             keep=None)


def test_the_host_call_benchmark_times_the_c_call_against_python_on_the_same_step(tmp_path):
    """scripts/bench_graph_host_call.py, briefly: both paths answer the 1B decode step alike, and it writes its figures."""
    import json

    from helpers import ROOT

    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_graph_host_call.py"), "--steps", "200", "--rounds", "2",
                           "--output", str(tmp_path / "figures.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert set(figures["median_of_rounds_us"]) == {"python", "c"} and all(len(rounds) == 2 for rounds in figures["median_step_us_by_round"].values())
