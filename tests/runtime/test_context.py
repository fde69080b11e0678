"""Starting the CUDA context early: which device a run will use, guessed
before the file is opened, and the CLI starting it before the run's imports."""

from __future__ import annotations

import os

import pytest
from forge import forge, method
from helpers import cli

from cuda_runner.format.source import device_types
from cuda_runner.runtime import context

G3_PROGRAM = "tests/data/executorch/g3_et151_torch211/model.pte"


@pytest.fixture
def started(monkeypatch) -> list[int]:
    """The device indexes start_context was asked for (no thread is made)."""
    calls: list[int] = []
    monkeypatch.setattr(context, "start_context", calls.append)
    return calls


def _bundle(tmp_path, device_type: str):
    path = tmp_path / f"{device_type}.bundle"
    path.write_bytes(forge({"methods": {"forward": method(device={"type": device_type})}}))
    return path


def test_device_types_reads_a_bundles_manifest_and_takes_a_program_for_cuda(tmp_path):
    assert device_types(_bundle(tmp_path, "cuda")) == {"cuda"}
    assert device_types(_bundle(tmp_path, "cpu")) == {"cpu"}
    assert device_types(G3_PROGRAM) == {"cuda"}


def test_device_types_is_empty_for_what_cannot_be_read(tmp_path):
    (tmp_path / "junk.bundle").write_bytes(b"not a bundle at all")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert device_types(tmp_path / "missing.bundle") == frozenset()
    assert device_types(tmp_path / "junk.bundle") == frozenset()
    assert device_types(fifo) == frozenset()  # and it returns: a FIFO is never opened for reading
    assert device_types(tmp_path) == frozenset()


@pytest.mark.parametrize(("requested", "expected"), [("cuda", [0]), ("cuda:3", [3]), ("cpu", []), ("gpu7", [])])
def test_a_requested_device_decides_whatever_the_file_says(tmp_path, started, requested, expected):
    context.start_context_for(str(_bundle(tmp_path, "cpu")), requested)
    assert started == expected


def test_without_a_request_the_files_own_device_decides(tmp_path, started):
    context.start_context_for(str(_bundle(tmp_path, "cpu")), None)
    context.start_context_for(str(tmp_path / "missing.bundle"), None)
    assert started == []
    context.start_context_for(str(_bundle(tmp_path, "cuda")), None)
    assert started == [0]


def test_the_run_command_starts_the_context_of_a_cuda_bundle(tmp_path, started):
    bundle = _bundle(tmp_path, "cuda")
    result = cli("run", str(bundle), "--random-inputs")
    assert result.returncode != 0  # a forged library: the run itself fails, after the context was started
    assert started == [0]
    started.clear()
    cli("run", str(bundle), "--random-inputs", "--device", "cpu")
    assert started == []


def test_a_batch_over_several_devices_leaves_the_contexts_to_its_workers(tmp_path, started):
    cli("run", str(_bundle(tmp_path, "cuda")), "--batch", str(tmp_path), "--out-dir", str(tmp_path / "out"), "--devices", "0,1")
    assert started == []


def test_a_real_context_thread_on_a_machine_without_a_gpu_ends_quietly():
    context.start_context(97)  # no such device here (or no driver at all): the thread gives up
    context.wait_for_context(97)
    context.wait_for_context(98)  # never started: returns at once


def test_the_hint_imports_nothing_heavy(tmp_path):
    """The context is started before the run's imports so that the two overlap:
    the CLI and the hint that starts it must not pull NumPy (or torch, CuPy) in first."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "import cuda_runner.cli.main\n"
        "from cuda_runner.runtime import context\n"
        "context.start_context = lambda index: None\n"
        "context.start_context_for(sys.argv[1], None)\n"
        "print(sorted(name for name in ('numpy', 'torch', 'cupy') if name in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(_bundle(tmp_path, "cuda"))], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_driver_is_loaded_without_holding_the_gil():
    """The context thread loads libcuda through libc's dlopen, a foreign call
    that frees the GIL, so the imports it overlaps keep running. The driver is
    not on this machine: a large library stands in, loaded in fresh processes,
    once by a thread while the main thread counts the pauses it sees, and once
    with ctypes.CDLL, which keeps the GIL for the whole load."""
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not os.path.exists(library):
        pytest.skip("no large library to load here")
    probe = (
        "import sys, threading, time\n"
        "from cuda_runner.runtime import context\n"
        "thread = threading.Thread(target=context._load_without_the_gil, args=(sys.argv[1],))\n"
        "gaps, last = [0.0], time.perf_counter()\n"
        "thread.start()\n"
        "while thread.is_alive():\n"
        "    now = time.perf_counter(); gaps.append(now - last); last = now\n"
        "print(max(gaps))\n"
    )
    held = "import ctypes, sys, time; t = time.perf_counter(); ctypes.CDLL(sys.argv[1]); print(time.perf_counter() - t)"
    longest_pause = float(subprocess.run([sys.executable, "-c", probe, library], capture_output=True, text=True, check=True).stdout)
    load_time = float(subprocess.run([sys.executable, "-c", held, library], capture_output=True, text=True, check=True).stdout)
    # With the GIL kept, the main thread would wait for the whole load.
    assert longest_pause < load_time / 4, (longest_pause, load_time)
