"""The host's part of a graphed, waited decode step: the replay made in C
(native/graph_call.c) against the same replay made in Python, side by side.

No GPU is needed or used: the graph's launch and the stream's wait are a C
function that returns success at once, so what is timed is everything the
host does around them in `cuda-runner bench --steps N --cuda-graph`: the
step's position array, Method.run's checks, staging the inputs into pinned
buffers, and copying the logits into a fresh array. The signature is the 1B
decoder's decode step (tokens int64 [1, 1] and input_pos int64 [1], both
bounded; logits bfloat16 [1, 32000]). On a GPU the same comparison runs
through the CLI with CUDA_RUNNER_GRAPH_C_CALLS=0 and 1 (scripts/gpu-test.sh).

    python scripts/bench_graph_host_call.py [--steps 20000] [--rounds 5] [--output host-call.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from cuda_runner.format.manifest import MUTATED_INPUTS_OPTION, DeviceSpec, MethodSpec, TensorSpec
from cuda_runner.runtime import graphs
from cuda_runner.runtime.method import Method, _Lanes
from cuda_runner.runtime.providers import own_shim_path
from cuda_runner.runtime.tensors import TensorView

VOCAB, CACHE = 32000, 512


class _Stream:
    ptr = 0

    def synchronize(self) -> None:
        pass


class _Lane:
    """What the graph executor asks of its CUDA executor on a replay: nothing but a device."""

    device_index = 0
    stream = _Stream()

    def use_device(self) -> None:
        pass


class _InstantGraph:
    """A graph whose launch and wait return at once, from Python (replay) and from C (native_parts)."""

    def __init__(self, succeed: int):
        self._succeed = succeed

    def replay(self) -> None:
        pass

    def native_parts(self) -> dict[str, Any]:
        return {"launch": self._succeed, "synchronize": self._succeed, "current": self._succeed, "make_current": self._succeed, "graph": None,
                "stream": None, "context": None, "fail": print}


def _decode_method(in_c: bool) -> Method:
    spec = MethodSpec("decode", DeviceSpec("cuda"), "library", None,
                      (TensorSpec("tokens", "int64", (1, 1), bounds=(0, VOCAB - 1)), TensorSpec("input_pos", "int64", (1,), bounds=(0, CACHE - 1))),
                      (TensorSpec("logits", "bfloat16", (1, VOCAB)),), {}, "2.11", compile_options={MUTATED_INPUTS_OPTION: []})
    shim = own_shim_path()
    if shim is None:
        raise SystemExit("the shim is not built: run scripts/test.sh (pip install) first")
    # The shim's cudarunner_device_type_cpu() takes nothing and returns 0: CUDA's success, at once.
    succeed = ctypes.cast(ctypes.CDLL(str(shim)).cudarunner_device_type_cpu, ctypes.c_void_p).value or 0
    executor = graphs.CudaGraphExecutor.__new__(graphs.CudaGraphExecutor)
    executor._executor, executor._spec, executor._calls = _Lane(), spec, {}  # type: ignore[assignment]
    logits = TensorView.of(0, "bfloat16", (1, VOCAB), (VOCAB, 1))
    staged_in = [np.zeros(8, np.uint8), np.zeros(8, np.uint8)]
    staged_out: list[np.ndarray | None] = [np.zeros(2 * VOCAB, np.uint8)]
    graph = _InstantGraph(succeed)
    captured = graphs._Captured(graph, [0, 0], None, [logits], list(staged_in), staged_out)  # type: ignore[arg-type]
    if in_c:
        captured.fast_call = executor._fast_call(captured, ((1, 1), (1,)), graph.native_parts)
        if captured.fast_call is None:
            raise SystemExit("cuda_runner._graph_call is not built: run scripts/test.sh (pip install) first")
        executor.fast_call = captured.fast_call  # as its first replay through Python leaves it
    executor._graphs = {(False, ((1, 1), (1,))): captured}
    method = Method(spec, None, None, None, _Lanes(lambda: executor, 1, executor), {})  # type: ignore[arg-type]
    method._first_run_done = True
    return method


def _steps(method: Method, count: int) -> list[float]:
    """Per-step seconds of `count` steps, as bench's decode loop makes them."""
    position = np.zeros(1, np.int64)
    inputs = {"tokens": np.array([[5]], np.int64), "input_pos": position}
    clock = time.perf_counter
    samples = []
    for step in range(count):
        started = clock()
        position.fill(step % CACHE)
        method.run(inputs)
        samples.append(clock() - started)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path)
    options = parser.parse_args()
    methods = {"python": _decode_method(in_c=False), "c": _decode_method(in_c=True)}
    step = {"tokens": np.array([[5]], np.int64), "input_pos": np.array([7], np.int64)}
    answers = [method.run(step)["logits"] for method in methods.values()]
    if not all(answer.shape == (1, VOCAB) and answer.tobytes() == answers[0].tobytes() for answer in answers):
        raise SystemExit("the two paths answer the step differently")
    for method in methods.values():
        _steps(method, 2000)  # warm
    medians: dict[str, list[float]] = {name: [] for name in methods}
    order = list(methods)
    for round_index in range(options.rounds):
        for name in order if round_index % 2 == 0 else reversed(order):  # A B B A: drift hits both alike
            medians[name].append(statistics.median(_steps(methods[name], options.steps)) * 1e6)
    result = {"machine": f"{platform.processor() or platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
              "steps_per_round": options.steps, "median_step_us_by_round": medians,
              "median_of_rounds_us": {name: statistics.median(values) for name, values in medians.items()}}
    for name, values in medians.items():
        print(f"{name:>6}: median {statistics.median(values):6.2f} us a step (rounds {min(values):.2f}-{max(values):.2f})")
    if options.output is not None:
        options.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
