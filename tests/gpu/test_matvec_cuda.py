"""The matrix-vector kernel on the GPU: the kernel against F.linear over the
shapes, dtypes and layouts it takes, and standalone CUDA builds that ask for
it (cuda_runner.matvec=true), whose products of one row it takes over and
which still match eager; the option through the CLI, on and off."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import compile_with_option, run_cli
from models import compile_tiny_llama, scale_models

import cuda_runner
from cuda_runner.compile.matvec import OPTION

pytestmark = pytest.mark.gpu

# (N, K): the 1B decoder's shapes, and ones no tile divides
SHAPES = [(2048, 2048), (512, 2048), (2048, 8192), (32000, 2048), (7, 5), (1000, 300), (3, 4097)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("row_shape", [(), (1,), (1, 1)], ids=["vector", "row", "batch-row"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_the_kernel_computes_what_linear_does(shape, row_shape, bias, dtype):
    from cuda_runner.compile import matvec_kernel  # noqa: F401  (registers the operator)

    n, k = shape
    generator = torch.Generator("cuda").manual_seed(n + k)
    x = torch.randn((*row_shape, k), device="cuda", dtype=dtype, generator=generator)
    weight = torch.randn(n, k, device="cuda", dtype=dtype, generator=generator)
    b = torch.randn(n, device="cuda", dtype=dtype, generator=generator) if bias else None
    got = torch.ops.cuda_runner.matvec(x, weight, b)
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert got.shape == want.shape and got.dtype == dtype
    tolerance = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 8e-2}[dtype] * max(1.0, k ** 0.5 / 8)
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=1e-2)


def test_rows_and_weights_laid_out_otherwise_are_packed_first():
    from cuda_runner.compile import matvec_kernel  # noqa: F401

    x = torch.randn(64, 3, device="cuda")[:, 1]  # a column: stride 3
    weight = torch.randn(64, 10, device="cuda").t()  # [10, 64], rows not contiguous
    torch.testing.assert_close(torch.ops.cuda_runner.matvec(x, weight, None), F.linear(x, weight), atol=1e-4, rtol=1e-4)


def test_the_standalone_decoder_takes_its_products_over_and_matches_eager(tmp_path):
    config = scale_models.LLAMA_TINY
    path = tmp_path / "llama.bundle"
    module = compile_tiny_llama(path, {OPTION: True})
    methods = cuda_runner.read_manifest(path).methods
    # Seven projections a layer and the vocabulary head; a prompt of dynamic length keeps Inductor's GEMMs but for
    # its head, which reads the last position alone.
    assert methods["decode"].compile_options["matvec_products"] == 7 * config.layers + 1
    assert methods["prefill"].compile_options["matvec_products"] == 1
    assert "matvec_failed" not in methods["decode"].compile_options
    prompt = np.random.default_rng(3).integers(0, config.vocab, (1, 6), dtype=np.int64)
    eager = copy.deepcopy(module).cuda()
    with cuda_runner.load(path, "cuda") as model:
        positions = np.arange(prompt.shape[1])
        model.run({"tokens": prompt, "input_pos": positions}, "prefill")
        with torch.no_grad():
            eager.prefill(torch.from_numpy(prompt).cuda(), torch.from_numpy(positions).cuda())
        worst = 0.0
        for step in range(12):
            token, position = np.array([[step + 1]], np.int64), np.array([6 + step], np.int64)
            got = model.run({"tokens": token, "input_pos": position}, "decode")["output_0"].astype(np.float32)
            with torch.no_grad():
                want = eager.decode(torch.from_numpy(token).cuda(), torch.from_numpy(position).cuda()).float().cpu().numpy()
            worst = max(worst, float(np.abs(got - want).max()))
    print(f"tiny decoder, matrix-vector kernel: worst logit error {worst:.3g} over 12 decode steps (bfloat16)")
    assert worst < 5e-2


def test_the_option_turns_it_on_and_off_through_the_cli(tmp_path):
    torch.manual_seed(4)
    module = torch.nn.Sequential(torch.nn.Linear(96, 200), torch.nn.GELU(), torch.nn.Linear(200, 33, bias=False)).eval()
    x = torch.randn(1, 96)
    torch.export.save(torch.export.export(module, (x,)), tmp_path / "mlp.pt2")
    np.save(tmp_path / "x.npy", x.numpy())
    (tmp_path / "want").mkdir()
    with torch.no_grad():
        np.save(tmp_path / "want" / "output_0.npy", module(x).numpy())
    for setting, expected in (("true", 2), ("false", None)):
        bundle = tmp_path / f"{setting}.bundle"
        options = compile_with_option(tmp_path / "mlp.pt2", bundle, OPTION, setting)
        assert options.get("matvec_products") == expected and options[OPTION] == (setting == "true")
        assert "matvec_failed" not in options and options["standalone"] is True
        run = run_cli("run", str(bundle), "--inputs", str(tmp_path / "x.npy"), "--expected", str(tmp_path / "want"),
                      "--atol", "1e-4", "--rtol", "1e-3", "--out-dir", str(tmp_path / setting))
        assert run.returncode == 0, run.stderr
