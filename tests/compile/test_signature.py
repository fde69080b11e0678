"""compile/signature.py: the manifest signature read from an exported program."""

from __future__ import annotations

import pytest

from cuda_runner.compile.signature import dim_names_from_dynamic_shapes, program_signature


@pytest.mark.parametrize(("bound", "recorded"), [(None, None), (64, 64)])
def test_unbounded_dimensions_are_recorded_as_unbounded(bound, recorded):
    """torch.export gives an unbounded Dim the upper bound int_oo (whose int() raises):
    the signature records no bound for it, and a bounded Dim's bound as an int."""
    torch = pytest.importorskip("torch")
    from torch.export import Dim

    batch = Dim("batch") if bound is None else Dim("batch", max=bound)
    dynamic_shapes = {"input": {0: batch}}
    program = torch.export.export(torch.nn.Linear(16, 4).eval(), (torch.randn(3, 16),), dynamic_shapes=dynamic_shapes)
    signature = program_signature(program, dim_names_from_dynamic_shapes(["input"], dynamic_shapes))
    assert [(tensor.name, tensor.shape) for tensor in signature.inputs] == [("input", ("batch", 16))]
    dim = signature.dims["batch"]
    assert dim.max == recorded and (dim.max is None or type(dim.max) is int)
    assert (dim.min, dim.example) == (0, 3)


def test_a_constant_argument_is_refused_as_a_compile_error():
    import torch

    from cuda_runner.errors import CompileError

    class Scaled(torch.nn.Module):
        def forward(self, x, times: int):
            return x * times

    program = torch.export.export(Scaled(), (torch.ones(2), 3))
    with pytest.raises(CompileError, match="constant input"):
        program_signature(program)


def test_an_input_the_fused_attention_takes_as_its_position_is_bounded_by_its_cache():
    """The position-limit proof covers 0..S-1: an index_put_ cache's bounds (-S..S-1, as eager takes
    them) are narrowed to it, an input with none gets it, and two caches give the shorter."""
    import dataclasses

    from cuda_runner.compile.signature import Signature, with_positions
    from cuda_runner.format.manifest import TensorSpec

    inputs = (TensorSpec("input_pos", "int64", (1,), bounds=(-32, 31)), TensorSpec("other", "int64", (1,)), TensorSpec("x", "float32", (4,)))
    signature = Signature(inputs=inputs, outputs=(), dims={})
    narrowed = with_positions(signature, [("input_pos", 32), ("other", 16), ("other", 8)])
    assert [spec.bounds for spec in narrowed.inputs] == [(0, 31), (0, 7), None]
    assert with_positions(signature, []) == signature
    assert dataclasses.replace(narrowed.inputs[0], bounds=(-32, 31)) == inputs[0]
