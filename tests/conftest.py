"""Shared fixtures. Each compiled bundle is built once per test session (an
AOTInductor compile takes tens of seconds on the 2-core CI machine), for each
device it is asked for."""

from __future__ import annotations

import fcntl
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import CompiledModel, compile_fixture

from cuda_runner.runtime.devices import cuda_device_count

HAS_GPU = cuda_device_count() > 0

Compiler = Callable[[str, str], CompiledModel]


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
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
