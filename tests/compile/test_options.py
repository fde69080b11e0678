"""Inductor options given to compile: parsed as typed values, checked against
Inductor's own config, recorded in the manifest."""

from __future__ import annotations

import pytest

from cuda_runner.cli.options import option_values
from cuda_runner.compile.aot import AUTOTUNE_OPTIONS, check_options
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
