"""Shared fixtures. Each compiled bundle is built once per test session (an
AOTInductor compile takes tens of seconds on the 2-core CI machine), for each
device it is asked for."""

from __future__ import annotations

import fcntl
import os

# Cheaper C++ builds for every AOTInductor compile of the session (the
# fixtures here, and the compiles the tests run through the command line,
# whose processes inherit this environment): the generated wrapper (the
# model's run function and AOTInductor's runtime headers, most of each
# compile's C++ time) at -O0 instead of -O1, and without line tables (-g1).
# The kernels keep -O3, and what a bundle holds and how it is loaded and
# called are the same; a compile went from about 13 to 9.5 CPU-seconds, and
# the first one, which precompiles the headers, from 58 to 45. Set before
# torch is imported: Inductor reads them once, at import.
os.environ.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")
os.environ.setdefault("AOT_INDUCTOR_ENABLE_LINE_TABLES", "0")
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import CompiledModel, compile_fixture

from cuda_runner.runtime.devices import cuda_device_count

HAS_GPU = cuda_device_count() > 0

Compiler = Callable[[str, str], CompiledModel]


# Files whose tests must run on one worker, in order (state built once per
# module, and a later test using what an earlier one wrote). xdist's own
# xdist_group mark groups nothing under pytest 9: it renames item._nodeid,
# which pytest 9 no longer reads. The scheduler below groups by file instead.
# test_written_state's tests all use one compiled fixture: on two workers, the
# second waited for the first's compile while its own core idled.
# tests/scale's decoder tests share one compile of two methods (about 35 s here) the same way.
SAME_WORKER = {"tests/test_readme.py": "readme", "tests/runtime/test_written_state.py": "written_state",
               "tests/scale/test_scale_models.py": "scale"}


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, with SAME_WORKER's files each one unit of work. Units
    are handed out largest first, then in collection order (heavy tests first,
    see pytest_collection_modifyitems)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FileGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SAME_WORKER.get(nodeid.split("::", 1)[0]) or super()._split_scope(nodeid)

    return FileGroups(config, log)


def pytest_collection_modifyitems(config, items):
    # Long tests start first, so that the two workers end together instead of
    # one running a long test alone at the end (a stable sort: the same order
    # on every worker, as xdist requires).
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
    if HAS_GPU:
        if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
            alone = pytest.mark.skip(reason="measures the whole GPU: run with no other test process on it (scripts/gpu-test.sh does)")
            for item in items:
                if "whole_device" in item.keywords:
                    item.add_marker(alone)
        return
    skip = pytest.mark.skip(reason="no CUDA device: GPU tests run on a GPU machine (scripts/gpu-test.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Compiler:
    """compiled(builder, device): a bundle of tests/models.py's `builder`, compiled
    once per session: with pytest-xdist, one worker compiles it (under a file
    lock, in the folder all workers share) and the others reuse it."""
    cache: dict[tuple[str, str], CompiledModel] = {}
    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent

    def get(builder: str, device: str = "cpu") -> CompiledModel:
        if (builder, device) not in cache:
            cache[builder, device] = _compile_once(shared, builder, device)
        return cache[builder, device]

    return get


def _compile_once(shared: Path, builder: str, device: str) -> CompiledModel:
    import models

    folder = shared / f"fixture-{builder}-{device}"
    folder.mkdir(exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be compiling it right now
        path = folder / f"{builder}.bundle"
        if not path.exists():
            compile_fixture(folder, builder, device)
    module, args, _ = models.BUILDERS[builder]()  # the same seeded module the bundle was made from
    return CompiledModel(path, module, args)


# The device a test runs on, for tests written once for both.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def dict_mlp_bundle(compiled: Compiler) -> CompiledModel:
    return compiled("dict_mlp", "cpu")


@pytest.fixture
def embedder_bundle(compiled: Compiler) -> CompiledModel:
    return compiled("embedder", "cpu")


@pytest.fixture
def bf16_bundle(compiled: Compiler) -> CompiledModel:
    return compiled("bf16_mlp", "cpu")
