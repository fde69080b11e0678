"""run_bundle as a library call: one validation pass per input."""

from __future__ import annotations

import numpy as np

import cuda_runner.io.inputs
import cuda_runner.runtime.method
from cuda_runner.commands.running import RunRequest, run_bundle
from cuda_runner.io.inputs import ArchiveFile, GivenInputs


def test_inputs_are_checked_against_the_signature_once(dict_mlp_bundle, tmp_path, monkeypatch):
    """resolve_inputs checks them before anything loads; Method.run then trusts
    inputs resolved for its own method (and still checks anything else)."""
    calls: list[str] = []
    for module in (cuda_runner.io.inputs, cuda_runner.runtime.method):
        original = module.validate_inputs
        monkeypatch.setattr(module, "validate_inputs", lambda spec, given, original=original, where=module.__name__: (
            calls.append(where), original(spec, given))[1])
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, x=np.ones((2, 16), np.float32), bias=np.zeros(8, np.float32))
    result = run_bundle(RunRequest(dict_mlp_bundle.path, GivenInputs((ArchiveFile(inputs),))))
    assert result.verdict == "PASSED" and result.outputs["logits"].shape == (2, 8)
    assert calls == ["cuda_runner.io.inputs"]
