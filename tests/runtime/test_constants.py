"""bind_constants (runtime/constants.py): the library's constant names are
matched on a thread of their own while the storages are copied. Stand-ins for
the container and the shim, CPU storages: what is checked is the order of
things, whatever the library."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from cuda_runner.arrays import SCALAR_TYPE_CODES
from cuda_runner.errors import BundleError
from cuda_runner.format.manifest import ConstantSpec
from cuda_runner.runtime import constants
from cuda_runner.runtime.container import ConstantInfo
from cuda_runner.runtime.devices import Device


class SlowContainer:
    """A library whose constant table takes `delay` seconds to read, and says when it was read."""

    def __init__(self, fqns: list[str], delay: float = 0.0):
        self.fqns, self.delay = fqns, delay
        self.release_after_delete: list[object] = []
        self.read_until = 0.0
        self.pairs: list[tuple[str, int]] = []

    def constants(self) -> list[ConstantInfo]:
        time.sleep(self.delay)
        self.read_until = time.monotonic()
        return [ConstantInfo(f"internal_{fqn}", fqn, SCALAR_TYPE_CODES["float32"], 16, False) for fqn in self.fqns]

    def bind_constants(self, pairs: list[tuple[str, int]]) -> None:
        self.pairs = pairs


class Shim:
    device_cuda, device_cpu = 1, 0

    @contextlib.contextmanager
    def capture(self, _):
        yield

    def delete_tensor_object(self, handle: int) -> None:
        pass


@pytest.fixture
def bind(monkeypatch):
    monkeypatch.setattr(constants, "wrap_memory", lambda shim, address, *rest: address)  # the shim's tensors, stood in for
    storage = memoryview(np.arange(4, dtype=np.float32).tobytes())

    def bind_constants(container: SlowContainer, fqns: list[str], memory: constants.ConstantMemory | None = None):
        specs = [ConstantSpec(fqn, f"segment_{fqn}", "float32", "cpu", 0, (4,), (1,)) for fqn in fqns]
        return constants.bind_constants(container, Device("cpu"), Shim(), specs, lambda name: storage, memory)

    return bind_constants


def _names_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("cuda-runner-names")]


def test_names_matched_beside_the_copies_bind_every_constant(bind, monkeypatch):
    container = SlowContainer(["a", "b"], delay=0.05)
    copy, copy_started = constants._copy_storages, []
    monkeypatch.setattr(constants, "_copy_storages", lambda *args: copy_started.append(time.monotonic()) or copy(*args))
    memory = bind(container, ["a", "b"])
    assert copy_started[0] < container.read_until  # the copy did not wait for the names
    assert sorted(name for name, _ in container.pairs) == ["internal_a", "internal_b"]
    assert len(memory.storages) == 2 and not _names_threads()
    memory.release()


def test_a_mismatch_is_raised_and_nothing_is_kept(bind):
    container = SlowContainer(["a"])
    with pytest.raises(BundleError, match="does not have"):
        bind(container, ["a", "stray"])
    assert not _names_threads()


def test_a_mismatch_is_told_rather_than_what_the_copy_met(bind, monkeypatch):
    def out_of_memory(*args):
        raise MemoryError("cudaErrorMemoryAllocation")

    monkeypatch.setattr(constants, "_copy_storages", out_of_memory)
    with pytest.raises(BundleError, match="does not have") as raised:
        bind(SlowContainer(["a"], delay=0.05), ["a", "stray"])
    assert isinstance(raised.value.__cause__, MemoryError)
    with pytest.raises(MemoryError):  # weights that fit: the copy's own error
        bind(SlowContainer(["a"]), ["a"])


def test_an_interrupt_during_the_copy_waits_for_the_names_thread(bind, monkeypatch):
    """Ctrl-C while the names are matched: the library they read is let go once
    the load fails, so the thread ends before the interrupt goes on."""
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(constants, "_copy_storages", interrupted)
    container = SlowContainer(["a"], delay=0.2)
    with pytest.raises(KeyboardInterrupt):
        bind(container, ["a"])
    raised_at = time.monotonic()
    assert container.read_until and container.read_until <= raised_at
    assert not _names_threads()




def test_gpu_storages_leave_their_registrations_for_later_and_nothing_outlives_them(monkeypatch):
    """The upload lets the mapping's registrations go after it (release_later); a reload of
    the state and the release of the memory (before the mapping may close) wait for that."""
    from cuda_runner.runtime import cuda, upload

    events: list[object] = []

    class Runtime:
        def setDevice(self, index):
            pass

        def malloc(self, size):
            return 1 << 20

        def free(self, pointer):
            events.append("free")

        def deviceSynchronize(self):
            pass

        def memcpy(self, destination, source, size, kind):
            events.append("copy")

    monkeypatch.setattr(cuda, "cuda_runtime", lambda: Runtime())
    monkeypatch.setattr(upload, "upload_all", lambda runtime, index, uploads, progress, **options: events.append(options))
    monkeypatch.setattr(constants, "wait_for_releases", lambda: events.append("wait"))
    stored = np.arange(4, dtype=np.float32).tobytes()
    specs = [ConstantSpec("w", "segment_w", "float32", "cuda", 0, (4,), (1,))]
    memory = constants.ConstantMemory()
    constants._copy_storages(memory, specs, Device("cuda"), lambda name: memoryview(stored), None)
    memory.reload(specs, lambda name: memoryview(stored))
    memory.release()
    assert events == [{"release_later": True}, "wait", "copy", "wait", "free"]
