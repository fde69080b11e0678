"""int4 weight-only matmuls (torchao's tile-packed layout, aten._weight_int4pack_mm)
compile to a library that calls libtorch's kernel: it runs on libtorch, which
`inspect` and the provider choice say, and matches eager."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import cli

import cuda_runner

pytestmark = pytest.mark.gpu

GROUP = 32


def _int4_module(torch):
    torch.manual_seed(0)
    n, k = 64, 128
    values = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
    packed_bytes = ((values[:, ::2] << 4) | values[:, 1::2]).to(torch.uint8)  # two 4-bit values per byte, as the packer wants
    weight = torch._convert_weight_to_int4pack(packed_bytes, 2)
    scales_and_zeros = (torch.rand(k // GROUP, n, 2, device="cuda") * 0.1).to(torch.bfloat16)

    class Int4Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("weight", weight)
            self.register_buffer("scales_and_zeros", scales_and_zeros)

        def forward(self, x):
            return torch._weight_int4pack_mm(x, self.weight, GROUP, self.scales_and_zeros)

    return Int4Linear().eval(), torch.randn(8, k, device="cuda").to(torch.bfloat16)


def test_an_int4_linear_runs_on_libtorch_and_matches_eager(tmp_path):
    torch = pytest.importorskip("torch")
    import ml_dtypes

    module, x = _int4_module(torch)
    with torch.no_grad():
        eager = module(x).float().cpu().numpy()
    path = tmp_path / "int4.bundle"
    cuda_runner.compile_module(module, (x,), path, device="cuda")
    inspected = json.loads(cli("inspect", str(path), "--json").stdout)["methods"]["forward"]
    assert inspected["needs_libtorch"] is True and "_weight_int4pack_mm" in inspected["provider_note"]
    with cuda_runner.load(path) as model:
        assert model.method().provider == "libtorch"
        output = model.run([x.float().cpu().numpy().astype(ml_dtypes.bfloat16)])["output_0"]
    error = float(np.abs(output.astype(np.float32) - eager).max())
    print(f"int4 weight-only linear: max abs error {error:.3g} (outputs up to {float(np.abs(eager).max()):.3g})")
    assert error <= 2e-2 * max(1.0, float(np.abs(eager).max()))
    # A CUDA graph of a libtorch method (captured through torch): the graph copies the input
    # in, and the output is downloaded after each launch; every replay gives the plain result.
    from cuda_runner.runtime.graphs import WARMUP_CALLS

    host = x.float().cpu().numpy().astype(ml_dtypes.bfloat16)
    with cuda_runner.load(path, cuda_graph=True) as graphed:
        replies = [graphed.run([host * (1 + call)])["output_0"] for call in range(WARMUP_CALLS + 3)]
        (captured,) = graphed.method()._lanes.first._graphs.values()
        assert captured.staged_outputs == [None] and captured.staged_inputs[0] is not None
    with cuda_runner.load(path) as model:
        for call, reply in enumerate(replies):
            np.testing.assert_array_equal(reply.view(np.uint16), model.run([host * (1 + call)])["output_0"].view(np.uint16))
