"""One loaded method: its library, container, executors and signature.

Input checks: the library compiles in its own checks of every input's
dtype, sizes and strides (AOTInductor generates them), which run when the
environment variable AOTI_RUNTIME_CHECK_INPUTS is set at the library's first
Run (it is read once, into a static). `check_inputs=True` sets it around that
first Run. They cost a little per call (docs/bench-results/history.md, "Library input checks") and catch a
manifest that lies about the library's signature, which the runner's own
checks against the manifest cannot.

Thread safety: a Method may be called from any number of threads. Each call
borrows an executor ("lane": its own staging buffers, CUDA stream and ctypes
out-parameters) from a pool of `lanes` executors, and waits while all are
busy; the container holds as many model instances as there are lanes, so up
to `lanes` calls run at once. Closing waits for the calls in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from typing import Any

import numpy as np

from ..arrays import dtype_name
from ..errors import BundleError, ClosedError, InputError, Interrupted, ModelRuntimeError
from ..format.manifest import (
    LIBRARY_CHECKS_OPTION,
    MUTATED_BUFFERS_OPTION,
    MUTATED_INPUTS_OPTION,
    READ_ONLY_BUFFERS_OPTION,
    MethodSpec,
    OutputSource,
    TensorSpec,
)
from ..format.source import ModelReader
from ..format.validation import bounded_inputs, check_bounds, validate_inputs
from ..io.inputs import ResolvedInputs
from . import interrupts
from .constants import ConstantMemory, bind_constants
from .container import ConstantInfo, Container
from .devices import Device
from .executor import Executor
from .host import CpuExecutor, load_weights_on_host
from .invoke import CallHelper, load_call_helper
from .library import LibraryLease, lease_library
from .options import LoadOptions
from .providers import bind_library, default_provider, libtorch_remedy
from .shim import Shim

#: progress(method, bytes done, bytes in all) of a method's weights while they load.
LoadProgress = Callable[[str, int, int], None]

Inputs = Mapping[str, Any] | Sequence[Any]
_DEFAULTS = LoadOptions()

_NATIVE_CHECKS = "AOTI_RUNTIME_CHECK_INPUTS"
_first_run_lock = threading.Lock()
# How the library's input checks word a refusal (torch's generated code).
_NATIVE_CHECK_PHRASES = (
    "unmatched dtype", "unmatched dim value", "unmatched stride value", "dim value is too small", "dim value is too large", "unmatched device",
)  # the environment is the process's: one first run at a time



class _Lanes:
    """A pool of executors; each call borrows one for its whole duration.

    One lock guards it all (a call costs one acquire to borrow and one to give
    back, where a queue.Queue took several); a caller waits only when every
    lane is busy and no more may be made."""

    def __init__(self, make: Callable[[], Executor], limit: int, first: Executor):
        self.make = make
        self.limit = limit
        # Last in, first out: one thread calling alone keeps getting the same lane.
        self._idle = [first]
        self._all = [first]
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a lane came back, or the last call ended
        self._created = 1
        self._busy = 0
        self._waiting = 0  # callers waiting for a lane (or close waiting for the last call)
        self._replacing = False  # reset_state is swapping the executors: callers wait for the new ones
        self.closed = False

    @property
    def first(self) -> Executor:
        return self._all[0]

    def borrow(self) -> _Borrowed:
        return _Borrowed(self)

    def take(self) -> Executor:
        with self._lock:
            while self._replacing:
                self._wait()
            if self.closed:
                raise ClosedError("the method is closed")
            self._busy += 1
            try:
                while not self._idle:
                    if self._created < self.limit:
                        self._created += 1
                        break
                    self._wait()
                else:
                    return self._idle.pop()
            except BaseException:  # interrupted while waiting: this call never ran
                self._busy -= 1
                self._changed.notify_all()
                raise
        try:
            executor = self.make()
        except BaseException:
            with self._lock:
                self._created -= 1
                self._busy -= 1
                self._changed.notify_all()
            raise
        with self._lock:
            self._all.append(executor)
        return executor

    def _wait(self) -> None:
        self._waiting += 1
        try:
            self._changed.wait()
        finally:
            self._waiting -= 1

    def give_back(self, executor: Executor) -> None:
        with self._lock:
            self._idle.append(executor)
            self._busy -= 1
            if self._waiting:  # notifying nobody still costs a Python-level call per run
                self._changed.notify_all()

    def replace(self, make: Callable[[], Executor], first: Executor, hand_over: Callable[[list[Executor]], None]) -> list[Executor]:
        """Swap every executor for `first` (made by `make`, for a new container).
        Waits for the calls in flight; calls made meanwhile wait, then get the
        new executor. `hand_over(old)` runs before any of them does. Returns the
        old executors, which no call uses any more."""
        with self._lock:
            if self.closed:
                raise ClosedError("the method is closed")
            self._replacing = True
            try:
                while self._busy:
                    self._wait()
                old, self._all, self._idle = self._all, [first], [first]
                self.make, self._created = make, 1
                hand_over(old)
            finally:
                self._replacing = False
                self._changed.notify_all()
        return old

    def close(self) -> list[Executor]:
        """Refuse new calls, wait for those in flight, and hand back every executor."""
        with self._lock:
            self.closed = True
            while self._busy:
                self._wait()
            executors, self._all = self._all, []
        return executors


class _Borrowed:
    """`with lanes.borrow() as executor:` without a generator's cost per call."""

    __slots__ = ("_executor", "_lanes")

    def __init__(self, lanes: _Lanes):
        self._lanes = lanes

    def __enter__(self) -> Executor:
        self._executor = self._lanes.take()
        return self._executor

    def __exit__(self, *exc: object) -> None:
        self._lanes.give_back(self._executor)


class Method:
    """A method ready to run. Build it with Method.load; close it when done."""

    def __init__(
        self, spec: MethodSpec, device: Device, library: LibraryLease, container: Container, lanes: _Lanes, timings: dict[str, float],
        check_inputs: bool = False,
    ):
        self.spec = spec
        self.check_inputs = check_inputs
        self._first_run_done = False
        self.device = device
        self._library: LibraryLease | None = library
        self._container: Container | None = container
        self._lanes = lanes
        self.load_timings = timings
        self._wiring = spec.wiring
        self._names = [input_spec.name for input_spec in spec.inputs]
        self._output_names = [output_spec.name for output_spec in spec.outputs]
        self._written_inputs = written_inputs(spec)
        self._bfloat16_inputs = [position for position, tensor in enumerate(spec.inputs) if tensor.dtype == "bfloat16"]
        # Integer inputs with the values the method accepts (a position in its KV cache): checked on every call.
        self._bounded = bounded_inputs(spec)
        self._copies_inputs = self._written_inputs is None or bool(self._written_inputs)
        # Whether an executor's fast_call may take a whole call: it passes the caller's arrays straight to the library.
        self._calls_fast = lanes.first.offers_fast_calls and self._wiring is None and not self._copies_inputs
        # (dtype, shape) of each input, already validated; apart for device
        # arrays, where uint16 can stand for bfloat16.
        self._accepted_host: set[tuple[Any, ...]] = set()
        self._accepted_device: set[tuple[Any, ...]] = set()
        self._last_stream = threading.local()
        self._constants: ConstantMemory | None = None
        #: Whether a run may change state the next run sees (buffers such as a KV cache).
        self.stateful = False
        self._reset_source: tuple[ConstantMemory, Callable[[str], memoryview]] | None = None
        # For a stateful method whose weights are one blob: a new container holding the stored values.
        self._fresh_container: Callable[[], tuple[Container, Callable[[], Executor], Executor]] | None = None
        self._close_lock = threading.Lock()
        self.warm_up_note = "not done"
        self._helper: CallHelper | None = None
        #: How each call reaches the library: "call helper", or "ctypes: <why>".
        self.call_path = "ctypes"
        #: Whose shim functions the library is bound to: "cuda-runner shim" or "libtorch".
        self.provider = ""
        #: Held around each call where other methods of the model share this one's state (runtime/model.py).
        self.state_lock: threading.Lock | None = None

    @classmethod
    def load(
        cls, reader: ModelReader, spec: MethodSpec, device: Device, options: LoadOptions = _DEFAULTS, *,
        shared_constants: ConstantMemory | None = None, progress: LoadProgress | None = None,
    ) -> Method:
        """The load sequence: check the library, choose its shim provider and load it,
        create the container, feed the weights, then make the lanes' executors for it.
        `progress(method, done, total)` hears how many weight bytes are up."""
        timings: dict[str, float] = {}
        clock = time.perf_counter
        if device.type == "cuda":
            from .context import start_context, wait_for_context

            start_context(device.index)  # while the library is checked and its provider loads
        started = clock()
        library_bytes = reader.read_verified(spec.library_segment)  # always checked, before it is loaded
        timings["verify_library"] = clock() - started
        started = clock()
        chosen, loadable = bind_library(library_bytes, device.type, default_provider(options.provider), libtorch_remedy(spec))
        del library_bytes  # a renamed copy is what loads: the original need not stay in memory meanwhile
        timings["libtorch" if chosen.needs_torch else "shim"] = clock() - started
        if device.type == "cuda":
            started = clock()
            wait_for_context(device.index)
            timings["cuda_context"] = clock() - started
        weights = reader.segment(spec.weights_segment, verify=False) if spec.weights_segment else memoryview(b"")
        # The weights and samples are data, not code: they are checked on other
        # threads while the weights load, and the method is refused if a check
        # fails. Skipping the weights digest never skips a signature.
        check_weights = options.verify_weights or reader.signature is not None
        weight_segments = [spec.weights_segment] if spec.weights_segment else sorted({item.segment for item in spec.constants})
        data_segments = weight_segments if check_weights else []
        data_segments += [name for name in (spec.sample_inputs_segment, spec.sample_outputs_segment) if name is not None]
        data_checks = [reader.verify_in_background(name) for name in data_segments]
        library: LibraryLease | None = None
        helper: CallHelper | None = None
        call_path = _unhelped_call_path(spec, options.call_helper, options.cuda_graph)
        container: Container | None = None
        constants: ConstantMemory | None = None
        executors: list[Executor] = []
        check_inputs = options.check_inputs or signature_needs_library_checks(spec)
        try:
            started = clock()
            library = lease_library(loadable, f"{spec.name}@{reader.path.name}", native_checks=check_inputs, bound_to=chosen.name)
            timings["load_library"] = clock() - started
            if call_path is None:
                started = clock()
                helper, call_path = load_call_helper(reader, spec, chosen.prepare)
                timings["load_call_helper"] = clock() - started
            started = clock()
            # One model instance where a run is known to change state: such a method gets one lane.
            one_lane = options.cuda_graph or bool(spec.compile_options.get(MUTATED_BUFFERS_OPTION))
            container = _create_container(library, spec, device, 1 if one_lane else options.lanes, check_inputs)
            timings["create_container"] = clock() - started
            stateful = changes_state(spec, container)  # checked against the library before anything is fed to it
            make = _executor_factory(chosen.shim, device, container, spec, helper)
            executors.append(make())
            started = clock()
            uploaded = (lambda done, total: progress(spec.name, done, total)) if progress is not None else None
            if spec.constants:
                # Storages shared by FQN with other methods of the model are uploaded once (and state in them is shared, as in ExecuTorch).
                constants = bind_constants(container, device, chosen.shim, spec.constants, lambda name: reader.segment(name, verify=False),
                                           shared_constants, uploaded)
            else:
                # AOTInductor copies a blob in one call: only its start and end can be told.
                if uploaded is not None:
                    uploaded(0, weights.nbytes)
                _load_weights(device, container, weights)
                if uploaded is not None:
                    uploaded(weights.nbytes, weights.nbytes)
            timings["load_weights"] = clock() - started
            if data_checks:
                started = clock()
                for check in data_checks:
                    check.result()
                timings["verify_weights_wait"] = clock() - started
            if options.cuda_graph:  # captured on later calls, one graph per input shape (runtime/graphs.py)
                executors[0] = _graph_executor(executors[0], spec)
        except BaseException:
            _stop_checks(data_checks)
            _close_parts(executors, container, library, constants if shared_constants is None else None, helper)
            raise
        finally:
            weights.release()
        # Calls of a method with state must see each other's writes in order: one lane.
        lanes = _Lanes(make, 1 if options.cuda_graph or stateful else options.lanes, executors[0])
        method = cls(spec, device, library, container, lanes, timings, check_inputs)
        method.stateful = stateful
        method._constants = constants if shared_constants is None else None  # shared memory is the model's to release
        method._reset_source = (constants, lambda name: reader.segment(name, verify=False)) if constants is not None else None
        if constants is None and stateful:
            lease, num_models, shim, graphed = library, container.num_models, chosen.shim, options.cuda_graph

            def fresh_container() -> tuple[Container, Callable[[], Executor], Executor]:
                """A new container with the stored weights, and its first executor (resetting a method whose weights are one blob)."""
                again = _create_container(lease, spec, device, num_models, check_inputs)
                try:
                    make_again = _executor_factory(shim, device, again, spec, helper)
                    first = make_again()
                    if graphed:  # graphs captured on the old container's buffers go with it: new ones are captured
                        first = _graph_executor(first, spec)
                except BaseException:
                    again.delete()
                    raise
                blob = reader.segment(spec.weights_segment, verify=False) if spec.weights_segment else memoryview(b"")
                try:
                    _load_weights(device, again, blob)
                except BaseException:
                    first.close()
                    again.delete()
                    raise
                finally:
                    blob.release()
                return again, make_again, first

            method._fresh_container = fresh_container
        method._helper = helper
        method.call_path = call_path or "ctypes"
        method.provider = chosen.name
        if options.warm_up and device.type == "cuda" and not options.cuda_graph:
            started = clock()
            method.warm_up_note = method._warm_up()
            timings["warm_up"] = clock() - started
        return method

    def _warm_up(self) -> str:
        """Run once on zeros, so that the first real call does not pay for what a
        library does lazily on its first run (loading kernel modules, creating
        cuBLAS handles and workspaces: 86 ms of a 0.1 ms model on the H200).
        Skipped where a run might change the model's state; a failure is kept
        as a note, and the first real run then reports it with its own inputs."""
        if self.stateful:
            return "skipped: a run may change the model's buffers"
        arrays = _zeros_for(self.spec)
        if arrays is None:
            return "skipped: an input's size is not known before a run"
        try:
            self.run(arrays)
        except Exception as error:  # the method stays loaded; its first real run reports what is wrong
            return f"failed: {error}"
        return "done"

    def reset_state(self) -> None:
        """Put the method's buffers (a KV cache, say) back to their stored
        initial values, without reloading the model. A call in flight finishes
        first, on the old state; calls made meanwhile wait and see the reset
        state.

        Per-constant weights (ExecuTorch 1.5 programs, converted programs,
        bundles with shared weights) are copied again in place. A library
        whose weights are one blob cannot be given them twice, so it gets a
        new container, fed from the stored blob, and the old one is deleted
        (with CUDA graphs, new graphs are captured on it)."""
        if not self.stateful:
            return  # nothing a run changes
        if self._reset_source is not None:
            if self._lanes.closed:  # (its lanes are never replaced: closed is closed)
                raise ClosedError(f"method {self.spec.name!r} is closed")
            memory, segment = self._reset_source
            with self._lanes.borrow():  # after the call in flight (a stateful method has one lane), before the next
                memory.reload(self.spec.constants, segment)
            return
        if self._fresh_container is None:  # a stateful method has one or the other
            raise ModelRuntimeError(f"method {self.spec.name!r} has no stored state to reset to")
        with self._close_lock:  # not beside close() or another reset
            if self._lanes.closed:
                raise ClosedError(f"method {self.spec.name!r} is closed")
            # Made beside a call in flight: the old container keeps its state until the swap.
            container, make, first = self._fresh_container()
            try:
                # pinned_input's arrays stay valid until the method is closed.
                old_executors = self._lanes.replace(make, first, lambda old: first.take_over(old[0]))
            except BaseException:
                first.close()
                container.delete()
                raise
            old_container, self._container = self._container, container
            self._last_stream = threading.local()  # the old lanes' streams go with them
        for executor in old_executors:
            executor.close()
        if old_container is not None:
            old_container.delete()

    def library_constants(self) -> list[ConstantInfo]:
        """What the loaded library says about each of its constants: internal
        name, original FQN, dtype code, size, and whether constant folding made it."""
        container = self._container
        if container is None:
            raise ClosedError(f"method {self.spec.name!r} is closed")
        return container.constants()

    @property
    def lanes(self) -> int:
        """How many calls of this method can run at once."""
        return self._lanes.limit

    @property
    def stream(self) -> Any:
        """The CUDA stream the calling thread's last call was ordered on (before
        any call, the first lane's); None on CPU. Synchronize it before using
        run_device outputs on another stream."""
        used = getattr(self._last_stream, "stream", None)
        if used is not None:
            return used
        return None if self._lanes.closed else self._lanes.first.stream

    def run(self, inputs: Inputs | ResolvedInputs, *, phases: dict[str, float] | None = None) -> dict[str, np.ndarray]:
        """NumPy (or array-like) inputs by name or position; NumPy outputs by name.

        Pass a dict as `phases` to have it filled with the time of the input
        copies, the model and the output copies (CUDA events on a GPU).

        Inputs resolved for this method (io.inputs.resolve_inputs) were checked
        against its signature then, and are not checked again while each array
        is still the one of the dtype and shape that was checked."""
        lock = self.state_lock
        if lock is None:
            return self._run(inputs, phases)
        with lock:
            return self._run(inputs, phases)

    def _run(self, inputs: Inputs | ResolvedInputs, phases: dict[str, float] | None) -> dict[str, np.ndarray]:
        """The call, with state_lock held where the method has one."""
        if self._calls_fast and phases is None and type(inputs) is dict and self._first_run_done:
            outputs = self._run_fast(inputs)
            if outputs is not None:
                return outputs
        trusted = inputs.unchanged_arrays(self._names) if isinstance(inputs, ResolvedInputs) and inputs.method is self.spec else None
        if trusted is not None:
            ordered = trusted
        else:
            ordered = self._ordered(inputs.arrays if isinstance(inputs, ResolvedInputs) else inputs)
            if self._bfloat16_inputs:
                ordered = _bfloat16_views(ordered, self._bfloat16_inputs)
            screen = None
            if all(type(array) is np.ndarray for array in ordered):
                screen = self._host_arrays  # arrays as given: screened only when their signature is new
            else:
                ordered = self._host_arrays(ordered)
            self._accept(ordered, _host_dtype_name, self._accepted_host, screen)
        if self._bounded:  # values, not dtypes and shapes: an array checked before may hold others now
            # Checked and passed on as copies (a few bytes): the caller's array may change after the check.
            ordered = list(ordered)
            for position, _, _, _ in self._bounded:
                ordered[position] = np.array(ordered[position])
            check_bounds(self.spec.name, ordered, self._bounded)
        if self._copies_inputs:
            ordered = self._private_copies(ordered, np.array)
        given = ordered
        if self._wiring is not None:
            ordered = [given[index] for index in self._wiring.library_inputs]
        with self._lanes.borrow() as executor:
            self._last_stream.stream = executor.stream
            if self._first_run_done and not self.check_inputs:
                return self._named(executor.run(ordered, phases), given, np.array)
            with self._first_run(), self._lying_manifest():
                return self._named(executor.run(ordered, phases), given, np.array)

    def _run_fast(self, inputs: dict[str, Any]) -> dict[str, np.ndarray] | None:
        """The call made whole by the lane's fast_call (a graph replayed from C,
        which checks what the call below does), or None: the call below makes it."""
        with self._lanes.borrow() as executor:
            fast = executor.fast_call
            if fast is None:
                return None
            outputs: dict[str, np.ndarray] | None = fast.run(inputs)
            if outputs is not None:
                self._last_stream.stream = executor.stream
            return outputs

    def pinned_input(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A page-locked host array for input `name` (CUDA only). Fill it and pass
        it to run(): the copy to the GPU then skips the host-side staging copy,
        which for large inputs costs far more than the transfer itself.
        The array stays valid until the method is closed; a call on another lane
        than the first copies it like any host array."""
        if self._lanes.closed:
            raise ClosedError(f"method {self.spec.name!r} is closed")
        spec = self.spec.input(name)
        if spec is None:
            raise InputError(f"method {self.spec.name!r} has no input {name!r}")
        if shape is None:
            if not all(isinstance(entry, int) for entry in spec.shape):
                raise InputError(f"input {name!r} has dynamic dimensions {spec.shape_text()}; give its shape")
            shape = tuple(int(entry) for entry in spec.shape)
        position = self.spec.inputs.index(spec)
        if self._wiring is not None:  # the staging slot is the library's
            if position not in self._wiring.library_inputs:
                raise InputError(f"input {name!r} is not passed to the library; it needs no pinned buffer")
            position = self._wiring.library_inputs.index(position)
        return self._lanes.first.pinned_input(position, tuple(shape), spec.dtype)

    def run_device(self, inputs: Inputs) -> dict[str, Any]:
        """CuPy arrays in, CuPy arrays out, no host copies (CUDA only). With
        `cuda_graph`, replayed from a graph per input shape (runtime/graphs.py).

        bfloat16 travels as uint16 CuPy arrays holding the bits. Outputs are
        ordered on the stream of the lane that ran them (`self.stream` when
        one thread calls): synchronize it before using them on another stream.
        Values are not checked against the inputs' bounds (TensorSpec.bounds),
        as run() checks them: that would read the arrays back and wait for the
        GPU. A position past a KV cache is the caller's to keep out."""
        lock = self.state_lock
        if lock is None:
            return self._run_device(inputs)
        with lock:
            return self._run_device(inputs)

    def _run_device(self, inputs: Inputs) -> dict[str, Any]:
        ordered = self._ordered(inputs)
        lanes = self._lanes
        executor = lanes.take()  # not `with lanes.borrow()`: this path is timed against a C loop
        try:
            ordered = executor.device_inputs(ordered, self._names)
            self._accept(ordered, _device_dtype_name, self._accepted_device)
            if self._copies_inputs:
                ordered = self._private_copies(ordered, executor.copy_device)
            given = ordered
            if self._wiring is not None:
                ordered = [given[index] for index in self._wiring.library_inputs]
            self._last_stream.stream = executor.stream
            if self._first_run_done and not self.check_inputs:
                return self._named(executor.run_device(ordered), given, executor.copy_device)
            with self._first_run(), self._lying_manifest():
                return self._named(executor.run_device(ordered), given, executor.copy_device)
        finally:
            lanes.give_back(executor)

    @contextlib.contextmanager
    def _first_run(self) -> Iterator[None]:
        if self._first_run_done:
            yield
            return
        with _first_run_lock:
            if self._first_run_done:
                yield
                return
            with _native_checks(self.check_inputs):
                yield
            self._first_run_done = True

    @contextlib.contextmanager
    def _lying_manifest(self) -> Iterator[None]:
        """Inputs passed the manifest's checks; if the library's own checks then
        refuse them, the manifest does not describe the library."""
        try:
            yield
        except ModelRuntimeError as error:
            if self.check_inputs and any(phrase in str(error) for phrase in _NATIVE_CHECK_PHRASES):
                raise BundleError(f"method {self.spec.name!r}: the manifest does not match the library: {error}") from error
            raise

    def _accept(
        self, arrays: list[Any], dtype_of: Callable[[Any, str], str], accepted: set[tuple[Any, ...]], screen: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        """Validate inputs (in the signature's order) against the signature. A
        combination of dtypes and shapes seen valid before is not checked again:
        the check is keyed on the arrays' own dtype objects and shapes, which
        costs far less than deriving the names it compares. `screen` refuses
        what no signature allows (object arrays, unsupported dtypes) first."""
        key = tuple([(array.dtype, array.shape) for array in arrays])
        if key in accepted:
            return
        if screen is not None:
            screen(arrays)
        given = {spec.name: (dtype_of(array, spec.dtype), tuple(array.shape)) for spec, array in zip(self.spec.inputs, arrays)}
        validate_inputs(self.spec, given)
        if len(accepted) < 256:
            accepted.add(key)

    def _private_copies(self, arrays: list[Any], copy: Callable[[Any], Any]) -> list[Any]:
        """The library writes into these inputs: it gets copies, so that the
        caller's arrays stay as they were and read-only ones (memory-mapped
        .npy files) are not written to. Where the bundle does not say which
        inputs are written (older bundles), read-only ones are copied."""
        written = self._written_inputs
        if written is None:
            return [copy(array) if not _writeable(array) else array for array in arrays]
        return [copy(array) if position in written else array for position, array in enumerate(arrays)]

    def _ordered(self, inputs: Inputs) -> list[Any]:
        """The inputs in the signature's order; names and count checked."""
        names = self._names
        if type(inputs) is dict or isinstance(inputs, Mapping):  # the exact type first: an ABC check costs more
            if len(inputs) == len(names):
                try:
                    return [inputs[name] for name in names]
                except KeyError:
                    pass
            validate_inputs(self.spec, {name: ("", ()) for name in inputs})  # raises, naming the missing or unknown input
            raise InputError(f"method {self.spec.name!r} takes inputs {', '.join(names) or 'none'}")
        values = list(inputs)
        if len(values) != len(names):
            raise InputError(f"method {self.spec.name!r} takes {len(names)} input(s) ({', '.join(names) or 'none'}), got {len(values)}")
        return values

    def _host_arrays(self, values: list[Any]) -> list[np.ndarray]:
        arrays = []
        for spec, value in zip(self.spec.inputs, values):
            name = spec.name
            if hasattr(value, "__cuda_array_interface__"):
                raise InputError(f"input {name!r} is a device array; use run_device for device-resident inputs")
            array = np.asarray(value)
            if array.dtype == object:
                raise InputError(f"input {name!r} is an object array, which is refused")
            try:
                dtype_name(array.dtype)
            except InputError:
                raise InputError(f"input {name!r}: dtype {array.dtype} is not supported") from None
            arrays.append(array)
        return arrays

    def _named(self, outputs: list[Any], given: list[Any], copy: Callable[[Any], Any]) -> dict[str, Any]:
        """The method's outputs by name, from the library's (and, where the
        method returns an input, a copy of that input)."""
        wiring = self._wiring
        if wiring is None:
            return dict(zip(self._output_names, outputs))
        return {output_spec.name: _output_from(source, output_spec, outputs, given, copy) for output_spec, source in zip(self.spec.outputs, wiring.outputs)}

    def close(self) -> None:
        """Wait for calls in flight, then release in a safe order: executors, container, library.
        Closing twice, or from two threads at once, releases once."""
        with self._close_lock:
            if self._lanes.closed:
                return
            executors = self._lanes.close()
            container, library, constants, helper = self._container, self._library, self._constants, self._helper
            self._container = self._library = self._constants = self._helper = None
        _close_parts(executors, container, library, constants, helper)

    def __enter__(self) -> Method:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _native_checks(enabled: bool) -> Iterator[None]:
    """Turn the library's input checks on for the Run inside (see the module docstring)."""
    if not enabled:
        yield
        return
    previous = os.environ.get(_NATIVE_CHECKS)
    os.environ[_NATIVE_CHECKS] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[_NATIVE_CHECKS]
        else:
            os.environ[_NATIVE_CHECKS] = previous


def _stop_checks(checks: Sequence[futures.Future[None]]) -> None:
    """Cancel a failed load's digest checks and wait for those already running: no
    thread may read the mapping once it closes. The wait goes on through any
    interrupt, which is then dropped: the load's own error is the one raised."""
    for check in checks:
        check.cancel()
    with contextlib.suppress(KeyboardInterrupt, Interrupted):
        interrupts.finish_through(lambda: futures.wait(checks))


def _unhelped_call_path(spec: MethodSpec, wanted: bool, cuda_graph: bool) -> str | None:
    """Why calls will not go through the call helper; None if they may."""
    if cuda_graph:
        return "ctypes: a CUDA graph replays its captured run without the call helper"
    if not wanted:
        return "ctypes: the call helper is turned off"
    if spec.call_helper_segment is None:
        return "ctypes: the bundle has no call helper"
    return None


def _create_container(library: LibraryLease, spec: MethodSpec, device: Device, num_models: int, check_inputs: bool) -> Container:
    if device.type == "cuda":
        from .cuda import use_device

        use_device(device.index)  # the container's model instances are made on the current device
    container = Container(library.library, str(device), num_models=num_models)
    container.capture_errors = check_inputs  # a refusal by the checks must be told apart
    try:
        _check_counts(spec, container)
    except BaseException:
        container.delete()
        raise
    return container


def _executor_factory(shim: Shim, device: Device, container: Container, spec: MethodSpec, helper: CallHelper | None) -> Callable[[], Executor]:
    """How to make one more lane for this container."""
    dtypes = [tensor.dtype for tensor in spec.library_signature[0]]  # in the library's order
    if device.type == "cpu":
        return lambda: CpuExecutor(shim, container, dtypes, helper)
    from .cuda import CudaExecutor

    return lambda: CudaExecutor(shim, device.index, container, dtypes, helper)


def _load_weights(device: Device, container: Container, weights: memoryview) -> None:
    if device.type == "cpu":
        load_weights_on_host(container, weights)
        return
    from .cuda import load_weights_on_cuda

    load_weights_on_cuda(device.index, container, weights)


def _graph_executor(executor: Executor, spec: MethodSpec) -> Executor:
    from .cuda import CudaExecutor

    if not isinstance(executor, CudaExecutor):
        raise InputError("a CUDA graph needs a CUDA device", subject="cuda_graph")
    from .graphs import CudaGraphExecutor

    inputs, outputs = spec.library_signature  # the graph replays the library's own call
    return CudaGraphExecutor(executor, dataclasses.replace(spec, inputs=inputs, outputs=outputs, wiring=None))


def _check_counts(spec: MethodSpec, container: Container) -> None:
    # A wrong count given to Run terminates the process, so a manifest that
    # disagrees with its library is refused here, before any Run.
    inputs, outputs = spec.library_signature
    if container.num_inputs != len(inputs) or container.num_outputs != len(outputs):
        raise BundleError(
            f"method {spec.name!r}: the manifest gives its library {len(inputs)} inputs and {len(outputs)} outputs, "
            f"but the library has {container.num_inputs} and {container.num_outputs}"
        )


def _close_parts(
    executors: list[Executor], container: Container | None, library: LibraryLease | None, constants: ConstantMemory | None = None,
    helper: CallHelper | None = None,
) -> None:
    for executor in executors:
        executor.close()
    if container is not None:
        container.delete()
    if constants is not None:  # the container viewed this memory until it was deleted
        constants.release()
    if library is not None:
        library.release()
    if helper is not None:
        helper.release()


def _zeros_for(spec: MethodSpec) -> dict[str, np.ndarray] | None:
    """Zero inputs at the export-time sizes (the smallest allowed, where those
    would take more than WARM_UP_BYTES), or None where no size is known or small."""
    from ..arrays import itemsize, numpy_dtype

    for pick in (lambda dim: dim.example if dim.example is not None else max(dim.min, 1), lambda dim: max(dim.min, 1)):
        shapes = {}
        for tensor in spec.inputs:
            if not all(isinstance(entry, int) or entry in spec.dims for entry in tensor.shape):
                return None
            shapes[tensor.name] = tuple(entry if isinstance(entry, int) else pick(spec.dims[entry]) for entry in tensor.shape)
        total = sum(math.prod(shape) * itemsize(tensor.dtype) for tensor, shape in zip(spec.inputs, shapes.values()))
        if total <= WARM_UP_BYTES:
            return {tensor.name: np.zeros(shapes[tensor.name], numpy_dtype(tensor.dtype)) for tensor in spec.inputs}
    return None


WARM_UP_BYTES = 256 << 20


def changes_state(spec: MethodSpec, container: Container) -> bool:
    """Whether a run may change what the next run sees: buffers compile found
    mutated, or, where nothing says (ExecuTorch programs, older bundles), any
    buffer the library has. What the manifest says is checked against the
    library's own list of its buffers: each must be named as written or as
    read-only, or the bundle is refused (a manifest whose list of written
    buffers was emptied would give a stateful method several lanes and a
    reset_state that resets nothing). A bundle made before compile recorded
    read-only buffers cannot be checked so: a buffer it does not name as
    written is taken to be."""
    mutated = spec.compile_options.get(MUTATED_BUFFERS_OPTION)
    if mutated is None:
        return container.has_buffers() is not False
    library_buffers = container.buffer_fqns()
    if library_buffers is None:
        return bool(mutated)
    read_only = spec.compile_options.get(READ_ONLY_BUFFERS_OPTION)
    unaccounted = sorted(library_buffers - set(mutated) - set(read_only or ()))
    if unaccounted and read_only is not None:
        shown = ", ".join(repr(name[:80]) for name in unaccounted[:5])
        raise BundleError(f"method {spec.name!r}: its library has the buffer(s) {shown}, which the manifest names neither as written nor as "
                          "read-only: the manifest does not describe its library")
    return bool(mutated) or bool(unaccounted)


def signature_needs_library_checks(spec: MethodSpec) -> bool:
    """Whether the manifest's signature cannot guard the library alone.

    An ExecuTorch program's signature is covered by no digest, and for a
    dynamic tensor states only upper bounds, not which of its dims vary; the
    library's own checks then refuse what it was not built for."""
    return bool(spec.compile_options.get(LIBRARY_CHECKS_OPTION))


def written_inputs(spec: MethodSpec) -> frozenset[int] | None:
    """Positions of the inputs a run writes into; None where the bundle does
    not say (made before compile recorded it)."""
    names = spec.compile_options.get(MUTATED_INPUTS_OPTION)
    if not isinstance(names, list):
        return None
    return frozenset(position for position, tensor in enumerate(spec.inputs) if tensor.name in names)


def _output_from(source: OutputSource, spec: TensorSpec, outputs: list[Any], given: list[Any], copy: Callable[[Any], Any]) -> Any:
    """One method output from its wiring source: a library output, a copy of an
    input, or a stored constant as a fresh 0-d array (a copy: callers may write it)."""
    if source.constant is not None:
        from ..arrays import numpy_dtype

        return copy(np.asarray(source.constant, numpy_dtype(spec.dtype)))
    return copy(given[source.index]) if source.from_input else outputs[source.index]


_BARE_VOID2 = np.dtype("V2")


def _bfloat16_views(arrays: list[Any], positions: list[int]) -> list[Any]:
    """bfloat16 arrays that went through np.save/np.savez come back from np.load
    as a bare 2-byte void (NumPy has no name for ml_dtypes' type): for a
    bfloat16 input, such an array is read as the bfloat16 it holds, as the
    runner's own file reader does."""
    for position in positions:
        array = arrays[position]
        if type(array) is np.ndarray and array.dtype == _BARE_VOID2 and array.dtype.fields is None:
            from ..arrays import numpy_dtype

            arrays = list(arrays)
            arrays[position] = array.view(numpy_dtype("bfloat16"))
    return arrays


def _writeable(array: Any) -> bool:
    flags = getattr(array, "flags", None)
    return bool(getattr(flags, "writeable", True))


def _device_dtype_name(array: Any, expected: str) -> str:
    """CuPy has no bfloat16: a bfloat16 input travels as its uint16 bits
    (uint16 is no dtype of the runner's own, so it means nothing else)."""
    if expected == "bfloat16" and str(array.dtype) == "uint16":
        return "bfloat16"
    return _host_dtype_name(array, expected)


def _host_dtype_name(array: Any, expected: str) -> str:
    try:
        return dtype_name(array.dtype)
    except (InputError, TypeError):
        return str(array.dtype)
