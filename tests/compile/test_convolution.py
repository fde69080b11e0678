"""1-D convolutions rewritten as 2-D ones for standalone CUDA builds
(compile/convolution.py): which are rewritten, and that the graph computes
what it did."""

from __future__ import annotations

import pytest
import torch

from cuda_runner.compile.convolution import as_two_dimensional


class _Convolutions(torch.nn.Module):
    def __init__(self, layers: list[torch.nn.Module]):
        super().__init__()
        self.layers = torch.nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


_CASES = {
    "whisper's stem": ([torch.nn.Conv1d(4, 8, 3, padding=1), torch.nn.GELU(), torch.nn.Conv1d(8, 8, 3, stride=2, padding=1)], 2),
    "grouped, no bias": ([torch.nn.Conv1d(4, 6, 5, groups=2, bias=False)], 1),
    "dilated, left alone (no template takes it either way)": ([torch.nn.Conv1d(4, 6, 5, dilation=2)], 0),
    "padding named": ([torch.nn.Conv1d(4, 4, 3, padding="same"), torch.nn.Conv1d(4, 4, 3, padding="valid")], 2),
    "depthwise, left to its own template": ([torch.nn.Conv1d(4, 4, 3, groups=4, padding=1)], 0),
    "2-D, left alone": ([torch.nn.Unflatten(2, (4, 4)), torch.nn.Conv2d(4, 4, 3)], 0),
}


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.parametrize("decomposed", [False, True], ids=["export", "decomposed"])
def test_one_dimensional_convolutions_become_two_dimensional_and_compute_the_same(case, decomposed):
    torch.manual_seed(0)
    layers, expected_count = _CASES[case]
    model = _Convolutions(layers).eval()
    x = torch.randn(2, 4, 16)
    program = torch.export.export(model, (x,))
    if decomposed:  # aten.convolution, as a program run through the core decompositions has it
        program = program.run_decompositions()
    module = program.module()
    assert as_two_dimensional(module) == expected_count
    targets = {str(node.target) for node in module.graph.nodes if node.op == "call_function"}
    if expected_count:
        assert not targets & {"aten.conv1d.default", "aten.conv1d.padding"}
    with torch.no_grad():
        torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-5)


class _LengthFirst(torch.nn.Module):
    """[N, L, C] in, as audio and text front ends have it; the output viewed flat."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 6, 3)

    def forward(self, x):
        y = self.conv(x.transpose(1, 2))
        return y.view(y.shape[0], -1)


@pytest.mark.parametrize("decomposed", [False, True], ids=["export", "decomposed"])
def test_a_transposed_input_still_gives_an_output_that_views_as_before(decomposed):
    """Unsqueezed as it was, the transposed input looked channels-last to the 2-D convolution and its output could not be viewed."""
    model = _LengthFirst().eval()
    x = torch.randn(2, 17, 4)
    program = torch.export.export(model, (x,))
    module = (program.run_decompositions() if decomposed else program).module()
    assert as_two_dimensional(module) == 1
    with torch.no_grad():
        torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-5)
    torch.export.export(module, (x,))  # as Inductor traces it again


def test_an_unbatched_input_keeps_its_shape():
    model = _Convolutions([torch.nn.Conv1d(3, 5, 3, stride=2)]).eval()
    x = torch.randn(3, 11)
    module = torch.export.export(model, (x,)).module()
    assert as_two_dimensional(module) == 1
    with torch.no_grad():
        torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-5)
