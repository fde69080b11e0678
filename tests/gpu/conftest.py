"""GPU fixtures: CUDA bundles compiled once per session on the GPU machine."""

from __future__ import annotations

import pytest

from helpers import compile_fixture
from cuda_runner.runtime.devices import cuda_device_count


def pytest_collection_modifyitems(config, items):
    if cuda_device_count() > 0:
        return
    skip = pytest.mark.skip(reason="no CUDA device: GPU tests run on the GPU machine (scripts/gpu-test.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda_dict_mlp(tmp_path_factory):
    return compile_fixture(tmp_path_factory, "dict_mlp", device="cuda")


@pytest.fixture(scope="session")
def cuda_embedder(tmp_path_factory):
    return compile_fixture(tmp_path_factory, "embedder", device="cuda")


@pytest.fixture(scope="session")
def cuda_bf16(tmp_path_factory):
    return compile_fixture(tmp_path_factory, "bf16_mlp", device="cuda")
