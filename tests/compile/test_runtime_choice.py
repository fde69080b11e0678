"""What a compile builds for each runtime mode (compile/aot.py, compile_program):
CUDA standalone by default with a fallback to libtorch, --standalone refusing,
--libtorch the libtorch-bound build. The AOTInductor compile itself is
replaced here (a CUDA compile needs a GPU); what is decided around it is real."""

from __future__ import annotations

import pytest
from helpers import cli

from cuda_runner.compile import aot
from cuda_runner.errors import CompileError
from cuda_runner.format.manifest import DeviceSpec


@pytest.fixture
def compiles(monkeypatch):
    """Record each AOTInductor compile asked for; `refusal` says what the standalone library lacks."""
    made: list[bool] = []
    state = {"refusal": None, "fails": False}

    def compile_once(program, args, kwargs, device, progress, options, cpu_target, standalone, **_):
        made.append(standalone)
        if standalone and state["fails"] == "cuda fault":
            try:
                raise _AcceleratorError("CUDA error: misaligned address")
            except _AcceleratorError as fault:
                raise CompileError("AOTInductor compile failed: AcceleratorError: CUDA error: misaligned address") from fault
        if standalone and state["fails"]:
            raise CompileError("AOTInductor compile failed: InductorError: no fallback kernel for aten.foo")
        library = b"standalone" if standalone else b"libtorch"
        return aot.CompiledLibrary(library, b"", DeviceSpec("cuda" if device != "cpu" else "cpu"), {})

    monkeypatch.setattr(aot, "_compile_once", compile_once)
    monkeypatch.setattr(aot, "standalone_refusal", lambda library: state["refusal"] if library == b"standalone" else "libtorch-bound")
    return made, state


class _AcceleratorError(RuntimeError):
    """Named as torch's error for a CUDA fault: the check goes by the name (torch is not imported here)."""


_AcceleratorError.__name__ = "AcceleratorError"


def _compile(device="cuda:0", runtime="auto"):
    return aot.compile_program(None, (), {}, device, lambda message: None, {}, runtime=runtime)


def test_a_cuda_compile_is_standalone_by_default(compiles):
    made, _ = compiles
    compiled = _compile()
    assert made == [True] and compiled.library == b"standalone" and compiled.options["standalone"] is True and compiled.note is None


@pytest.mark.parametrize("device, runtime, builds", [("cuda:0", "auto", 2), ("cpu", "auto", 1), ("cuda:0", "libtorch", 1)])
def test_every_build_is_told_what_the_bundles_other_methods_write(monkeypatch, device, runtime, builds):
    told = []

    def compile_once(*args, standalone, written_elsewhere):
        told.append(written_elsewhere)
        return aot.CompiledLibrary(b"standalone" if standalone else b"libtorch", b"", DeviceSpec("cpu"), {})

    monkeypatch.setattr(aot, "_compile_once", compile_once)
    monkeypatch.setattr(aot, "standalone_refusal", lambda library: "libtorch-bound")  # the standalone build falls back
    aot.compile_program(None, (), {}, device, lambda message: None, {}, runtime=runtime, written_elsewhere=frozenset({"cache"}))
    assert told == [{"cache"}] * builds


def test_a_kernel_without_a_standalone_form_falls_back_to_libtorch_saying_which_and_what_it_costs(compiles):
    made, state = compiles
    state["refusal"] = "cuda-runner's shim lacks aoti_torch_cuda__weight_int4pack_mm"
    compiled = _compile()
    assert made == [True, False] and compiled.library == b"libtorch"
    assert compiled.note == (f"compiled bound to libtorch: cuda-runner's shim lacks aoti_torch_cuda__weight_int4pack_mm; {aot.LIBTORCH_COST}")
    assert compiled.options["libtorch_because"] == state["refusal"]  # recorded: inspect and run say why


def test_a_standalone_compile_that_fails_falls_back_too(compiles):
    made, state = compiles
    state["fails"] = True
    compiled = _compile()
    assert made == [True, False] and "the standalone compile failed (InductorError: no fallback kernel for aten.foo)" in compiled.note


def test_a_standalone_compile_that_broke_the_gpu_is_not_followed_by_one_that_would_fail_on_it(compiles):
    """A CUDA fault while autotuning is sticky: the libtorch compile in the same process
    would fail too (ViT-B/16 on the H200), so the error says to compile with --libtorch."""
    made, state = compiles
    state["fails"] = "cuda fault"
    with pytest.raises(CompileError, match=r"^the standalone compile faulted the GPU \(AcceleratorError: CUDA error: misaligned "
                                           r"address\), and this process cannot use it again; compile again in a new process with "
                                           r"--libtorch$"):
        _compile()
    assert made == [True]


def test_a_fault_with_an_own_kernel_in_the_graph_names_both_ways_out(compiles, monkeypatch):
    made, _state = compiles

    def faulting(*args, **kwargs):
        made.append(True)
        raise aot.GpuFault("AOTInductor compile failed: InductorError: AcceleratorError: CUDA error: misaligned address", ("matvec",))

    monkeypatch.setattr(aot, "_compile_once", faulting)
    expected = ("the standalone compile faulted the GPU (InductorError: AcceleratorError: CUDA error: misaligned address), and this process "
                "cannot use it again; compile again in a new process with --option cuda_runner.matvec=false (the matrix-vector kernel was "
                "in the graph; leaving it out may avoid the fault)")
    with pytest.raises(CompileError) as raised:
        _compile()
    assert str(raised.value) == expected + " or with --libtorch" and made == [True]
    with pytest.raises(CompileError) as raised:
        _compile(runtime="standalone")  # --standalone: no libtorch build to offer
    assert str(raised.value) == expected


def test_a_gpu_fault_survives_the_way_back_from_the_compile_process():
    import pickle

    fault = pickle.loads(pickle.dumps(aot.GpuFault("AOTInductor compile failed: misaligned address", ("attention", "matvec"))))
    assert isinstance(fault, CompileError) and str(fault) == "AOTInductor compile failed: misaligned address"
    assert fault.in_graph == ("attention", "matvec")
    assert aot.gpu_fault_message("x", fault.in_graph, libtorch=False).endswith(
        "--option cuda_runner.fuse_decode_attention=false --option cuda_runner.matvec=false (the fused decode attention and the "
        "matrix-vector kernel were in the graph; leaving them out may avoid the fault)")
    # combo kernels, taken with the attention, are an option of Inductor's to turn off as well
    assert "--option cuda_runner.fuse_decode_attention=false --option cuda_runner.matvec=false --option combo_kernels=false (the fused " \
        "decode attention, the matrix-vector kernel and Inductor's combo kernels were in the graph" in \
        aot.gpu_fault_message("x", ("attention", "matvec", "combo"))


def test_what_counts_as_a_cuda_fault():
    assert aot.gpu_unusable_after(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not aot.gpu_unusable_after(RuntimeError("No valid triton configs. OutOfResources: shared memory"))
    # InductorError's text, its cause not chained (ViT-B/16's compile on the H200), and Triton's launcher's.
    assert aot.gpu_unusable_after(RuntimeError("AcceleratorError: CUDA error: misaligned address"))
    assert aot.gpu_unusable_after(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"))
    # Errors a context recovers from are no fault: the compile may go on without the kernel, or on libtorch.
    assert not aot.gpu_unusable_after(RuntimeError("AcceleratorError: CUDA error: out of memory"))
    assert not aot.gpu_unusable_after(RuntimeError("CUDA error: invalid argument"))
    try:
        try:
            raise RuntimeError("CUDA error: misaligned address")
        except RuntimeError:
            raise ValueError("while benchmarking") from None
    except ValueError as wrapped:
        assert not aot.gpu_unusable_after(wrapped)  # `from None` cut the chain: nothing says a fault
    try:
        try:
            raise RuntimeError("CUDA error: misaligned address")
        except RuntimeError as fault:
            raise ValueError("while benchmarking") from fault
    except ValueError as wrapped:
        assert aot.gpu_unusable_after(wrapped)


def test_standalone_refuses_instead_of_falling_back(compiles):
    made, state = compiles
    state["refusal"] = "cuda-runner's shim lacks aoti_torch_cuda_mm_out"
    with pytest.raises(CompileError, match="--standalone: the compiled library cannot run without libtorch: cuda-runner's shim lacks aoti_torch_cuda_mm_out"):
        _compile(runtime="standalone")
    assert made == [True]
    state["fails"] = True
    with pytest.raises(CompileError, match="no fallback kernel"):
        _compile(runtime="standalone")


def test_libtorch_builds_the_bound_library_at_once(compiles):
    made, _ = compiles
    assert _compile(runtime="libtorch").library == b"libtorch" and made == [False]


def test_a_cpu_compile_is_one_compile_in_every_mode(compiles):
    made, state = compiles
    state["refusal"] = None
    for runtime in ("auto", "libtorch"):
        assert _compile("cpu", runtime).note is None
    assert made == [False, False]
    assert _compile("cpu", "standalone").options["standalone"] is True  # attention from its math form, then checked
    assert made == [False, False, True]


def test_the_modes_are_checked(tmp_path):
    from cuda_runner.compile import chosen_runtime
    from cuda_runner.errors import InputError

    assert chosen_runtime(None) == "auto" and chosen_runtime(None, standalone=True) == "standalone"
    with pytest.raises(InputError, match="unknown runtime 'tensorrt'"):
        chosen_runtime("tensorrt")
    with pytest.raises(InputError, match="disagree"):
        chosen_runtime("libtorch", standalone=True)
    result = cli("compile", str(tmp_path / "p.pt2"), "-o", str(tmp_path / "m.bundle"), "--standalone", "--libtorch")
    assert result.returncode == 2 and result.error_lines == ["error: --standalone and --libtorch ask for opposite builds; give one"]


def test_a_missing_function_says_the_one_thing_that_works(monkeypatch):
    """A CUDA bundle bound to libtorch by choice can be compiled again; one that fell back, or a CPU one, needs torch."""
    from cuda_runner.format.manifest import MethodSpec
    from cuda_runner.runtime.providers import INSTALL_TORCH, libtorch_remedy

    def spec(device, **options):
        return MethodSpec(name="forward", device=DeviceSpec(device), library_segment="so", weights_segment=None, inputs=(), outputs=(), dims={},
                          torch_version="2.11.0", compile_options=options)

    assert libtorch_remedy(spec("cpu")) == INSTALL_TORCH
    assert libtorch_remedy(spec("cuda", libtorch_because="cuda-runner's shim lacks aoti_torch_cuda__weight_int4pack_mm")) == INSTALL_TORCH
    assert libtorch_remedy(spec("cuda")).endswith("or compile it again without --libtorch (CUDA compiles need only cuda-runner's shim by default)")
    assert libtorch_remedy(spec("cuda", standalone=True)) == INSTALL_TORCH
