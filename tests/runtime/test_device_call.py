"""run_device's per-call glue in C (native/device_call.c), driven on CPU libraries.

The module takes the array types it reads and makes as parameters, so these
tests give it `FakeArray`, which has CuPy's constructor and the attributes it
reads, over host memory; the GPU suite runs it with CuPy on a device.
"""

from __future__ import annotations

import ctypes
import gc
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import cuda_runner
from cuda_runner.arrays import numpy_dtype
from cuda_runner.errors import ModelRuntimeError
from cuda_runner.runtime.providers import load_own_provider, own_shim_path

device_call = pytest.importorskip("cuda_runner._device_call", reason="built by pip install (scripts/test.sh)")
pytestmark = pytest.mark.skipif(own_shim_path() is None, reason="the shim is built by pip install (scripts/test.sh)")


class FakeMemory:
    """CuPy's UnownedMemory(address, nbytes, owner, device)."""

    def __init__(self, address: int, nbytes: int, owner: Any, device: int):
        self.address, self.nbytes, self.owner, self.device = address, nbytes, owner, device


class FakePointer:
    """CuPy's MemoryPointer(memory, offset)."""

    def __init__(self, memory: FakeMemory, offset: int):
        self.mem = memory
        self.ptr = memory.address + offset


class FakeArray:
    """CuPy's ndarray(shape, dtype, memptr, strides), over host memory."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, memptr: FakePointer, strides: tuple[int, ...] | None = None):
        self.shape, self.dtype, self.data = tuple(shape), np.dtype(dtype), memptr
        row_major = _row_major(self.shape, self.dtype.itemsize)
        self.strides = row_major if strides is None else tuple(strides)
        self.flags = SimpleNamespace(c_contiguous=self.strides == row_major)

    @classmethod
    def of(cls, array: np.ndarray) -> FakeArray:
        return cls(array.shape, array.dtype, FakePointer(FakeMemory(array.ctypes.data, array.nbytes, array, 0), 0), array.strides)

    def host(self) -> np.ndarray:
        """A copy of the elements, read through the address, shape and strides given."""
        span = self.data.mem.nbytes
        if span == 0:
            return np.empty(self.shape, self.dtype)
        base = np.frombuffer((ctypes.c_byte * span).from_address(self.data.ptr), np.uint8)
        return np.lib.stride_tricks.as_strided(base.view(self.dtype), self.shape, self.strides).copy()


def _row_major(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, running = [], itemsize
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


@pytest.fixture(scope="module")
def shim_counts():
    load_own_provider("cpu")
    library = ctypes.CDLL(str(own_shim_path()), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    count = library.cudarunner_shim_live_tensors
    count.restype = ctypes.c_int64
    return count


def _dtypes(shim: Any) -> dict[int, tuple[np.dtype, int]]:
    table = {}
    for code, name in shim.dtype_names.items():
        try:
            dtype = numpy_dtype(name)
        except Exception:
            continue
        table[code] = (dtype, dtype.itemsize)
    return table


def _native(method: Any, array_type: type = FakeArray, dtypes: dict | None = None) -> Any:
    invoker = method._lanes.first._invoker  # the lane's helper invoker: these tests reach into the runtime on purpose
    shim = invoker._shim
    return invoker, invoker.device_call(array_type, FakeMemory, FakePointer, _dtypes(shim) if dtypes is None else dtypes)


def _inputs(builder: str, batch: int) -> dict[str, np.ndarray]:
    generator = np.random.default_rng(batch)
    if builder == "dict_mlp":
        return {"x": generator.standard_normal((batch, 16), np.float32), "bias": generator.standard_normal(8, np.float32)}
    return {"ids": generator.integers(0, 50, (3, 6)), "scale": np.array(0.25, np.float32)}


@pytest.mark.parametrize("builder", ["dict_mlp", "embedder"])
def test_outputs_match_the_host_run_and_every_handle_is_freed(compiled, shim_counts, builder):
    """Two inputs, a batch that changes between calls (the frame's sizes are
    remade), and a non-contiguous output (embedder), which keeps its strides."""
    with cuda_runner.load(compiled(builder, "cpu").path, provider="shim") as model:
        method = model.method()
        _, native = _native(method)
        assert native is not None
        before = shim_counts()
        for batch in (4, 1, 7, 4):
            host = _inputs(builder, batch)
            expected = method.run(host)
            outputs = native.run([FakeArray.of(host[name]) for name in method._names])
            assert isinstance(outputs, list) and len(outputs) == len(expected)
            for output, (name, want) in zip(outputs, expected.items()):
                assert output.dtype == want.dtype, name
                np.testing.assert_array_equal(output.host(), want)
            assert native.live_keepers == len({id(output.data.mem.owner) for output in outputs})
            del outputs, output
            gc.collect()
            assert native.live_keepers == 0
            assert shim_counts() == before


def test_an_output_keeps_its_inputs_and_its_handle_until_it_goes(compiled, shim_counts):
    with cuda_runner.load(compiled("dict_mlp", "cpu").path, provider="shim") as model:
        method = model.method()
        _, native = _native(method)
        before = shim_counts()
        host = _inputs("dict_mlp", 2)
        given = [FakeArray.of(host[name]) for name in method._names]
        outputs = native.run(given)
        keepers = {id(output.data.mem.owner): output.data.mem.owner for output in outputs}
        assert {type(keeper).__name__ for keeper in keepers.values()} == {"Keeper"}
        expected = method.run(host)
        del given, host
        assert shim_counts() == before + len(keepers)  # the outputs' handles, owned by their keepers
        for output, want in zip(outputs, expected.values()):
            np.testing.assert_array_equal(output.host(), want)
        del outputs, output, keepers
        assert shim_counts() == before


def test_inputs_it_does_not_take_as_they_are_are_left_to_the_python_path(compiled):
    with cuda_runner.load(compiled("dict_mlp", "cpu").path, provider="shim") as model:
        method = model.method()
        _, native = _native(method)
        host = _inputs("dict_mlp", 4)
        given = [FakeArray.of(host["x"]), FakeArray.of(host["bias"])]
        assert native.run([host["x"], given[1]]) is None  # not the array type it was given
        transposed = np.asfortranarray(host["x"])
        assert native.run([FakeArray.of(transposed), given[1]]) is None  # not row-major
        with pytest.raises(ValueError, match="1 inputs for 2"):
            native.run(given[:1])
        with pytest.raises(TypeError):
            native.run(5)
        assert isinstance(native.run(given), list)  # and it still serves


def test_a_failed_call_returns_the_helpers_status_and_owns_nothing(compiled, shim_counts):
    """An input dtype the shim refuses: the helper stops before Run (status 1,
    input 0), and the invoker turns that into the error the Python path gives."""
    with cuda_runner.load(compiled("dict_mlp", "cpu").path, provider="shim") as model:
        method = model.method()
        invoker, _ = _native(method)
        frame = invoker._frame
        broken = device_call.DeviceCall(
            helper=ctypes.cast(invoker._call, ctypes.c_void_p).value, run=frame.run, container=frame.container, stream=frame.stream,
            device_type=frame.device_type, device_index=frame.device_index, input_dtypes=[99, 99], output_count=1,
            delete=ctypes.cast(invoker._shim.delete_tensor_object, ctypes.c_void_p).value, array_type=FakeArray,
            memory_type=FakeMemory, pointer_type=FakePointer, dtypes=_dtypes(invoker._shim), keep=None, error=ModelRuntimeError,
        )
        before = shim_counts()
        host = _inputs("dict_mlp", 3)
        status = broken.run([FakeArray.of(host["x"]), FakeArray.of(host["bias"])])
        assert status == 1 and broken.failed_index == 0
        with pytest.raises(ModelRuntimeError, match=r"create an input tensor handle \(input 0\)"):
            invoker.raise_failure(status, broken.failed_index, broken.run_status)
        assert shim_counts() == before


def test_an_output_dtype_without_an_array_dtype_is_refused_and_freed(compiled, shim_counts):
    with cuda_runner.load(compiled("dict_mlp", "cpu").path, provider="shim") as model:
        method = model.method()
        _, native = _native(method, dtypes={})
        before = shim_counts()
        host = _inputs("dict_mlp", 3)
        with pytest.raises(ModelRuntimeError, match="cannot return as a device array"):
            native.run([FakeArray.of(host["x"]), FakeArray.of(host["bias"])])
        gc.collect()
        assert shim_counts() == before and native.live_keepers == 0


def test_close_waits_for_the_last_output(compiled):
    """The lane's stream is let go only once no output made on it is left."""
    with cuda_runner.load(compiled("dict_mlp", "cpu").path, provider="shim") as model:
        method = model.method()
        _, native = _native(method)
        host = _inputs("dict_mlp", 2)
        outputs = native.run([FakeArray.of(host["x"]), FakeArray.of(host["bias"])])
        calls = []
        native.close(lambda: calls.append("let go"))
        assert calls == []
        with pytest.raises(RuntimeError, match="closed"):
            native.run([FakeArray.of(host["x"]), FakeArray.of(host["bias"])])
        del outputs
        assert calls == ["let go"]
        native.close(lambda: calls.append("again"))  # closing twice does nothing
        assert calls == ["let go"]

        _, idle = _native(method)
        idle.close(lambda: calls.append("at once"))
        assert calls == ["let go", "at once"]


def test_the_structures_are_the_helpers(compiled):
    from cuda_runner.runtime.invoke import _Frame, _Input, _Output

    assert device_call.layout() == (ctypes.sizeof(_Frame), ctypes.sizeof(_Input), ctypes.sizeof(_Output))


def _referents(keeper: Any) -> list[Any]:
    return gc.get_referents(keeper)


def test_only_an_output_that_views_an_input_keeps_the_inputs(compiled, shim_counts):
    """Aliased outputs share one keeper; the view of an input keeps the inputs
    alive, the others do not (an output fed back in must not keep every earlier one)."""
    import weakref

    with cuda_runner.load(compiled("views", "cpu").path, provider="shim") as model:
        method = model.method()
        _, native = _native(method)
        before = shim_counts()
        host = np.arange(12, dtype=np.float32).reshape(4, 3)
        given = FakeArray.of(host)
        alive = weakref.ref(given)
        doubled, again, view = native.run([given])
        assert doubled.data.mem.owner is again.data.mem.owner
        assert view.data.mem.owner is not doubled.data.mem.owner
        assert not any(isinstance(item, tuple) for item in _referents(doubled.data.mem.owner))
        assert (given,) in _referents(view.data.mem.owner)
        np.testing.assert_array_equal(doubled.host(), host * 2)
        np.testing.assert_array_equal(view.host(), host[1:])
        del given, host
        assert alive() is not None  # the view's keeper holds it
        del doubled, again
        np.testing.assert_array_equal(view.host(), np.arange(3, 12, dtype=np.float32).reshape(3, 3))
        del view
        assert alive() is None and shim_counts() == before


def test_a_keeper_in_a_cycle_is_collected(compiled, shim_counts):
    """An object that owns an input's memory and also holds the outputs: a cycle
    through the keeper, which the garbage collector breaks."""
    with cuda_runner.load(compiled("views", "cpu").path, provider="shim") as model:
        method = model.method()
        _, native = _native(method)
        before = shim_counts()
        for _ in range(20):
            host = np.arange(12, dtype=np.float32).reshape(4, 3)
            holder = SimpleNamespace(array=host, outputs=None)
            given = FakeArray(host.shape, host.dtype, FakePointer(FakeMemory(host.ctypes.data, host.nbytes, holder, 0), 0))
            holder.outputs = native.run([given])
            del host, holder, given
        gc.collect()
        assert native.live_keepers == 0 and shim_counts() == before


class _CallingBack(FakeArray):
    """An array whose shape getter runs `on_shape` first, once."""

    on_shape: Any = None

    @property  # type: ignore[override]
    def shape(self) -> tuple[int, ...]:
        hook, self.on_shape = self.on_shape, None
        if hook is not None:
            hook()
        return self._shape

    @shape.setter
    def shape(self, value: tuple[int, ...]) -> None:
        self._shape = value


def test_one_call_at_a_time(compiled):
    """A getter that calls back into the same device call is refused; a close
    made during a call waits for its end, and for its outputs, before letting
    the stream go."""
    with cuda_runner.load(compiled("dict_mlp", "cpu").path, provider="shim") as model:
        method = model.method()
        _, native = _native(method, array_type=_CallingBack)
        host = _inputs("dict_mlp", 2)
        given = [_CallingBack.of(host["x"]), _CallingBack.of(host["bias"])]
        refused, released, seen = [], [], []

        def call_back() -> None:
            try:
                native.run(given)
            except RuntimeError as error:
                refused.append(str(error))
            native.close(lambda: released.append("let go"))
            seen.append(list(released))

        given[0].on_shape = call_back
        outputs = native.run(given)
        assert refused == ["the device call is already running a call"]
        assert seen == [[]] and released == []  # not during the call, nor while its outputs live
        assert isinstance(outputs, list)
        del outputs
        assert released == ["let go"]
