"""The check of a compiled method against eager PyTorch (compile/check.py): it
runs the library through cuda-runner's own load path and tells a library that
computes something else; a method the single-row rule gave coordinate-descent
tuning is compiled again without it where the check disagrees."""

from __future__ import annotations

import copy

import pytest
import torch

import cuda_runner.compile as compile_package
from cuda_runner.compile import MethodSource, _compile_method, export_module
from cuda_runner.compile.aot import CompiledLibrary, compile_program
from cuda_runner.compile.check import disagreement
from cuda_runner.compile.signature import program_signature
from cuda_runner.format.manifest import DeviceSpec


class Step(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.project = torch.nn.Linear(6, 4)
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)  # state: eager must start where the bundle starts, and leave the program as it was
        return self.project(x) + self.count


@pytest.fixture(scope="module")
def compiled_step():
    torch.manual_seed(0)
    module = Step().eval()
    program = export_module(module, (torch.randn(1, 6),), {}, None).program
    args, kwargs = program.example_inputs
    library = compile_program(program, args, kwargs, "cpu", lambda _: None)
    spec, segments = compile_package._method_spec(torch, "forward", program_signature(program, None), library,
                                                   compile_package._written_state(program), "cpu")
    return module, program, spec, segments


def test_a_library_agrees_with_its_own_program_and_the_program_keeps_its_state(compiled_step):
    _, program, spec, segments = compiled_step
    args, kwargs = program.example_inputs
    before = {name: value.clone() for name, value in program.state_dict.items()}
    assert disagreement(torch, program, spec, segments, args, kwargs, "cpu", ["count"]) is None
    assert all(torch.equal(before[name], value) for name, value in program.state_dict.items())


def test_a_library_that_computes_something_else_is_told(compiled_step):
    module, _, spec, segments = compiled_step
    other = copy.deepcopy(module)
    with torch.no_grad():
        other.project.weight.mul_(1.01)  # a 1% error, far over float32's tolerance
    program = export_module(other, (torch.randn(1, 6),), {}, None).program
    args, kwargs = program.example_inputs
    problem = disagreement(torch, program, spec, segments, args, kwargs, "cpu", ["count"])
    assert problem is not None and "output_0" in problem and "from eager's" in problem


def test_a_method_the_check_refuses_is_compiled_again_without_coordinate_descent(monkeypatch):
    """The decision, with the compiler and the check stood in for (a CUDA compile needs a GPU)."""
    program = export_module(torch.nn.Linear(3, 2), (torch.randn(1, 3),), {}, None).program
    asked: list[dict] = []

    def fake_compile(program, args, kwargs, device, progress, options, cpu_target, runtime):
        asked.append(dict(options))
        tuned = options.get("coordinate_descent_tuning", True)
        return CompiledLibrary(b"library", b"", DeviceSpec(type="cuda", compute_capability="9.0"), {"coordinate_descent_tuning": tuned})

    monkeypatch.setattr(compile_package, "compile_program", fake_compile)
    monkeypatch.setattr(compile_package, "_with_library_buffers", lambda written, library, device: written)
    monkeypatch.setattr(compile_package, "disagreement", lambda *args: "output 'output_0' is 9.7 from eager's (largest value 321)")
    notes: list[str] = []
    spec, _, _ = _compile_method(torch, "decode", MethodSource(program), "cpu", lambda _: None, {}, warn=notes.append)
    assert [options.get("coordinate_descent_tuning") for options in asked] == [None, False]
    assert spec.compile_options["coordinate_descent_tuning"] is False
    assert "9.7 from eager" in spec.compile_options["coordinate_descent_disagreed"]
    assert len(notes) == 1 and "compiled again without it" in notes[0]


def test_coordinate_descent_the_caller_asked_for_is_not_second_guessed(monkeypatch):
    program = export_module(torch.nn.Linear(3, 2), (torch.randn(1, 3),), {}, None).program
    calls = []
    monkeypatch.setattr(compile_package, "compile_program", lambda *args: calls.append(args) or CompiledLibrary(
        b"library", b"", DeviceSpec(type="cuda", compute_capability="9.0"), {"coordinate_descent_tuning": True}))
    monkeypatch.setattr(compile_package, "_with_library_buffers", lambda written, library, device: written)
    monkeypatch.setattr(compile_package, "disagreement", lambda *args: pytest.fail("checked though the caller chose the option"))
    _compile_method(torch, "decode", MethodSource(program), "cpu", lambda _: None, {"coordinate_descent_tuning": True})
    assert len(calls) == 1


def test_tolerances_hold_zeros_infinities_and_dtypes_sensibly():
    import warnings

    import numpy as np

    from cuda_runner.compile.check import _difference

    zeros = np.zeros(4, np.float32)
    assert _difference("a", zeros + 1e-12, zeros, overall=0.0) is None  # an output of zeros is not held to zero
    infinite = np.array([np.inf, -np.inf, np.nan, 1.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 'invalid value' from inf - inf
        assert _difference("b", infinite.copy(), infinite, overall=1.0) is None
    assert "from eager's" in _difference("c", np.float32([320.0 + 9.7]), np.float32([320.0]), overall=320.0)
    assert _difference("d", np.float32([320.01]), np.float32([320.0]), overall=320.0) is None  # 3e-5 of the scale
    assert _difference("e", np.int64([1, 2]), np.int64([1, 3]), overall=0.0) == "output 'e' differs from eager's"
    assert "shape" in _difference("f", np.zeros((2, 2), np.float32), np.zeros(4, np.float32), overall=0.0)


def test_a_temporary_bundle_that_cannot_be_written_leaves_the_method_unchecked(compiled_step, monkeypatch):
    from cuda_runner.compile import check

    _, program, spec, segments = compiled_step
    args, kwargs = program.example_inputs

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(check, "write_bundle", full_disk)
    with pytest.raises(check.NotChecked, match="No space left"):
        disagreement(torch, program, spec, segments, args, kwargs, "cpu", ["count"])
