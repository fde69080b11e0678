"""The matrix-vector kernel on the GPU: the kernel against F.linear over the
shapes, dtypes and layouts it takes, and standalone CUDA builds (where it is
on by default), whose products of one row it takes over and which still
match eager; the option through the CLI: on, off and left out."""

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


# (K, the weights' N): a 1B decoder's q/k/v group, gate/up pair and head, and shapes no tile divides
FUSED_SHAPES = [(2048, (2048, 512, 512)), (2048, (8192, 8192)), (2048, (32000,)), (8192, (2048,)), (100, (7, 5, 300)), (4097, (3, 3))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("form", ["products", "normed", "gated", "normed-gated", "residual", "normed-residual"])
@pytest.mark.parametrize("k, rows", FUSED_SHAPES, ids=lambda value: "x".join(map(str, value)) if isinstance(value, tuple) else str(value))
def test_the_fused_kernel_computes_what_the_graph_it_replaces_does(k, rows, form, dtype):
    """matvec_fused against the graph it stands for, its products computed in float64."""
    from cuda_runner.compile import matvec_kernel  # noqa: F401

    gated, residual_wanted = "gated" in form, "residual" in form
    if gated and len(rows) < 2:
        pytest.skip("a gated product reads two weights")
    generator = torch.Generator("cuda").manual_seed(k + sum(rows))
    x = torch.randn((1, 1, k), device="cuda", dtype=dtype, generator=generator)
    weights = [torch.randn(n, k, device="cuda", dtype=dtype, generator=generator) / k ** 0.5 for n in rows]
    weights = [weights[0], weights[0].flip(0)] if gated else weights[:1] if residual_wanted else weights
    norm = (torch.rand(k, device="cuda", generator=generator) + 0.5).to(dtype) if "normed" in form else None
    residual = torch.randn((1, 1, rows[0]), device="cuda", dtype=dtype, generator=generator) if residual_wanted else None
    got = torch.ops.cuda_runner.matvec_fused(x, weights, norm, 1e-5, residual, gated)
    want = _reference_in_double(x, weights, norm, residual, gated)
    assert [out.shape for out in got] == [out.shape for out in want] and all(out.dtype == dtype for out in got)
    tolerance = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}[dtype]
    for out, expected in zip(got, want):
        torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("form", ["products", "normed-gated", "normed-residual"])
@pytest.mark.parametrize("k, rows", FUSED_SHAPES, ids=lambda value: "x".join(map(str, value)) if isinstance(value, tuple) else str(value))
def test_the_kernel_that_fetches_weights_early_computes_the_same_bits(k, rows, form):
    """read_only_weights takes the kernel that loads its first tiles of weight
    before it waits for the launch ahead (eagerly, Triton launches it plainly):
    the same results, to the bit."""
    from cuda_runner.compile import matvec_kernel  # noqa: F401

    gated, residual_wanted = "gated" in form, "residual" in form
    if gated and len(rows) < 2:
        pytest.skip("a gated product reads two weights")
    generator = torch.Generator("cuda").manual_seed(k + len(rows))
    x = torch.randn((1, 1, k), device="cuda", dtype=torch.bfloat16, generator=generator)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) / k ** 0.5 for n in rows]
    weights = [weights[0], weights[0].flip(0)] if gated else weights[:1] if residual_wanted else weights
    norm = (torch.rand(k, device="cuda", generator=generator) + 0.5).to(torch.bfloat16) if "normed" in form else None
    residual = torch.randn((1, 1, rows[0]), device="cuda", dtype=torch.bfloat16, generator=generator) if residual_wanted else None
    plain = torch.ops.cuda_runner.matvec_fused(x, weights, norm, 1e-5, residual, gated)
    early = torch.ops.cuda_runner.matvec_fused(x, weights, norm, 1e-5, residual, gated, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, early, strict=True))


def _reference_in_double(x, weights, norm, residual, gated):
    """The fused graph's result with the products in float64 and the graph's roundings to x's dtype kept."""
    from cuda_runner.compile.matvec_fusion import rms_normed

    row = x if norm is None else rms_normed(x, norm, 1e-5)
    products = [F.linear(row.double(), weight.double()).to(x.dtype) for weight in weights]
    if gated:
        return [(F.silu(products[0]) * products[1]).double()]
    if residual is not None:
        return [(residual + products[0]).double()]
    return [product.double() for product in products]


@pytest.fixture(scope="module")
def tiny_decoder(tmp_path_factory):
    """The tiny decoder built the default way (standalone: the kernel is on where the single-row rule holds)."""
    path = tmp_path_factory.mktemp("matvec") / "llama.bundle"
    return path, compile_tiny_llama(path, {})


def test_the_standalone_decoder_takes_its_products_over_and_matches_eager(tiny_decoder):
    config = scale_models.LLAMA_TINY
    path, module = tiny_decoder
    methods = cuda_runner.read_manifest(path).methods
    # Seven projections a layer and the vocabulary head; a prompt of dynamic length keeps Inductor's GEMMs, its
    # head too: the one product of one row there (the last position's) is a small share of the weights.
    assert methods["decode"].compile_options["matvec_products"] == 7 * config.layers + 1
    # A launch a layer for q/k/v with their norm, o with its residual, gate/up with their norm and SiLU, and
    # down with its residual; one for the head with the final norm.
    assert methods["decode"].compile_options["matvec_launches"] == 4 * config.layers + 1
    assert "matvec_products" not in methods["prefill"].compile_options
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


STEPS_SCRIPT = """
import ctypes, sys
import numpy as np
import cuda_runner
from cuda_runner.runtime.providers import own_shim_path
path, graph, out = sys.argv[1], sys.argv[2] == "graph", sys.argv[3]
prompt = np.arange(1, 7, dtype=np.int64)[None]
logits = []
with cuda_runner.load(path, "cuda", cuda_graph=graph) as model:
    model.run({"tokens": prompt, "input_pos": np.arange(6)}, "prefill")
    for step in range(10):
        logits.append(model.run({"tokens": np.array([[step + 1]], np.int64), "input_pos": np.array([6 + step], np.int64)}, "decode")["output_0"])
shim = ctypes.CDLL(str(own_shim_path()))  # the library the runtime loaded
shim.cudarunner_shim_programmatic_launches.restype = ctypes.c_int64
np.save(out, np.stack(logits))
print(shim.cudarunner_shim_programmatic_launches())
"""


def _steps_with_and_without_programmatic_launches(path, tmp_path) -> dict:
    """Ten decode steps after a prefill, with the shim's programmatic launches on
    (CUDA_RUNNER_PDL unset) and off (=0), each with a CUDA graph and without:
    (programmatic launches made, logits) by (setting, mode)."""
    import os
    import subprocess
    import sys

    runs = {}
    for setting in ("1", "0"):
        for mode in ("graph", "calls"):
            out = tmp_path / f"{setting}-{mode}.npy"
            done = subprocess.run([sys.executable, "-c", STEPS_SCRIPT, str(path), mode, str(out)], capture_output=True, text=True,
                                  env={**os.environ, "CUDA_RUNNER_PDL": setting}, timeout=300)
            assert done.returncode == 0, done.stderr[-2000:]
            runs[setting, mode] = (int(done.stdout.split()[-1]), np.load(out))
    print({key: launches for key, (launches, _) in runs.items()})
    return runs


def _same_bits_and_launches_only_when_on(runs: dict) -> None:
    assert runs["1", "calls"][0] > 0 and runs["1", "graph"][0] > 0
    assert runs["0", "calls"][0] == 0 and runs["0", "graph"][0] == 0
    first = runs["0", "calls"][1]
    assert all(np.array_equal(logits, first) for _, logits in runs.values())


def test_programmatic_launches_change_no_bit_of_a_decode_step(tiny_decoder, tmp_path):
    """The shim launches the fused products as programmatic dependents or plainly,
    with a CUDA graph and without: the four give the same logits to the bit, and
    only the first two launch any kernel that way."""
    path, _ = tiny_decoder
    _same_bits_and_launches_only_when_on(_steps_with_and_without_programmatic_launches(path, tmp_path))


def test_inductor_kernels_asked_to_be_programmatic_dependents_change_no_bit_either(tmp_path):
    """cuda_runner.programmatic_inductor_kernels=true (compile/inductor_pdl.py): the
    step's RoPE and cache-write kernels wait before every access and are named
    for the shim, and the logits stay the same to the bit with the shim's
    programmatic launches on and off, graphed or not."""
    from cuda_runner.compile import inductor_pdl

    if not inductor_pdl.available(torch) or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("this torch or GPU takes no programmatic Inductor kernels")
    path = tmp_path / "llama.bundle"
    compile_tiny_llama(path, {inductor_pdl.OWN_OPTION: True})
    decode = cuda_runner.read_manifest(path).methods["decode"].compile_options
    print(f"decode: {decode.get('programmatic_inductor_kernels')} Inductor kernels named for programmatic launches")
    assert decode.get("programmatic_inductor_kernels", 0) >= 1 and decode[inductor_pdl.OPTION] is True
    assert "programmatic_inductor_kernels_failed" not in decode
    _same_bits_and_launches_only_when_on(_steps_with_and_without_programmatic_launches(path, tmp_path))


def test_a_chain_of_programmatic_launches_reads_what_each_launch_before_wrote():
    """The products of 4 decoder layers, each launch reading what the one before
    wrote, launched by Triton as programmatic dependents and plainly, eagerly
    and from a CUDA graph, with every written tensor filled with NaN before the
    measured run: the same bits either way, and finite (scripts/bench_step_overlap.py --check)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_step_overlap.py"
    spec = importlib.util.spec_from_file_location("bench_step_overlap", path)
    overlap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overlap)
    results = overlap.check_pdl(layer_count=4)
    assert all(result["equal to the bit"] and result["finite"] for result in results.values()), results


def test_the_option_turns_it_on_and_off_through_the_cli(tmp_path):
    torch.manual_seed(4)
    module = torch.nn.Sequential(torch.nn.Linear(96, 200), torch.nn.GELU(), torch.nn.Linear(200, 33, bias=False)).eval()
    x = torch.randn(1, 96)
    torch.export.save(torch.export.export(module, (x,)), tmp_path / "mlp.pt2")
    np.save(tmp_path / "x.npy", x.numpy())
    (tmp_path / "want").mkdir()
    with torch.no_grad():
        np.save(tmp_path / "want" / "output_0.npy", module(x).numpy())
    for setting, expected in (("true", 2), ("false", None), (None, 2)):  # None: the default, on
        bundle = tmp_path / f"{setting}.bundle"
        options = compile_with_option(tmp_path / "mlp.pt2", bundle, OPTION, setting)
        assert options.get("matvec_products") == expected and options.get(OPTION, True) == (setting != "false")
        assert "matvec_failed" not in options and options["standalone"] is True
        run = run_cli("run", str(bundle), "--inputs", str(tmp_path / "x.npy"), "--expected", str(tmp_path / "want"),
                      "--atol", "1e-4", "--rtol", "1e-3", "--out-dir", str(tmp_path / str(setting)))
        assert run.returncode == 0, run.stderr
