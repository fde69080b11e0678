"""What the matrix-vector rewrite folds into its launches (compile/matvec_fusion.py):
the RMS norm before a decoder's products, SwiGLU's gate, the residual after,
and products of one row grouped; what it leaves alone because the graph
computes something else; and that the rewritten graph computes what it did.
The kernels are stand-ins of the same schemas (test_matvec.py) computing
matvec_fusion.reference in torch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import MethodOf, scale_models
from test_matvec import _rewrite


def _targets(graph_module: torch.fx.GraphModule) -> list[str]:
    return [str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"]


def _rewritten(module: torch.nn.Module, *inputs: torch.Tensor):
    """(what the rewrite did, the rewritten graph module), after checking it computes what the module did."""
    graph_module = torch.export.export(module.eval(), inputs).module()
    with torch.no_grad():
        before = copy.deepcopy(graph_module)(*inputs)  # a copy: a module that writes its buffers starts the same both times
        used = _rewrite(graph_module)
        torch.testing.assert_close(graph_module(*inputs), before, atol=0, rtol=0)
    return used, graph_module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_layer_is_four_launches_with_its_norms_gate_and_residuals(dtype):
    config = scale_models.LLAMA_TINY
    model = scale_models.LlamaDecoder(config, dtype).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.5)
    used, graph_module = _rewritten(MethodOf(model, "decode"), *scale_models.llama_examples(config, 6)["decode"])
    layers = config.layers
    assert (used.products, used.launches) == (7 * layers + 1, 4 * layers + 1)
    assert (used.norms, used.gated, used.residuals) == (2 * layers + 1, layers, 2 * layers)
    targets = _targets(graph_module)
    assert not {"aten.rsqrt.default", "aten.silu.default", "aten.mean.dim"} & set(targets)


class _Block(torch.nn.Module):
    """A norm, products of its output, and what follows them, spelt as the test asks."""

    def __init__(self, dim: int = 32, ffn: int = 48, spelling: str = "llama", products: int = 2):
        super().__init__()
        self.spelling = spelling
        self.norm = torch.nn.Parameter(torch.rand(dim) + 0.5)
        self.projections = torch.nn.ModuleList(torch.nn.Linear(dim, ffn, bias=False) for _ in range(products))
        self.down = torch.nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        if self.spelling == "layer-norm":
            row = F.layer_norm(x, x.shape[-1:], self.norm)
        else:
            as_float = x.to(torch.float32)
            mean_square = as_float.pow(2).mean(-1, keepdim=True)
            normed = as_float * torch.rsqrt(mean_square if self.spelling == "no-eps" else mean_square + 1e-6)
            # Hugging Face's Llama writes weight * normed; the decoder here normed * weight.
            row = self.norm * normed.to(x.dtype) if self.spelling == "hf" else normed.to(x.dtype) * self.norm
        outputs = [projection(row) for projection in self.projections]
        if self.spelling == "gate-read-twice":
            return self.down(F.silu(outputs[0]) * outputs[1]) + outputs[0].sum()
        if self.spelling == "broadcast-residual":
            return self.down(F.silu(outputs[0]) * outputs[1]) + x.mean(-1, keepdim=True)
        if len(outputs) > 2:
            return torch.cat(outputs, -1)
        return x + self.down(F.silu(outputs[0]) * outputs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spelling", ["llama", "hf"])
def test_the_norm_gate_and_residual_are_taken_however_the_norm_is_spelt(spelling, dtype):
    block = _Block(spelling=spelling).to(dtype)
    used, _ = _rewritten(block, torch.randn(1, 1, 32, dtype=dtype))
    assert (used.products, used.launches, used.norms, used.gated, used.residuals) == (3, 2, 1, 1, 1)


@pytest.mark.parametrize("case, block, expected", [
    # (norms, gated, residuals) taken
    ("a norm with no epsilon", _Block(spelling="no-eps"), (0, 1, 1)),
    ("layer norm", _Block(spelling="layer-norm"), (0, 1, 1)),
    ("the gate read by more than the SiLU", _Block(spelling="gate-read-twice"), (1, 0, 0)),
    ("a residual that broadcasts", _Block(spelling="broadcast-residual"), (1, 1, 0)),
])
def test_what_the_graph_computes_otherwise_is_left_to_inductor(case, block, expected):
    used, _ = _rewritten(block, torch.randn(1, 1, 32))
    assert (used.norms, used.gated, used.residuals) == expected, case


def test_products_of_one_row_share_launches_three_at_most():
    used, graph_module = _rewritten(_Block(products=4), torch.randn(1, 1, 32))
    # Four products of the normed row, concatenated: two launches (three and one), each norming the row itself.
    assert (used.products, used.launches, used.norms) == (4, 2, 2)
    assert _targets(graph_module).count("aten.rsqrt.default") == 0


def test_a_decomposed_graph_keeps_the_plain_kernel_per_product():
    """run_decompositions writes a Linear as mm of a [1, K] view: the patterns are matched on the exported form only."""
    config = scale_models.LLAMA_TINY
    model = scale_models.LlamaDecoder(config, torch.float32).eval()
    program = torch.export.export(MethodOf(model, "decode"), scale_models.llama_examples(config, 6)["decode"]).run_decompositions()
    graph_module = program.module()
    examples = scale_models.llama_examples(config, 6)["decode"]
    with torch.no_grad():
        before = graph_module(*examples)
        used = _rewrite(graph_module)
        torch.testing.assert_close(graph_module(*examples), before)
    assert used.products == used.launches == 7 * config.layers + 1


class _WrittenBetween(torch.nn.Module):
    """A cache written in place (as a decoder writes its KV cache) between what a launch would read."""

    def __init__(self, case: str, dim: int = 32):
        super().__init__()
        self.case = case
        self.norm = torch.nn.Parameter(torch.rand(dim) + 0.5)
        self.q, self.k = torch.nn.Linear(dim, dim, bias=False), torch.nn.Linear(dim, dim, bias=False)
        self.register_buffer("cache", torch.randn(1, 4, dim))

    def forward(self, x):
        if self.case == "norm of the cache, then the cache written":
            row = self.cache[:, :1]
            as_float = row.float()
            normed = (as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + 1e-6)).to(row.dtype) * self.norm
            self.cache.index_copy_(1, torch.tensor([0]), x)
            return self.q(normed) + 0, self.k(normed)
        hidden = self.cache[:, :1] * 1
        product = self.q(hidden)
        hidden.add_(1.0)  # the row the residual reads, changed after the product read it
        return hidden + product


@pytest.mark.parametrize("case", ["norm of the cache, then the cache written", "the residual's row written after the product"])
def test_a_launch_is_taken_apart_where_the_graph_writes_in_place_within_it(case):
    used, _ = _rewritten(_WrittenBetween(case), torch.randn(1, 1, 32))
    assert (used.norms, used.residuals) == (0, 0) and used.launches == used.products, case


class _WrittenWithoutGrad(torch.nn.Module):
    """A weight written under `torch.no_grad()` between two products of one row:
    export puts the write inside a higher-order op, whose schema does not say it writes."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Parameter(torch.randn(8, 16))
        self.register_buffer("second", torch.randn(8, 16))

    def forward(self, x):
        before = torch.nn.functional.linear(x, self.first)
        with torch.no_grad():
            self.second[0].fill_(3.0)
        return before, torch.nn.functional.linear(x, self.second)


def test_a_launch_is_taken_apart_where_a_higher_order_op_may_write_within_it():
    program = torch.export.export(_WrittenWithoutGrad().eval(), (torch.randn(1, 16),), strict=False)
    graph_module = program.module()
    assert any(isinstance(node.target, torch._ops.HigherOrderOperator) for node in graph_module.graph.nodes)
    x = torch.randn(1, 16)
    with torch.no_grad():
        before = copy.deepcopy(graph_module)(x)
        used = _rewrite(graph_module)
        torch.testing.assert_close(graph_module(x), before, atol=0, rtol=0)
    assert (used.products, used.launches) == (2, 2)


class _TwoProductsAdded(torch.nn.Module):
    """p1(x) + p2(x): both products read by one add (a LoRA adapter beside a bias-free base)."""

    def __init__(self):
        super().__init__()
        self.base, self.other = torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.base(x) + self.other(x)


def test_two_products_added_give_the_add_to_one_launch():
    used, graph_module = _rewritten(_TwoProductsAdded(), torch.randn(1, 16))
    assert (used.products, used.launches, used.residuals) == (2, 2, 1)
    graph_module.graph.lint()


class _MeanOfAll(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.projection = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.projection(x * torch.rsqrt(x.pow(2).mean(dim=None, keepdim=True) + 1e-6))


def test_a_mean_over_every_dim_is_not_a_norm_of_the_row():
    used, _ = _rewritten(_MeanOfAll(), torch.randn(1, 16))
    assert (used.products, used.norms) == (1, 0)
