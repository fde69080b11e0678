"""A loaded bundle: its methods on one device, sharing one open bundle mapping.

`load_model` is the one load sequence, used by `cuda_runner.load` and by
`run`, `bench` and batch jobs, each with a `LoadOptions`: open and check the
bundle, choose the device, then load each method (runtime/method.py). A Model is safe to use from any number of threads
(see Method); close it once, when no thread uses it any more.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ClosedError, CudaRunnerError, InputError
from ..format.manifest import Manifest, MethodSpec, choose_method
from ..format.source import ModelReader, open_model
from .constants import ConstantMemory
from .devices import Device, choose_device, parse_devices
from .method import Inputs, LoadProgress, Method
from .options import LoadOptions

_DEFAULTS = LoadOptions()


class Model:
    def __init__(self, reader: ModelReader, device: Device, methods: dict[str, Method], open_seconds: float = 0.0,
                 constants: ConstantMemory | None = None):
        self._reader = reader
        self.device = device
        self.methods = methods
        self.open_seconds = open_seconds
        self._constants = constants  # storages the methods share by FQN; released after the last method
        self._closed = False

    @property
    def constant_storages(self) -> int:
        """How many constant storages (per-FQN weights and state) the model holds: one per
        storage however many methods use it."""
        return 0 if self._constants is None else len(self._constants.storages)

    def reset_state(self, method: str | None = None) -> None:
        """Put the buffers (a KV cache) of one method, or of every method, back
        to their initial values without reloading (Method.reset_state)."""
        for target in [self.method(method)] if method is not None else self.methods.values():
            target.reset_state()

    @property
    def manifest(self) -> Manifest:
        return self._reader.manifest

    @property
    def path(self) -> Path:
        return self._reader.path

    def method(self, name: str | None = None) -> Method:
        """The named method; with no name, the only one loaded, or 'forward'."""
        if self._closed:
            raise ClosedError("the model is closed")
        return self.methods[choose_method(list(self.methods), name)]

    def load_timings(self, name: str | None = None) -> dict[str, float]:
        """Seconds per load phase of one method, opening included (names: docs/json.md, "Load phases")."""
        return {"open": self.open_seconds, **self.method(name).load_timings}

    def run(self, inputs: Inputs, method: str | None = None) -> dict[str, np.ndarray]:
        return self.method(method).run(inputs)

    def run_device(self, inputs: Inputs, method: str | None = None) -> dict[str, Any]:
        return self.method(method).run_device(inputs)

    def map(self, inputs: Iterable[Inputs], method: str | None = None, *, in_flight: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Run every input set of `inputs` (read lazily), yielding the outputs in order.

        Up to `in_flight` sets (default: the method's lanes + 1) are run by
        worker threads at once, so that preparing one set overlaps running
        another, and with several lanes several run together."""
        target = self.method(method)
        return ordered_map(target.run, inputs, in_flight or target.lanes + 1)

    def close(self) -> None:
        self._closed = True
        for method in reversed(list(self.methods.values())):
            method.close()
        self.methods = {}
        if self._constants is not None:  # no container views it any more
            self._constants.release()
            self._constants = None
        self._reader.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ordered_map(run: Callable[[Any], dict[str, Any]], inputs: Iterable[Any], window: int) -> Iterator[dict[str, Any]]:
    """run(item) for every item on `window` worker threads, results in input order."""
    if window < 1:
        raise InputError("in_flight must be at least 1")
    with ThreadPoolExecutor(max_workers=window, thread_name_prefix="cuda-runner-map") as pool:
        queued: collections.deque[Future[dict[str, Any]]] = collections.deque()
        try:
            for item in inputs:
                queued.append(pool.submit(run, item))
                if len(queued) >= window:
                    yield queued.popleft().result()
            while queued:
                yield queued.popleft().result()
        finally:
            for future in queued:
                future.cancel()


class ModelPool:
    """One loaded model per device; each call goes to the device with the fewest
    calls in flight, so faster or idler devices take more work."""

    def __init__(self, models: list[Model]):
        self.models = models
        self._in_flight = [0] * len(models)
        self._lock = threading.Lock()

    @property
    def devices(self) -> list[Device]:
        return [model.device for model in self.models]

    def method(self, name: str | None = None) -> Method:
        """The method on the first device (for its signature)."""
        return self.models[0].method(name)

    def run(self, inputs: Inputs, method: str | None = None) -> dict[str, np.ndarray]:
        with self._lock:
            index = min(range(len(self.models)), key=lambda position: self._in_flight[position])
            self._in_flight[index] += 1
        try:
            return self.models[index].run(inputs, method)
        finally:
            with self._lock:
                self._in_flight[index] -= 1

    def map(self, inputs: Iterable[Inputs], method: str | None = None, *, in_flight: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Like Model.map, over every device: outputs in input order."""
        lanes = sum(model.method(method).lanes for model in self.models)
        return ordered_map(lambda item: self.run(item, method), inputs, in_flight or lanes + len(self.models))

    def close(self) -> None:
        for model in self.models:
            model.close()
        self.models = []

    def __enter__(self) -> ModelPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prepare_device(specs: Sequence[MethodSpec], device: str | Device | None) -> None:
    """Start creating the CUDA context these methods will load on, on a thread
    of its own, so that it overlaps what the caller does before loading
    (reading inputs, loading references): a context costs about 0.3 s. Any
    problem with the device is left for the load to report."""
    try:
        target = choose_device(specs, device)
    except CudaRunnerError:
        return
    if target.type == "cuda":
        from .context import start_context

        start_context(target.index)


def load_pool(source: str | os.PathLike[str], devices: str | Sequence[int | str] = "all", options: LoadOptions = _DEFAULTS, *,
              methods: Iterable[str] | None = None, data: str | os.PathLike[str] | None = None) -> ModelPool:
    """Load the bundle once per device, each with the same options."""
    models: list[Model] = []
    try:
        for device in parse_devices(devices):
            models.append(load_model(source, device, options, methods=methods, data=data))
    except BaseException:
        for model in models:
            model.close()
        raise
    return ModelPool(models)


def load_model(
    source: str | os.PathLike[str] | ModelReader,
    device: str | Device | None = None,
    options: LoadOptions = _DEFAULTS,
    *,
    methods: Iterable[str] | None = None,
    data: str | os.PathLike[str] | None = None,
    open_seconds: float = 0.0,
    progress: LoadProgress | None = None,
) -> Model:
    """Load methods (all by default) onto `device`. Given an open reader, the
    Model takes it over (`open_seconds`: what opening it took, for the load
    timings); given a path, it opens and times it here.

    With `options.trusted_keys`, the bundle must carry a signature
    (`<bundle>.sig`) made by one of them; it is checked before any of the
    bundle's code is loaded, unless the reader checked it already.
    `progress(method, done, total)` hears how many bytes of each method's
    weights are up (for a progress bar)."""
    started = time.perf_counter()
    reader = open_model(source, data) if isinstance(source, (str, os.PathLike)) else source
    loaded: dict[str, Method] = {}
    shared = ConstantMemory()  # weights and state named alike in several methods are one storage
    try:
        if options.trusted_keys and reader.signature is None:
            reader.require_signature(options.trusted_keys)
        if isinstance(source, (str, os.PathLike)):
            open_seconds = time.perf_counter() - started
        specs = _selected(reader.manifest, methods)
        target = choose_device(specs, device)
        for spec in specs:
            loaded[spec.name] = Method.load(reader, spec, target, options, shared_constants=shared, progress=progress)
        _serialize_shared_state(loaded)
        if reader.signature is not None:
            reader.signature.cancel()  # what is loaded is checked; hash nothing more while the model runs
        return Model(reader, target, loaded, open_seconds, shared)
    except BaseException:
        for method in reversed(list(loaded.values())):
            method.close()
        shared.release()
        reader.close()
        raise


def _serialize_shared_state(methods: Mapping[str, Method]) -> None:
    """Stateful methods that name one storage (a KV cache a prefill and a decode
    method share) take turns: one lock for all of them, held for each call, so
    that no call reads state another is writing."""
    stateful = [method for method in methods.values() if method.stateful]
    segments = {method.spec.name: {constant.segment for constant in method.spec.constants} for method in stateful}
    sharing = [method for method in stateful if any(segments[method.spec.name] & segments[other.spec.name]
                                                    for other in stateful if other is not method)]
    if sharing:
        lock = threading.Lock()
        for method in sharing:
            method.state_lock = lock


def _selected(manifest: Manifest, names: Iterable[str] | None) -> list[MethodSpec]:
    if names is None:
        return list(manifest.methods.values())
    specs = []
    for name in names:
        if name not in manifest.methods:
            raise InputError(f"the bundle has no method {name!r}; it has: {', '.join(manifest.methods)}", subject="method")
        specs.append(manifest.methods[name])
    return specs
