"""GPU fixtures: CUDA bundles, compiled once per session on a machine with a GPU."""

from __future__ import annotations

import pytest


@pytest.fixture
def cuda_dict_mlp(compiled):
    return compiled("dict_mlp", "cuda")


@pytest.fixture
def cuda_embedder(compiled):
    return compiled("embedder", "cuda")


@pytest.fixture
def cuda_bf16(compiled):
    return compiled("bf16_mlp", "cuda")
