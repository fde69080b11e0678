"""One loaded method: its library, container, executor and signature."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..dtypes import dtype_name
from ..errors import BundleError, CudaRunnerError, InputError
from ..format.bundle import BundleReader
from ..format.manifest import MethodSpec
from ..validation import check_inputs
from .container import Container
from .devices import Device
from .host import CpuExecutor
from .library import ModelLibrary
from .shim import load_shim

Inputs = Mapping[str, Any] | Sequence[Any]


class Method:
    """A method ready to run. Build it with Method.load; close it when done."""

    def __init__(self, spec: MethodSpec, device: Device, library: ModelLibrary, container: Container, executor: Any, timings: dict[str, float]):
        self.spec = spec
        self.device = device
        self._library = library
        self._container = container
        self._executor = executor
        self.load_timings = timings
        self._dtypes = [input_spec.dtype for input_spec in spec.inputs]
        self._accepted: set[tuple] = set()  # input signatures already validated

    @classmethod
    def load(cls, reader: BundleReader, spec: MethodSpec, device: Device, *, verify_weights: bool = True, cuda_graph: bool = False) -> Method:
        timings: dict[str, float] = {}
        started = time.perf_counter()
        library_bytes = reader.read_verified(spec.library_segment)  # always checked, before it is loaded
        timings["verify"] = time.perf_counter() - started
        weights = reader.segment(spec.weights_segment, verify=False) if spec.weights_segment else memoryview(b"")
        # Weights are data, not code: they are checked on other threads while
        # they load, and the method is refused if the check fails.
        weights_check = reader.verify_in_background(spec.weights_segment) if verify_weights and spec.weights_segment else None
        shim = load_shim(device.type)
        started = time.perf_counter()
        library = ModelLibrary(library_bytes, f"{spec.name}@{reader.path.name}")
        timings["load_library"] = time.perf_counter() - started
        container = executor = None
        try:
            executor = _executor(shim, device)
            started = time.perf_counter()
            container = Container(library, str(device))
            _check_counts(spec, container)
            timings["create_container"] = time.perf_counter() - started
            started = time.perf_counter()
            executor.load_weights(container, weights)
            timings["load_weights"] = time.perf_counter() - started
            if weights_check is not None:
                started = time.perf_counter()
                weights_check.result()
                timings["verify_weights_wait"] = time.perf_counter() - started
            if cuda_graph:
                executor = _graph_executor(executor, container, spec, timings)
        except BaseException:
            if weights_check is not None:
                weights_check.cancel()
                with contextlib.suppress(BaseException):
                    weights_check.result()  # no thread may read the mapping once it closes
            _close_parts(executor, container, library)
            raise
        finally:
            weights.release()
        return cls(spec, device, library, container, executor, timings)

    @property
    def stream(self) -> Any:
        """The CUDA stream every copy and run of this method is ordered on (None on CPU)."""
        return getattr(self._executor, "stream", None)

    def run(self, inputs: Inputs, *, phases: dict[str, float] | None = None) -> dict[str, np.ndarray]:
        """NumPy (or array-like) inputs by name or position; NumPy outputs by name.

        Pass a dict as `phases` to have it filled with the time of the input
        copies, the model and the output copies (CUDA events on a GPU)."""
        arrays = self._host_arrays(inputs)
        self._check({name: (dtype_name(array.dtype), array.shape) for name, array in arrays.items()})
        ordered = [arrays[input_spec.name] for input_spec in self.spec.inputs]
        container = self._live_container()
        return self._named(self._executor.run(container, self._dtypes, ordered, phases))

    def pinned_input(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A page-locked host array for input `name` (CUDA only). Fill it and pass
        it to run(): the copy to the GPU then skips the host-side staging copy,
        which for large inputs costs far more than the transfer itself.
        The array stays valid until the method is closed."""
        spec = self.spec.input(name)
        if spec is None:
            raise InputError(f"method {self.spec.name!r} has no input {name!r}")
        if not hasattr(self._executor, "pinned_input"):
            raise InputError("pinned inputs need a method loaded on a CUDA device")
        if shape is None:
            if not all(isinstance(entry, int) for entry in spec.shape):
                raise InputError(f"input {name!r} has dynamic dimensions {spec.shape_text()}; give its shape")
            shape = tuple(spec.shape)
        return self._executor.pinned_input(self.spec.inputs.index(spec), tuple(shape), spec.dtype)

    def run_device(self, inputs: Inputs) -> dict[str, Any]:
        """CuPy arrays in, CuPy arrays out, no host copies (CUDA only).

        bfloat16 travels as uint16 CuPy arrays holding the bits. Outputs are
        ordered on `self.stream`: synchronize it, or wait on it, before
        using them on another stream."""
        if not hasattr(self._executor, "run_device"):
            raise InputError("run_device needs a method loaded on a CUDA device, without --cuda-graph")
        cupy = self._executor.cupy
        arrays = {name: _as_cupy(cupy, name, array) for name, array in self._by_name(inputs).items()}
        given = {}
        for name, array in arrays.items():
            declared = self.spec.input(name)
            given[name] = (_device_dtype_name(array, declared.dtype if declared else None), array.shape)
        self._check(given)
        container = self._live_container()
        ordered = [arrays[input_spec.name] for input_spec in self.spec.inputs]
        return self._named(self._executor.run_device(container, self._dtypes, ordered))

    def _check(self, given: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        """Validate against the signature; a signature seen valid before is not re-derived."""
        key = tuple(given.items())
        if key in self._accepted:
            return
        check_inputs(self.spec, given)
        if len(self._accepted) < 256:
            self._accepted.add(key)

    def _host_arrays(self, inputs: Inputs) -> dict[str, np.ndarray]:
        arrays = {}
        for name, value in self._by_name(inputs).items():
            if hasattr(value, "__cuda_array_interface__"):
                raise InputError(f"input {name!r} is a device array; use run_device for device-resident inputs")
            array = np.asarray(value)
            if array.dtype == object:
                raise InputError(f"input {name!r} is an object array, which is refused")
            try:
                dtype_name(array.dtype)
            except InputError:
                raise InputError(f"input {name!r}: dtype {array.dtype} is not supported") from None
            arrays[name] = array
        return arrays

    def _by_name(self, inputs: Inputs) -> dict[str, Any]:
        if isinstance(inputs, Mapping):
            return dict(inputs)
        values = list(inputs)
        names = [input_spec.name for input_spec in self.spec.inputs]
        if len(values) != len(names):
            raise InputError(f"method {self.spec.name!r} takes {len(names)} input(s) ({', '.join(names) or 'none'}), got {len(values)}")
        return dict(zip(names, values))

    def _named(self, outputs: list[Any]) -> dict[str, Any]:
        return {output_spec.name: output for output_spec, output in zip(self.spec.outputs, outputs)}

    def _live_container(self) -> Container:
        if self._container is None:
            raise CudaRunnerError(f"method {self.spec.name!r} is closed")
        return self._container

    def close(self) -> None:
        """Release in a safe order: finish queued work, delete the container, unload the library."""
        executor, container, library = self._executor, self._container, self._library
        self._executor = self._container = self._library = None
        _close_parts(executor, container, library)

    def __enter__(self) -> Method:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _executor(shim: Any, device: Device) -> Any:
    if device.type == "cpu":
        return CpuExecutor(shim)
    from .cuda import CudaExecutor

    return CudaExecutor(shim, device.index)


def _graph_executor(executor: Any, container: Container, spec: MethodSpec, timings: dict[str, float]) -> Any:
    if getattr(executor, "runtime", None) is None:
        raise InputError("--cuda-graph needs a CUDA device")
    from .graphs import CudaGraphExecutor

    started = time.perf_counter()
    graph = CudaGraphExecutor(executor, container, spec)
    timings["capture_graph"] = time.perf_counter() - started
    return graph


def _check_counts(spec: MethodSpec, container: Container) -> None:
    # A wrong count given to Run terminates the process, so a manifest that
    # disagrees with its library is refused here, before any Run.
    if container.num_inputs != len(spec.inputs) or container.num_outputs != len(spec.outputs):
        raise BundleError(
            f"method {spec.name!r}: the manifest lists {len(spec.inputs)} inputs and {len(spec.outputs)} outputs, "
            f"but the library has {container.num_inputs} and {container.num_outputs}"
        )


def _close_parts(executor: Any, container: Container | None, library: ModelLibrary | None) -> None:
    if executor is not None:
        executor.close()
    if container is not None:
        container.delete()
    if library is not None:
        library.close()


def _as_cupy(cupy: Any, name: str, array: Any) -> Any:
    if isinstance(array, cupy.ndarray):
        return array
    if not hasattr(array, "__cuda_array_interface__"):
        raise InputError(f"input {name!r} is not a CUDA array (CuPy, or anything with __cuda_array_interface__)")
    return cupy.asarray(array)


def _device_dtype_name(array: Any, expected: str | None) -> str:
    """CuPy has no bfloat16: a bfloat16 input travels as its uint16 bits."""
    try:
        name = dtype_name(array.dtype)
    except (InputError, TypeError):
        return str(array.dtype)
    return "bfloat16" if expected == "bfloat16" and name == "uint16" else name
