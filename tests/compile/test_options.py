"""Inductor options given to compile: parsed as typed values, checked against
Inductor's own config, recorded in the manifest."""

from __future__ import annotations

import pytest

from cuda_runner.cli.options import option_values
from cuda_runner.compile.aot import AUTOTUNE_OPTIONS, QUICK_OPTIONS, SINGLE_ROW_SHARE, check_options, single_row_share
from cuda_runner.errors import InputError
from cuda_runner.format import read_manifest


def test_option_values_are_typed_as_written():
    values = option_values(["max_autotune=true", "triton.cudagraphs=False", "max_autotune_gemm_backends=TRITON,ATEN",
                            "unroll_reductions_threshold=16", "some.list=[1, 2]"], autotune=False)
    assert values == {"max_autotune": True, "triton.cudagraphs": False, "max_autotune_gemm_backends": "TRITON,ATEN",
                      "unroll_reductions_threshold": 16, "some.list": [1, 2]}
    assert option_values([], autotune=True) == AUTOTUNE_OPTIONS
    assert option_values(["max_autotune=false"], autotune=True)["max_autotune"] is False  # --option wins over the preset


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"no_such_option": 1}, "not an Inductor option"),
        ({"aot_inductor.link_libtorch": True}, "set by cuda-runner"),
        ({"max_autotune": "yes"}, "true or false"),
        ({"unroll_reductions_threshold": "many"}, "a number"),
    ],
)
def test_bad_options_are_refused_before_compiling(options, message):
    import torch

    with pytest.raises(InputError, match=message) as raised:
        check_options(torch, options)
    assert raised.value.subject == "option"


def test_options_reach_the_manifest(compiled):
    # tests/helpers.py compiles the "linear" fixture with coordinate_descent_tuning on.
    options = read_manifest(compiled("linear", "cpu").path).methods["forward"].compile_options
    assert options["coordinate_descent_tuning"] is True
    assert options["aot_inductor.link_libtorch"] is False and options["mutated_buffers"] == []


def test_the_quick_preset_is_known_to_inductor_and_loses_to_an_explicit_option():
    import torch

    assert option_values([], autotune=False, quick=True) == QUICK_OPTIONS
    assert check_options(torch, QUICK_OPTIONS) == QUICK_OPTIONS
    assert option_values(["test_configs.max_mm_configs=4"], autotune=False, quick=True)["test_configs.max_mm_configs"] == 4


@pytest.mark.parametrize(
    ("tokens", "dynamic", "expected"),
    [
        ((1, 1), False, 1.0),         # one token: both projections (128 + 128 weights) and the bmm of one query row (32)
        ((1, 5), False, 0.0),         # five tokens
        ((3, 1), False, 96 / 352),    # three single tokens: three rows for the projections, one per batch for the bmm
        ((1, 5), True, 0.0),          # a prompt of dynamic length is not known to be one row
    ],
)
def test_single_row_share_is_what_a_decode_step_multiplies(tokens, dynamic, expected):
    import torch

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
            hidden = self.down(torch.relu(self.up(x)))
            return torch.bmm(hidden, keys.transpose(1, 2))

    x = torch.randn(*tokens, 8)
    shapes = {"x": {1: torch.export.Dim("length", min=2, max=64)}, "keys": None} if dynamic else None
    program = torch.export.export(Step(), (x, torch.randn(tokens[0], 4, 8)), dynamic_shapes=shapes)
    assert single_row_share(program) == pytest.approx(expected)


def test_a_batch_one_head_on_a_convolution_network_is_no_decode_step():
    """One image: the classifier multiplies one row, but it reads a small share of the weights."""
    import torch

    network = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.Conv2d(64, 64, 3), torch.nn.AdaptiveAvgPool2d(1),
                                  torch.nn.Flatten(), torch.nn.Linear(64, 10))
    program = torch.export.export(network, (torch.randn(1, 3, 16, 16),))
    share = single_row_share(program)
    assert share == pytest.approx(640 / (3 * 64 * 9 + 64 * 64 * 9 + 640)) and share < SINGLE_ROW_SHARE
