"""The CPU path: what only the host runtime does (memfd fallback, conversions, refusals)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import cuda_runner
from cuda_runner.errors import BundleError, ClosedError, InputError


def test_load_run_unload_cycles_in_a_fresh_process_leave_nothing_on_disk(dict_mlp_bundle, tmp_path):
    script = f"""
import os, numpy as np, cuda_runner, sys
before = set(os.listdir('/proc/self/fd'))
for _ in range(20):
    with cuda_runner.load({str(dict_mlp_bundle.path)!r}) as model:
        model.run({{"x": np.ones((2, 16), np.float32), "bias": np.zeros(8, np.float32)}})
after = set(os.listdir('/proc/self/fd'))
print(len(after - before), 'torch' in sys.modules)
"""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    leaked_fds, imported_torch = result.stdout.split()
    assert leaked_fds == "0"
    assert imported_torch == "False"  # the runtime needs libtorch, not the torch module
    assert list(tmp_path.iterdir()) == []  # the library never touched the file system


def test_wrong_inputs_are_refused_before_running(dict_mlp_bundle):
    with cuda_runner.load(dict_mlp_bundle.path) as model:
        good = np.ones((2, 16), np.float32)
        bias = np.zeros(8, np.float32)
        cases = {
            "expected dtype float32, got float64": {"x": good.astype(np.float64), "bias": bias},
            "expected rank 2": {"x": good[None], "bias": bias},
            "axis 1: expected size 16, got 15": {"x": good[:, :15], "bias": bias},
            "outside the compiled range [1, 64]": {"x": np.ones((65, 16), np.float32), "bias": bias},
            "missing 'bias'": {"x": good},
            "unexpected 'z'": {"x": good, "bias": bias, "z": bias},
            "'x' is an object array": {"x": good.astype(object), "bias": bias},
            "'x': dtype complex64 is not supported": {"x": good.astype(np.complex64), "bias": bias},
            "'bias' is an object array": {"x": good.tolist(), "bias": np.array([None] * 8)},
        }
        for message, inputs in cases.items():
            with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
                model.run(inputs)


def test_non_contiguous_and_big_endian_inputs_are_converted(dict_mlp_bundle):
    x = np.asfortranarray(np.random.default_rng(0).standard_normal((3, 16)).astype(">f4"))
    bias = np.arange(16, dtype=np.float32)[::2]
    with cuda_runner.load(dict_mlp_bundle.path) as model:
        outputs = model.run({"x": x, "bias": bias})
    expected = dict_mlp_bundle.eager(x.astype("<f4"), np.ascontiguousarray(bias))
    np.testing.assert_allclose(outputs["logits"], expected["logits"].numpy(), rtol=1e-5, atol=1e-5)


def test_manifest_that_disagrees_with_its_library_is_refused(dict_mlp_bundle, tmp_path):
    from dataclasses import replace

    from cuda_runner.format import open_bundle, write_bundle

    with open_bundle(dict_mlp_bundle.path) as reader:
        manifest = reader.manifest
        segments = {entry.name: bytes(reader.segment(entry.name)) for entry in manifest.segments}
    method = manifest.methods["forward"]
    lying = replace(manifest, methods={"forward": replace(method, outputs=method.outputs[:2])})
    write_bundle(tmp_path / "lying.bundle", lying, segments)
    with pytest.raises(BundleError, match="gives its library 2 inputs and 2 outputs, but the library has 2 and 3"):
        cuda_runner.load(tmp_path / "lying.bundle")


def test_closed_method_refuses_to_run(dict_mlp_bundle):
    model = cuda_runner.load(dict_mlp_bundle.path)
    method = model.method()
    model.close()
    with pytest.raises(cuda_runner.CudaRunnerError, match="closed"):
        method.run({"x": np.ones((1, 16), np.float32), "bias": np.zeros(8, np.float32)})


def _damaged_copy(source, target, segment_name):
    from cuda_runner.format import open_bundle

    with open_bundle(source) as reader:
        entry = reader.manifest.segment(segment_name)
    data = bytearray(source.read_bytes())
    data[entry.offset + entry.size // 2] ^= 0x01
    target.write_bytes(bytes(data))
    return target


def test_damaged_weights_are_refused_after_the_overlapped_check(dict_mlp_bundle, tmp_path):
    damaged = _damaged_copy(dict_mlp_bundle.path, tmp_path / "w.bundle", "forward_weights_blob")
    with pytest.raises(BundleError, match="'forward_weights_blob' is damaged"):
        cuda_runner.load(damaged)
    with cuda_runner.load(damaged, verify_weights=False) as model:  # the documented opt-out
        model.run({"x": np.ones((1, 16), np.float32), "bias": np.zeros(8, np.float32)})


def test_damaged_library_is_refused_even_without_weight_checks(dict_mlp_bundle, tmp_path):
    damaged = _damaged_copy(dict_mlp_bundle.path, tmp_path / "l.bundle", "forward_so_blob")
    with pytest.raises(BundleError, match="'forward_so_blob' is damaged"):
        cuda_runner.load(damaged, verify_weights=False)


def test_without_memfd_the_library_goes_through_a_private_directory_that_is_removed(dict_mlp_bundle, tmp_path, monkeypatch):
    import errno
    import tempfile

    def no_memfd(*_args):
        raise OSError(errno.ENOSYS, "memfd_create not allowed here")

    monkeypatch.setattr(os, "memfd_create", no_memfd)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with cuda_runner.load(dict_mlp_bundle.path) as model:
        assert list(tmp_path.iterdir()) == []  # loaded, then removed at once
        outputs = model.run({"x": np.ones((2, 16), np.float32), "bias": np.zeros(8, np.float32)})
    assert outputs["logits"].shape == (2, 8)


def test_a_bundle_with_a_very_long_name_loads(dict_mlp_bundle, tmp_path):
    import shutil

    path = tmp_path / ("b" * 235 + ".bundle")  # 242 bytes: near NAME_MAX, so no name derived from it may be longer
    shutil.copy(dict_mlp_bundle.path, path)
    inputs = {"x": np.random.default_rng(3).standard_normal((1, 16), dtype=np.float32), "bias": np.ones(8, np.float32)}
    with cuda_runner.load(path) as model:
        assert model.path == path
        assert list(model.methods) == ["forward"]
        got = model.run(inputs)["logits"]
    expected = dict_mlp_bundle.eager(inputs["x"], inputs["bias"])["logits"].numpy()
    assert got.shape == (1, 8)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_one_thread_keeps_using_one_lane(dict_mlp_bundle):
    with cuda_runner.load(dict_mlp_bundle.path, lanes=2) as model:
        method = model.method()
        used = []
        for _ in range(4):
            with method._lanes.borrow() as executor:
                used.append(id(executor))
        assert len(set(used)) == 1
    with pytest.raises(ClosedError):
        method.pinned_input("x", (1, 16))


def test_damaged_samples_are_refused_even_when_the_run_does_not_use_them(dict_mlp_bundle, tmp_path):
    """Found by scripts/fuzz_bundle.py: every segment a method references is checked before it runs."""
    damaged = _damaged_copy(dict_mlp_bundle.path, tmp_path / "s.bundle", "forward_sample_inputs")
    with pytest.raises(BundleError, match="'forward_sample_inputs' is damaged"):
        cuda_runner.load(damaged)
