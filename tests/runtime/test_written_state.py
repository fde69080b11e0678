"""What a run writes to: buffers kept between calls (and reset_state), and
inputs the library writes into, for a bundle whose weights are one blob."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cuda_runner
from cuda_runner.errors import ClosedError


@pytest.fixture
def writer_bundle(compiled):
    """tests/models.py's Writer, compiled once per session (whichever worker asks first)."""
    import models

    return compiled("writer", "cpu").path, models.Writer


INPUTS = [(np.full(4, value, np.float32), np.arange(4, dtype=np.float32)) for value in (1.0, 2.0, -0.5)]


def _eager_steps(factory):
    import torch

    module = factory()
    with torch.no_grad():
        return [module(torch.from_numpy(x.copy()), torch.from_numpy(y.copy())).numpy() for x, y in INPUTS]


def _steps(method, inputs=INPUTS):
    return [next(iter(method.run([x, y]).values())) for x, y in inputs]


def test_compile_records_the_buffer_and_the_input_a_run_writes(writer_bundle):
    """torch.export's default IR leaves its mutation tables empty; they are read from its functional form."""
    path, _ = writer_bundle
    options = cuda_runner.read_manifest(path).methods["forward"].compile_options
    assert options["mutated_buffers"] == ["steps", "total"]
    # The library's own buffers that no run writes: `offset` (four values) is folded into the code, so it has none.
    assert options["read_only_buffers"] == []
    assert options["mutated_inputs"] == ["y"]


def test_state_is_kept_between_calls_and_reset_without_reloading(writer_bundle):
    path, factory = writer_bundle
    expected = _eager_steps(factory)
    with cuda_runner.load(path, lanes=4) as model:
        method = model.method()
        assert method.stateful and method.lanes == 1  # calls with state run in order, on one lane
        for got, want in zip(_steps(method), expected):
            np.testing.assert_allclose(got, want, rtol=1e-6)
        model.reset_state()
        for got, want in zip(_steps(method), expected):  # from the stored values again, like eager's fresh module
            np.testing.assert_allclose(got, want, rtol=1e-6)
        model.reset_state(method.spec.name)
        np.testing.assert_allclose(_steps(method, INPUTS[:1])[0], expected[0], rtol=1e-6)


def test_an_input_the_library_writes_into_stays_as_the_caller_gave_it(writer_bundle):
    path, factory = writer_bundle
    expected = _eager_steps(factory)[0]
    x, y = INPUTS[0]
    frozen = y.copy()
    frozen.setflags(write=False)  # as a memory-mapped .npy would be: writing into it would crash the process
    with cuda_runner.load(path) as model:
        got = next(iter(model.run([x, frozen]).values()))
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_array_equal(frozen, INPUTS[0][1])


def test_reset_state_of_a_closed_method_says_so(writer_bundle):
    path, _ = writer_bundle
    model = cuda_runner.load(path)
    method = model.method()
    model.close()
    with pytest.raises(ClosedError):
        method.reset_state()


def test_calls_from_another_thread_after_a_reset_see_the_reset_state(writer_bundle):
    path, factory = writer_bundle
    expected = _eager_steps(factory)
    with cuda_runner.load(path) as model:
        method = model.method()
        _steps(method)
        model.reset_state()
        seen: list[np.ndarray] = []
        worker = threading.Thread(target=lambda: seen.extend(_steps(method)))
        worker.start()
        worker.join()
        for got, want in zip(seen, expected):
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_calls_made_while_a_reset_runs_wait_for_it_instead_of_failing(writer_bundle):
    path, factory = writer_bundle
    expected = _eager_steps(factory)
    failures: list[BaseException] = []
    stop = threading.Event()

    def call_until_stopped():
        while not stop.is_set():
            try:
                _steps(method, INPUTS[:1])
            except BaseException as error:
                failures.append(error)
                return

    with cuda_runner.load(path) as model:
        method = model.method()
        callers = [threading.Thread(target=call_until_stopped) for _ in range(3)]
        for caller in callers:
            caller.start()
        for _ in range(20):
            model.reset_state()
        stop.set()
        for caller in callers:
            caller.join()
        model.reset_state()
        np.testing.assert_allclose(_steps(method, INPUTS[:1])[0], expected[0], rtol=1e-6)
    assert failures == []


def test_a_step_counter_is_kept_between_calls(writer_bundle):
    """steps.add_(1) computes the new value from buffers alone: Inductor's
    joint-graph constant folding froze it into the code (every run wrote 1),
    torch's own aoti_load_package alike; compile now turns that folding off
    for a module that writes buffers."""
    path, _ = writer_bundle
    assert cuda_runner.read_manifest(path).methods["forward"].compile_options["joint_graph_constant_folding"] is False
    zeros = np.zeros(4, np.float32)
    with cuda_runner.load(path) as model:
        outputs = [next(iter(model.run([zeros, zeros]).values())) for _ in range(3)]
    steps = [output - outputs[0] for output in outputs]  # x = y = 0: only the counter moves
    np.testing.assert_allclose(steps, [np.zeros(4), np.ones(4), np.full(4, 2.0)])


def _edited(path, destination, **changes):
    """The bundle with its method's compile options changed (None removes one): a manifest that lies."""
    import dataclasses

    from cuda_runner.format.bundle import open_bundle, write_bundle

    with open_bundle(path) as reader:
        spec = reader.manifest.methods["forward"]
        options = {key: value for key, value in {**spec.compile_options, **changes}.items() if value is not None}
        manifest = dataclasses.replace(reader.manifest, methods={"forward": dataclasses.replace(spec, compile_options=options)})
        write_bundle(destination, manifest, {entry.name: bytes(reader.segment(entry.name)) for entry in reader.manifest.segments})
    return destination


def test_a_manifest_whose_written_buffers_were_emptied_is_refused(writer_bundle, tmp_path):
    """It gave a stateful method two lanes and a reset_state that did nothing:
    the library's own list of its buffers has one the manifest now names nowhere."""
    from helpers import cli

    from cuda_runner.errors import BundleError

    path, _ = writer_bundle
    lying = _edited(path, tmp_path / "lying.bundle", mutated_buffers=[])
    with pytest.raises(BundleError, match=r"buffer\(s\) 'steps', 'total'.*neither as written nor as read-only"):
        cuda_runner.load(lying, lanes=2)
    result = cli("run", str(lying), "--inputs", "x=4xf32=1 1 1 1", "--inputs", "y=4xf32=1 1 1 1")
    assert result.returncode == 3 and len(result.error_lines) == 1


def test_a_bundle_that_names_no_read_only_buffers_takes_the_others_as_written(writer_bundle, tmp_path):
    """Bundles from before read_only_buffers was recorded: a buffer not named as
    written may be, so the method keeps one lane and its reset works."""
    path, factory = writer_bundle
    older = _edited(path, tmp_path / "older.bundle", mutated_buffers=[], read_only_buffers=None)
    expected = _eager_steps(factory)
    with cuda_runner.load(older, lanes=2) as model:
        method = model.method()
        assert method.stateful and method.lanes == 1
        for got, want in zip(_steps(method), expected):
            np.testing.assert_allclose(got, want, rtol=1e-6)
        model.reset_state()
        np.testing.assert_allclose(_steps(method, INPUTS[:1])[0], expected[0], rtol=1e-6)


def test_a_module_that_writes_nothing_records_so(dict_mlp_bundle):
    """No op of dict_mlp writes a tensor: compile says so without retracing it."""
    options = cuda_runner.read_manifest(dict_mlp_bundle.path).methods["forward"].compile_options
    assert options["mutated_buffers"] == [] and options["mutated_inputs"] == []
    with cuda_runner.load(dict_mlp_bundle.path, lanes=2) as model:
        assert not model.method().stateful and model.method().lanes == 2
