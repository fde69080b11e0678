"""Shared fixtures. Each compiled bundle is built once per test session (an
AOTInductor compile takes tens of seconds on the 2-core CI machine), for each
device it is asked for."""

from __future__ import annotations

from collections.abc import Callable

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
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Compiler:
    """compiled(builder, device): a bundle of tests/models.py's `builder`, compiled once per session."""
    cache: dict[tuple[str, str], CompiledModel] = {}

    def get(builder: str, device: str = "cpu") -> CompiledModel:
        if (builder, device) not in cache:
            cache[builder, device] = compile_fixture(tmp_path_factory, builder, device)
        return cache[builder, device]

    return get


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
