"""Shared fixtures. Compiled bundles are built once per test session: an
AOTInductor compile takes tens of seconds on the 2-core CI machine."""

from __future__ import annotations

import pytest

from helpers import CompiledModel, compile_fixture


@pytest.fixture(scope="session")
def dict_mlp_bundle(tmp_path_factory: pytest.TempPathFactory) -> CompiledModel:
    return compile_fixture(tmp_path_factory, "dict_mlp")


@pytest.fixture(scope="session")
def embedder_bundle(tmp_path_factory: pytest.TempPathFactory) -> CompiledModel:
    return compile_fixture(tmp_path_factory, "embedder")


@pytest.fixture(scope="session")
def bf16_bundle(tmp_path_factory: pytest.TempPathFactory) -> CompiledModel:
    return compile_fixture(tmp_path_factory, "bf16_mlp")
