"""Shared weights on the GPU machine: two methods of one module compiled for
CUDA hold one device storage per shared weight, and both match eager."""

from __future__ import annotations

import numpy as np
import pytest

import cuda_runner
from cuda_runner.format.bundle import read_manifest
from cuda_runner.runtime import upload

pytestmark = pytest.mark.gpu


def test_two_cuda_methods_share_their_weight_and_match_eager(tmp_path, monkeypatch):
    import torch
    from models import PrefillDecode

    module = PrefillDecode(width=64, hidden=64, outputs=8, seed=12).eval()
    examples = {"forward": (torch.randn(5, 64),), "decode": (torch.randn(1, 64),)}
    path = tmp_path / "two.bundle"
    cuda_runner.compile_methods(module, examples, path, device="cuda")
    manifest = read_manifest(path)
    shared = manifest.shared_weights()
    segment = next(constant.segment for constant in manifest.methods["decode"].constants if constant.fqn == "shared.weight")
    assert shared[segment] == ["forward", "decode"]
    assert all(constant.device == "cuda" for spec in manifest.methods.values() for constant in spec.constants)
    with torch.no_grad():
        expected = {name: getattr(module.to("cuda"), name)(args[0].to("cuda")).cpu().numpy() for name, args in examples.items()}
    segments = {constant.segment for spec in manifest.methods.values() for constant in spec.constants}
    with cuda_runner.load(path, "cuda") as model:
        assert model.constant_storages == len(segments)
        for name, args in examples.items():
            result = model.run({"x": args[0].numpy()}, method=name)["output_0"]
            np.testing.assert_allclose(result, expected[name], rtol=1e-4, atol=1e-5)
    # Again with every storage through the pipelined upload, in chunks smaller than the storages.
    monkeypatch.setattr(upload, "PIPELINE_MIN_BYTES", 0)
    monkeypatch.setattr(upload, "CHUNK_BYTES", 256)
    heard: dict[str, int] = {}
    with cuda_runner.load(path, "cuda", progress=lambda method, done, total: heard.__setitem__(method, done)) as model:
        for name, args in examples.items():
            result = model.run({"x": args[0].numpy()}, method=name)["output_0"]
            np.testing.assert_allclose(result, expected[name], rtol=1e-4, atol=1e-5)
    assert heard["forward"] > 0  # the first method uploads the shared storages
