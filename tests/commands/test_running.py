"""run_bundle as a library call: one validation pass per input."""

from __future__ import annotations

import numpy as np

import cuda_runner.io.inputs
import cuda_runner.runtime.method
from cuda_runner.commands.running import RunRequest, run_bundle
from cuda_runner.io.inputs import ArchiveFile, ArrayFile, GivenInputs


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
    calls.clear()  # .npy files are read as memory maps, which are NumPy arrays too
    np.save(tmp_path / "x.npy", np.ones((2, 16), np.float32))
    np.save(tmp_path / "bias.npy", np.zeros(8, np.float32))
    files = GivenInputs((ArrayFile(tmp_path / "x.npy", "x"), ArrayFile(tmp_path / "bias.npy", "bias")))
    assert run_bundle(RunRequest(dict_mlp_bundle.path, files)).verdict == "PASSED"
    assert calls == ["cuda_runner.io.inputs"]


def test_resolved_inputs_changed_after_resolving_are_checked_again(dict_mlp_bundle):
    """Method.run trusts a ResolvedInputs only while its arrays are those it
    checked: one replaced with another dtype or shape, or a ResolvedInputs made
    by hand naming the method, is checked like any inputs (the library would
    otherwise read past a short array or reinterpret float64 bytes)."""
    import pytest

    import cuda_runner
    from cuda_runner.errors import InputError
    from cuda_runner.io.inputs import RandomInputs, ResolvedInputs, resolve_inputs

    with cuda_runner.load(dict_mlp_bundle.path, "cpu") as model:
        method = model.method("forward")
        resolved = resolve_inputs(method.spec, RandomInputs(shapes={"x": (4, 16)}))
        assert method.run(resolved)["logits"].shape == (4, 8)
        for name, wrong in (("x", resolved.arrays["x"].astype(np.float64)), ("bias", np.zeros(1, np.float32)), ("x", np.zeros((100, 16), np.float32))):
            changed = resolve_inputs(method.spec, RandomInputs(shapes={"x": (4, 16)}))
            changed.arrays[name] = wrong
            with pytest.raises(InputError, match=name):
                method.run(changed)
        by_hand = ResolvedInputs({"x": np.zeros((2, 3), np.float64), "bias": np.zeros(8, np.float32)}, method=method.spec)
        with pytest.raises(InputError, match="'x'"):
            method.run(by_hand)
