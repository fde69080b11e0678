"""Each fixture model, compiled for each device, against eager PyTorch on that device."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from helpers import to_tensor

import cuda_runner


def _eager(compiled, device, *arrays):
    import torch

    module = compiled.module.to(device)
    with torch.no_grad():
        result = module(*[to_tensor(torch, array).to(device) for array in arrays])
    return torch.utils._pytree.tree_map(lambda tensor: tensor.cpu(), result)


def test_float32_dynamic_batch_and_dict_outputs(compiled, device):
    model_source = compiled("dict_mlp", device)
    tolerance = 1e-5 if device == "cpu" else 1e-4
    with cuda_runner.load(model_source.path) as model:
        assert model.device.type == device
        for batch in (1, 5, 64):
            x = np.random.default_rng(batch).standard_normal((batch, 16), dtype=np.float32)
            bias = np.linspace(-1, 1, 8, dtype=np.float32)
            outputs = model.run({"x": x, "bias": bias})
            expected = _eager(model_source, device, x, bias)
            assert list(outputs) == ["logits", "aux.loss", "aux.hidden"]
            np.testing.assert_allclose(outputs["logits"], expected["logits"].numpy(), rtol=tolerance, atol=tolerance)
            np.testing.assert_allclose(outputs["aux.loss"], expected["aux"]["loss"].numpy(), rtol=tolerance, atol=tolerance)
            np.testing.assert_allclose(outputs["aux.hidden"], expected["aux"]["hidden"].numpy(), rtol=tolerance, atol=tolerance)


def test_int64_inputs_bf16_and_strided_outputs(compiled, device):
    model_source = compiled("embedder", device)
    ids = np.random.default_rng(0).integers(0, 50, (3, 6))
    scale = np.array(0.25, dtype=np.float32)
    with cuda_runner.load(model_source.path) as model:
        pooled, transposed, count = model.run([ids, scale]).values()
    eager = _eager(model_source, device, ids, scale)
    assert pooled.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(pooled.astype(np.float32), eager[0].float().numpy(), rtol=1e-2, atol=1e-2)
    assert transposed.shape == (8, 3) and transposed.flags.c_contiguous
    np.testing.assert_allclose(transposed, eager[1].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(count, eager[2].numpy())


def test_bfloat16_model(compiled, device):
    model_source = compiled("bf16_mlp", device)
    x = np.random.default_rng(3).standard_normal((2, 32)).astype(ml_dtypes.bfloat16)
    with cuda_runner.load(model_source.path) as model:
        (output,) = model.run([x]).values()
    assert output.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(output.astype(np.float32), _eager(model_source, device, x).float().numpy(), rtol=2e-2, atol=2e-2)
    if device == "cuda":  # CuPy has no bfloat16: device arrays carry its bits as uint16
        import cupy

        with cuda_runner.load(model_source.path) as model:
            (resident,) = model.run_device([cupy.asarray(x.view(np.uint16))]).values()
            model.method().stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(resident).view(ml_dtypes.bfloat16), output)


def test_two_bundles_loaded_together_give_their_own_results(compiled, device):
    """RTLD_GLOBAL would let the second library bind the first one's symbols."""
    first = cuda_runner.load(compiled("dict_mlp", device).path)
    second = cuda_runner.load(compiled("embedder", device).path)
    third = cuda_runner.load(compiled("dict_mlp", device).path)
    try:
        x, bias = np.ones((2, 16), np.float32), np.zeros(8, np.float32)
        a = first.run({"x": x, "bias": bias})["logits"]
        second.run([np.zeros((3, 6), np.int64), np.array(1.0, np.float32)])
        b = third.run({"x": x, "bias": bias})["logits"]
        np.testing.assert_array_equal(a, b)
        if device == "cuda":
            assert first.method().stream.ptr != second.method().stream.ptr  # one stream per method
    finally:
        second.close()
        first.close()
        third.close()


def test_big_endian_and_fortran_inputs(compiled, device):
    model_source = compiled("dict_mlp", device)
    x = np.asfortranarray(np.random.default_rng(4).standard_normal((3, 16)).astype(">f4"))
    bias = np.linspace(-1, 1, 8).astype(">f4")
    with cuda_runner.load(model_source.path) as model:
        swapped = model.run({"x": x, "bias": bias})
        native = model.run({"x": np.ascontiguousarray(x, dtype="<f4"), "bias": bias.astype("<f4")})
    np.testing.assert_array_equal(swapped["logits"], native["logits"])
