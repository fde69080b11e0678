"""The CPU path end to end: compiled here, run through the ctypes runtime, compared with eager."""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import cuda_runner
from cuda_runner.errors import BundleError, InputError


def test_dict_outputs_match_eager_at_several_batch_sizes(dict_mlp_bundle):
    with cuda_runner.load(dict_mlp_bundle.path) as model:
        assert model.device.type == "cpu"
        for batch in (1, 5, 64):
            x = np.random.default_rng(batch).standard_normal((batch, 16), dtype=np.float32)
            bias = np.linspace(-1, 1, 8, dtype=np.float32)
            outputs = model.run({"x": x, "bias": bias})
            expected = dict_mlp_bundle.eager(x, bias)
            assert list(outputs) == ["logits", "aux.loss", "aux.hidden"]
            np.testing.assert_allclose(outputs["logits"], expected["logits"].numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(outputs["aux.loss"], expected["aux"]["loss"].numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(outputs["aux.hidden"], expected["aux"]["hidden"].numpy(), rtol=1e-5, atol=1e-5)


def test_int64_inputs_bf16_and_strided_outputs_match_eager(embedder_bundle):
    ids = np.random.default_rng(0).integers(0, 50, (3, 6))
    scale = np.array(0.25, dtype=np.float32)
    with cuda_runner.load(embedder_bundle.path) as model:
        outputs = model.run([ids, scale])
    pooled_bf16, transposed, count = embedder_bundle.eager(ids, scale)
    values = list(outputs.values())
    assert values[0].dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(values[0].astype(np.float32), pooled_bf16.float().numpy(), rtol=1e-2, atol=1e-2)
    assert values[1].shape == (8, 3) and values[1].flags.c_contiguous
    np.testing.assert_allclose(values[1], transposed.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(values[2], count.numpy())


def test_bfloat16_model_matches_eager(bf16_bundle):
    x = np.random.default_rng(3).standard_normal((2, 32)).astype(ml_dtypes.bfloat16)
    with cuda_runner.load(bf16_bundle.path) as model:
        (output,) = model.run([x]).values()
    assert output.dtype == ml_dtypes.bfloat16
    eager = bf16_bundle.eager(x).float().numpy()
    np.testing.assert_allclose(output.astype(np.float32), eager, rtol=2e-2, atol=2e-2)


def test_two_bundles_loaded_together_give_their_own_results(dict_mlp_bundle, embedder_bundle):
    # RTLD_GLOBAL would let the second library bind the first one's symbols.
    first = cuda_runner.load(dict_mlp_bundle.path)
    second = cuda_runner.load(embedder_bundle.path)
    third = cuda_runner.load(dict_mlp_bundle.path)
    try:
        x = np.ones((2, 16), np.float32)
        bias = np.zeros(8, np.float32)
        a = first.run({"x": x, "bias": bias})["logits"]
        second.run([np.zeros((3, 6), np.int64), np.array(1.0, np.float32)])
        b = third.run({"x": x, "bias": bias})["logits"]
        np.testing.assert_array_equal(a, b)
    finally:
        second.close()
        first.close()
        third.close()


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
    with pytest.raises(BundleError, match="lists 2 inputs and 2 outputs, but the library has 2 and 3"):
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
