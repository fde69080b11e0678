"""The check of a compiled method against eager PyTorch (compile/check.py): it
runs the library through cuda-runner's own load path and tells a library that
computes something else; a method the single-row rule gave coordinate-descent
tuning is compiled again without it where the check disagrees."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import cuda_runner.compile as compile_package
from cuda_runner.compile import MethodSource, _compile_method, export_module
from cuda_runner.compile.aot import CompiledLibrary
from cuda_runner.compile.check import disagreement
from cuda_runner.format.manifest import DeviceSpec


@pytest.fixture
def compiled_writer(compiled):
    """tests/models.py's Writer (buffers a run adds to, an input it doubles in place), as the
    fixture bundle holds it: its spec without the segments a temporary bundle does not carry."""
    import models

    from cuda_runner.format.bundle import open_bundle

    bundle = compiled("writer", "cpu")
    with open_bundle(bundle.path) as reader:
        spec = dataclasses.replace(reader.manifest.methods["forward"], call_helper_segment=None, sample_inputs_segment=None,
                                   sample_outputs_segment=None)
        segments = {name: bytes(reader.segment(name)) for name in (spec.library_segment, spec.weights_segment) if name is not None}
    module, args, _ = models.BUILDERS["writer"]()
    return module, export_module(module, args, {}, None).program, spec, segments


def test_a_library_agrees_with_its_own_program_and_leaves_the_program_and_its_inputs_as_they_were(compiled_writer):
    _, program, spec, segments = compiled_writer
    args, kwargs = program.example_inputs
    state = {name: value.clone() for name, value in program.state_dict.items()}
    inputs = [arg.clone() for arg in args]
    assert disagreement(torch, program, spec, segments, args, kwargs, "cpu", ["steps", "total"]) is None
    assert all(torch.equal(state[name], value) for name, value in program.state_dict.items())
    assert all(torch.equal(before, after) for before, after in zip(inputs, args))  # the doubled input was a copy


def test_a_library_that_computes_something_else_is_told(compiled_writer):
    module, _, spec, segments = compiled_writer
    other = copy.deepcopy(module)
    with torch.no_grad():
        other.scale.mul_(1.01)  # a 1% error, far over float32's tolerance
    program = export_module(other, (torch.ones(4), torch.ones(4)), {}, None).program
    args, kwargs = program.example_inputs
    problem = disagreement(torch, program, spec, segments, args, kwargs, "cpu", ["steps", "total"])
    assert problem is not None and "output_0" in problem and "from eager's" in problem


def test_a_method_the_check_refuses_is_compiled_again_without_coordinate_descent(monkeypatch):
    """The decision, with the compiler and the check stood in for (a CUDA compile needs a GPU)."""
    program = export_module(torch.nn.Linear(3, 2), (torch.randn(1, 3),), {}, None).program
    asked: list[dict] = []

    def fake_compile(program, args, kwargs, device, progress, options, cpu_target, runtime, **_):
        asked.append(dict(options))
        tuned = options.get("coordinate_descent_tuning", True)
        return CompiledLibrary(b"library", b"", DeviceSpec(type="cuda", compute_capability="9.0"), {"coordinate_descent_tuning": tuned})

    monkeypatch.setattr(compile_package, "compile_program", fake_compile)
    monkeypatch.setattr(compile_package, "_with_library_buffers", lambda written, library, device: written)
    monkeypatch.setattr(compile_package, "disagreement", lambda *args: "output 'output_0' is 9.7 from eager's (largest value 321)")
    notes: list[str] = []
    spec, *_ = _compile_method(torch, "decode", MethodSource(program), "cpu", lambda _: None, {}, warn=notes.append)
    assert [options.get("coordinate_descent_tuning") for options in asked] == [None, False]
    assert spec.compile_options["coordinate_descent_tuning"] is False
    assert "9.7 from eager" in spec.compile_options["coordinate_descent_disagreed"]
    assert "compiled again without it" in notes[0]
    assert len(notes) == 2 and "still disagrees" in notes[1]  # checked again: the stand-in disagrees whatever is compiled


def _fake_compiles(monkeypatch, problems):
    """compile_program standing in for a CUDA compile that records what it chose (coordinate
    descent unless told otherwise, the fused attention unless turned off), and a check that
    answers from `problems` in turn."""
    from cuda_runner.compile.attention import OPTION

    asked: list[dict] = []

    def fake_compile(program, args, kwargs, device, progress, options, cpu_target, runtime, **_):
        asked.append(dict(options))
        recorded = {"coordinate_descent_tuning": options.get("coordinate_descent_tuning", True)}
        if options.get(OPTION, True):
            recorded["fused_decode_attention"] = 2
        return CompiledLibrary(b"library", b"", DeviceSpec(type="cuda", compute_capability="9.0"), recorded)

    answers = iter(problems)
    monkeypatch.setattr(compile_package, "compile_program", fake_compile)
    monkeypatch.setattr(compile_package, "_with_library_buffers", lambda written, library, device: written)
    monkeypatch.setattr(compile_package, "disagreement", lambda *args: next(answers))
    return asked


def test_where_taking_coordinate_descent_back_is_enough_the_fused_attention_stays(monkeypatch):
    program = export_module(torch.nn.Linear(3, 2), (torch.randn(1, 3),), {}, None).program
    asked = _fake_compiles(monkeypatch, ["output 'output_0' is 9.7 from eager's", None])
    notes: list[str] = []
    spec, *_ = _compile_method(torch, "decode", MethodSource(program), "cpu", lambda _: None, {}, warn=notes.append)
    assert len(asked) == 2 and asked[1] == {"coordinate_descent_tuning": False}
    assert spec.compile_options["fused_decode_attention"] == 2 and "fused_decode_attention_disagreed" not in spec.compile_options
    assert len(notes) == 1 and "coordinate-descent tuning" in notes[0]


def test_then_the_fused_attention_is_taken_back_too(monkeypatch):
    from cuda_runner.compile.attention import OPTION

    program = export_module(torch.nn.Linear(3, 2), (torch.randn(1, 3),), {}, None).program
    asked = _fake_compiles(monkeypatch, ["9.7 from eager's", "8.1 from eager's", None])
    notes: list[str] = []
    spec, *_ = _compile_method(torch, "decode", MethodSource(program), "cpu", lambda _: None, {}, warn=notes.append)
    assert asked[1:] == [{"coordinate_descent_tuning": False}, {"coordinate_descent_tuning": False, OPTION: False}]
    assert spec.compile_options["coordinate_descent_disagreed"] == "9.7 from eager's"
    assert spec.compile_options["fused_decode_attention_disagreed"] == "8.1 from eager's"
    assert "fused_decode_attention" not in spec.compile_options
    assert len(notes) == 2 and "the fused decode attention" in notes[1]


@pytest.mark.parametrize("user_options, taken_back", [
    # cuda-runner's choice: taken back after coordinate descent, before the attention they came with
    ({}, [{"coordinate_descent_tuning": False}, {"coordinate_descent_tuning": False, "combo_kernels": False}]),
    # the caller's: kept, and the attention is next
    ({"combo_kernels": True}, [{"coordinate_descent_tuning": False, "combo_kernels": True},
                               {"coordinate_descent_tuning": False, "combo_kernels": True, "cuda_runner.fuse_decode_attention": False}]),
])
def test_combo_kernels_that_came_with_the_fused_attention_are_taken_back_before_it(monkeypatch, user_options, taken_back):
    from cuda_runner.compile.attention import OPTION

    program = export_module(torch.nn.Linear(3, 2), (torch.randn(1, 3),), {}, None).program
    asked: list[dict] = []

    def fake_compile(program, args, kwargs, device, progress, options, cpu_target, runtime, **_):
        asked.append(dict(options))
        recorded = {"coordinate_descent_tuning": options.get("coordinate_descent_tuning", True)}
        if options.get(OPTION, True):
            recorded.update(fused_decode_attention=2, combo_kernels=options.get("combo_kernels", True))
        return CompiledLibrary(b"library", b"", DeviceSpec(type="cuda", compute_capability="9.0"), recorded)

    answers = iter(["9.7 from eager's", "8.1 from eager's", None])
    monkeypatch.setattr(compile_package, "compile_program", fake_compile)
    monkeypatch.setattr(compile_package, "_with_library_buffers", lambda written, library, device: written)
    monkeypatch.setattr(compile_package, "disagreement", lambda *args: next(answers))
    notes: list[str] = []
    spec, *_ = _compile_method(torch, "decode", MethodSource(program), "cpu", lambda _: None, user_options, warn=notes.append)
    assert asked == [user_options, *taken_back]
    assert (spec.compile_options.get("fused_decode_attention") == 2) == (not user_options)
    assert spec.compile_options.get("combo_kernels_disagreed") == ("8.1 from eager's" if not user_options else None)
    assert ("Inductor's combo kernels" in notes[1]) == (not user_options)


def test_coordinate_descent_the_caller_asked_for_is_not_second_guessed(monkeypatch):
    program = export_module(torch.nn.Linear(3, 2), (torch.randn(1, 3),), {}, None).program
    calls = []
    monkeypatch.setattr(compile_package, "compile_program", lambda *args, **_: calls.append(args) or CompiledLibrary(
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


def test_a_temporary_bundle_that_cannot_be_written_leaves_the_method_unchecked(compiled_writer, monkeypatch):
    from cuda_runner.compile import check

    _, program, spec, segments = compiled_writer
    args, kwargs = program.example_inputs

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(check, "write_bundle", full_disk)
    with pytest.raises(check.NotChecked, match="No space left"):
        disagreement(torch, program, spec, segments, args, kwargs, "cpu", ["steps", "total"])


def test_a_rebuild_that_lost_the_fused_attention_is_not_taken_back_for_it(monkeypatch):
    """The rebuild without coordinate descent could not fuse (its fused build failed): the check
    works from what that build has, and the failure is heard."""
    program = export_module(torch.nn.Linear(3, 2), (torch.randn(1, 3),), {}, None).program
    asked: list[dict] = []

    def fake_compile(program, args, kwargs, device, progress, options, cpu_target, runtime, **_):
        asked.append(dict(options))
        recorded = {"coordinate_descent_tuning": options.get("coordinate_descent_tuning", True)}
        recorded.update({"fused_decode_attention": 2} if len(asked) == 1 else {"fused_decode_attention_failed": "RuntimeError: boom"})
        return CompiledLibrary(b"library", b"", DeviceSpec(type="cuda", compute_capability="9.0"), recorded)

    answers = iter(["9.7 from eager's", None])
    monkeypatch.setattr(compile_package, "compile_program", fake_compile)
    monkeypatch.setattr(compile_package, "_with_library_buffers", lambda written, library, device: written)
    monkeypatch.setattr(compile_package, "disagreement", lambda *args: next(answers))
    notes: list[str] = []
    spec, *_ = _compile_method(torch, "decode", MethodSource(program), "cpu", lambda _: None, {}, warn=notes.append)
    assert len(asked) == 2
    assert "fused_decode_attention_disagreed" not in spec.compile_options
    assert [("coordinate-descent" in note, "did not compile" in note) for note in notes] == [(True, False), (False, True)]
