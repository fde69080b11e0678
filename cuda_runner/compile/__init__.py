"""Compile PyTorch programs into a bundle (the ahead-of-time side).

    compile_module(module, (x,), "model.bundle", device="cuda", dynamic_shapes={"x": {0: Dim("batch")}})
    compile_programs({"forward": "program.pt2"}, "model.bundle", device="cpu")
    compile_methods(module, {"prefill": (tokens,), "decode": (token,)}, "model.bundle")  # weights shared by FQN stored once
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import platform
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CompileError, CudaRunnerError, InputError
from ..files import check_destination, require_regular
from ..format import Manifest, MethodSpec, write_bundle
from ..format.manifest import CALL_HELPER, INPUT_BOUNDS, INPUT_SPAN_BOUNDS, MUTATED_BUFFERS_OPTION, MUTATED_INPUTS_OPTION, READ_ONLY_BUFFERS_OPTION, method_name_problem
from ..version import __version__
from . import attention, matvec, sharing
from .aot import (
    DEFAULT_CPU_TARGET,
    NO_GPU,
    OWN_KERNEL_NAMES,
    OWN_KERNEL_RECORDS,
    PDL_UNAVAILABLE,
    RUNTIMES,
    CompiledLibrary,
    Progress,
    check_cpu_target,
    check_device,
    check_options,
    compile_program,
    given_up,
    import_torch,
    torch_talking_to_itself,
)
from .check import NotChecked, disagreement
from .graph_values import may_write
from .input_bounds import all_input_bounds
from .signature import dim_names_from_dynamic_shapes, program_signature, with_bounds, with_positions
from .written_constants import written_constants_as_buffers

__all__ = ["MethodSource", "check_programs", "compile_methods", "compile_module", "compile_programs", "export_method", "export_module"]


@dataclass(frozen=True)
class MethodSource:
    """One method to compile: an ExportedProgram, with optional sample inputs for self-tests."""

    program: Any
    dim_names: Mapping[tuple[str, int], str] | None = None
    sample_inputs: Mapping[str, Any] | None = None


#: What compile calls with a note the user should hear (a fallback to libtorch).
Warn = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def export_module(module: Any, args: tuple, kwargs: Mapping[str, Any] | None = None, dynamic_shapes: Any = None) -> MethodSource:
    """torch.export a module in eval mode, remembering the names of its Dims."""
    torch = import_torch()
    try:
        program = torch.export.export(module.eval(), tuple(args), dict(kwargs or {}), dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as error:
        raise CompileError(f"torch.export failed: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}") from error
    input_names = list(program.graph_signature.user_inputs)
    return MethodSource(program, dim_names_from_dynamic_shapes(input_names, dynamic_shapes))


def export_method(module: Any, method: str, args: tuple, kwargs: Mapping[str, Any] | None = None, dynamic_shapes: Any = None) -> MethodSource:
    """torch.export `module.<method>` (any method, not only forward) with the
    module's own parameter names: a shallow copy of the module, whose
    parameters and submodules are the module's, is exported with that method
    as its forward (inside it, `self` is still the module)."""
    if method == "forward":
        return export_module(module, args, kwargs, dynamic_shapes)
    bound = getattr(module, method, None)
    if not callable(bound) or method.startswith("_"):
        raise InputError(f"the module has no method {method!r} to export", subject="method")
    module.eval()
    view = copy.copy(module)
    view.forward = bound
    return export_module(view, args, kwargs, dynamic_shapes)


def compile_methods(
    module: Any,
    methods: Mapping[str, tuple],
    path: str | os.PathLike,
    *,
    device: str = "cpu",
    dynamic_shapes: Mapping[str, Any] | None = None,
    share_weights: bool = True,
    metadata: Mapping[str, str] | None = None,
    sample_inputs: Mapping[str, Mapping[str, Any]] | None = None,
    progress: Progress = _quiet,
    options: Mapping[str, Any] | None = None,
    call_helper: bool = True,
    cpu_target: str = DEFAULT_CPU_TARGET,
    standalone: bool = False,
    runtime: str | None = None,
    warn: Warn | None = None,
) -> Manifest:
    """Export several methods of one module (`{"prefill": (tokens,), "decode":
    (token,)}`: method name to example args) and compile them into one bundle.
    With `share_weights`, a parameter the methods hold alike is stored once and
    uploaded once when they load together (docs/bundle-format.md, "Shared weights")."""
    torch = import_torch()
    target = check_device(torch, device)
    check_destination(Path(path))
    if target != "cpu":
        module = module.to(target)
    sources = {}
    for method, args in methods.items():
        progress(f"exporting {method}")
        args = tuple(_to_device(arg, target) for arg in args) if target != "cpu" else tuple(args)
        source = export_method(module, method, args, None, (dynamic_shapes or {}).get(method))
        sources[method] = MethodSource(source.program, source.dim_names, (sample_inputs or {}).get(method))
    return compile_sources(sources, path, device=target, metadata=metadata, progress=progress, options=options, call_helper=call_helper,
                           cpu_target=cpu_target, runtime=chosen_runtime(runtime, standalone), share_weights=share_weights, warn=warn)


def compile_module(
    module: Any,
    args: tuple,
    path: str | os.PathLike,
    *,
    device: str = "cpu",
    kwargs: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
    method: str = "forward",
    metadata: Mapping[str, str] | None = None,
    sample_inputs: Mapping[str, Any] | None = None,
    progress: Progress = _quiet,
    options: Mapping[str, Any] | None = None,
    call_helper: bool = True,
    cpu_target: str = DEFAULT_CPU_TARGET,
    standalone: bool = False,
    runtime: str | None = None,
    warn: Warn | None = None,
) -> Manifest:
    """Export `module` with example `args` and compile it into a one-method bundle.

    `options` are Inductor config values ({"max_autotune": True}, or
    AUTOTUNE_OPTIONS); they are recorded in the manifest. `call_helper` builds
    the native helper that makes each call one foreign call (needs a C compiler;
    without one the bundle is written without it). `cpu_target` (CPU bundles):
    "native" (the build CPU), or a portable level "avx512", "avx2", "scalar".
    `runtime` says what the library may need at run time: "auto" (the
    default) compiles CUDA libraries so that they need only cuda-runner's own
    shim, and falls back to a libtorch-bound library where a kernel has no
    such form, saying so through `warn` (default: warnings.warn);
    "standalone" refuses instead of falling back (`standalone=True` says the
    same); "libtorch" builds the libtorch-bound library (cuBLAS, cuDNN and
    flash attention through libtorch). CPU libraries are built alike in every
    mode; "standalone" refuses one the shim cannot run."""
    torch = import_torch()
    target = check_device(torch, device)
    if target != "cpu":
        module = module.to(target)
        args = tuple(_to_device(arg, target) for arg in args)
        kwargs = {key: _to_device(value, target) for key, value in (kwargs or {}).items()}
    progress(f"exporting {method}")
    source = export_module(module, args, kwargs, dynamic_shapes)
    source = MethodSource(source.program, source.dim_names, sample_inputs)
    return compile_sources({method: source}, path, device=target, metadata=metadata, progress=progress, options=options, call_helper=call_helper,
                           cpu_target=cpu_target, runtime=chosen_runtime(runtime, standalone), warn=warn)


def compile_programs(
    programs: Mapping[str, str | os.PathLike],
    path: str | os.PathLike,
    *,
    device: str = "cpu",
    metadata: Mapping[str, str] | None = None,
    sample_inputs: Mapping[str, Mapping[str, Any]] | None = None,
    progress: Progress = _quiet,
    options: Mapping[str, Any] | None = None,
    call_helper: bool = True,
    cpu_target: str = DEFAULT_CPU_TARGET,
    standalone: bool = False,
    share_weights: bool = True,
    runtime: str | None = None,
    warn: Warn | None = None,
) -> Manifest:
    """Compile saved ExportedPrograms (torch.export.save) into one bundle; keys
    are method names. With `share_weights`, weights the programs hold alike by
    FQN are stored once (programs exported from one module)."""
    check_destination(Path(path))
    torch = import_torch()
    target = check_device(torch, device)
    sources = {}
    for method, program_path in programs.items():
        progress(f"loading {program_path}")
        program = _load_program(torch, Path(program_path))
        samples = (sample_inputs or {}).get(method)
        sources[method] = MethodSource(program, None, samples)
    return compile_sources(sources, path, device=target, metadata=metadata, progress=progress, options=options, call_helper=call_helper,
                           cpu_target=cpu_target, runtime=chosen_runtime(runtime, standalone), share_weights=share_weights, warn=warn)


def chosen_runtime(runtime: str | None, standalone: bool = False) -> str:
    """The compile's runtime mode: `runtime`, else "standalone" where `standalone` asks for it, else "auto"."""
    if runtime is None:
        return "standalone" if standalone else "auto"
    if runtime not in RUNTIMES:
        raise InputError(f"unknown runtime {runtime!r}; choose one of: {', '.join(RUNTIMES)}")
    if standalone and runtime != "standalone":
        raise InputError(f"standalone=True and runtime={runtime!r} disagree; give one of them")
    return runtime


def _warn(note: str) -> None:
    import warnings

    warnings.warn(note, UserWarning, stacklevel=4)


def check_programs(programs: Mapping[str, str | os.PathLike], path: str | os.PathLike, device: str = "cpu") -> None:
    """What can be checked of a compile before torch is imported: the bundle's
    destination, that each program is a readable archive, and, for CUDA, that
    the driver sees a GPU at all (where it sees none, neither can PyTorch:
    refused here instead of after importing torch, 8 s of CPU)."""
    check_destination(Path(path))
    for program_path in programs.values():
        _check_program_file(Path(program_path))
    if device != "cpu":
        from ..runtime.devices import cuda_device_count

        if cuda_device_count() == 0:
            raise CompileError(NO_GPU)


def _check_program_file(path: Path) -> None:
    require_regular(path, "an ExportedProgram")
    if not zipfile.is_zipfile(path):
        raise InputError(f"cannot read {path}: not an ExportedProgram archive saved with torch.export.save")


def _load_program(torch: Any, path: Path) -> Any:
    _check_program_file(path)
    try:
        return torch.export.load(str(path))
    except Exception as error:
        raise InputError(f"cannot read {path} as an ExportedProgram saved with torch.export.save: {type(error).__name__}") from error


def compile_sources(
    sources: Mapping[str, MethodSource],
    path: str | os.PathLike,
    *,
    device: str,
    metadata: Mapping[str, str] | None = None,
    progress: Callable[[str], None] = _quiet,
    options: Mapping[str, Any] | None = None,
    call_helper: bool = True,
    cpu_target: str = DEFAULT_CPU_TARGET,
    runtime: str = "auto",
    share_weights: bool = True,
    warn: Warn | None = None,
) -> Manifest:
    """Compile each method and write the bundle atomically. With `share_weights`,
    a weight that several methods hold alike (same FQN, dtype, shape, strides
    and bytes) is stored once (compile/sharing.py)."""
    check_destination(Path(path))  # before minutes of compiling, not after
    torch = import_torch()
    user_options = check_options(torch, options or {})
    if device == "cpu":
        check_cpu_target(cpu_target)
    if not sources:
        raise InputError("nothing to compile: give at least one method")
    methods: dict[str, MethodSpec] = {}
    segments: dict[str, Any] = {}
    programs: dict[str, Any] = {}
    added: dict[str, dict[str, Any]] = {}  # method -> the constants its build added to the program (rotation tables)
    for method in sources:
        problem = method_name_problem(method)
        if problem:
            raise InputError(f"method name {method!r} {problem}")
    sources = {method: _state_read_as_buffers(method, source, progress) for method, source in sources.items()}
    # Without shared weights every method has state of its own: no other method writes it.
    written_by_methods = _written_by_methods(sources) if share_weights else frozenset()
    for method, source in sources.items():
        with torch_talking_to_itself():
            spec, method_segments, programs[method], added[method] = _compile_method(
                torch, method, source, device, progress, user_options, cpu_target, runtime, warn or _warn, written_by_methods)
        methods[method] = spec
        segments.update(method_segments)
    if share_weights and len(methods) > 1:
        methods, segments, kept_blobs = _shared(methods, segments, programs, added, device, progress)
        held = {name: frozenset(program.graph_signature.buffers) for name, program in programs.items()}
        for line in sharing.state_not_shared(methods, held, written_by_methods, kept_blobs):
            (warn or _warn)(line)
    features = ["samples"] if any(spec.has_samples for spec in methods.values()) else []
    if any(tensor.bounds is not None for spec in methods.values() for tensor in spec.inputs):
        features.append(INPUT_BOUNDS)
    if any(tensor.span_bounds is not None for spec in methods.values() for tensor in spec.inputs):
        features.append(INPUT_SPAN_BOUNDS)
    if call_helper:
        methods, helper_note = with_call_helper(methods, segments, progress)
        if helper_note is None:
            features.append(CALL_HELPER)
    manifest = Manifest(
        methods=methods,
        build={"cuda_runner": __version__, "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()},
        metadata=dict(metadata or {}),
        required_features=sharing.required_features(methods),
        optional_features=tuple(features),
    )
    progress(f"writing {path}")
    write_bundle(path, manifest, segments)
    return manifest


def _shared(methods: dict[str, MethodSpec], segments: dict[str, Any], programs: Mapping[str, Any], added: Mapping[str, Mapping[str, Any]],
            device: str, progress: Progress) -> tuple[dict[str, MethodSpec], dict[str, Any], dict[str, str]]:
    """Weights several methods hold alike, stored once (compile/sharing.py);
    and why a method kept its blob, where one did. `added`: constants each
    method's build added to its program (they are its own)."""
    blobs = {name: (programs[name], segments[spec.library_segment], segments[spec.weights_segment], spec, added.get(name, {}))
             for name, spec in methods.items() if spec.weights_segment is not None}
    result = sharing.share_weights(methods, segments, sharing.constant_tables(blobs, device, progress))
    for note in result.notes:
        progress(note)
    if result.shared_segments:
        size = sum(memoryview(result.segments[name]).nbytes for name in result.shared_segments)
        progress(f"{len(result.shared_segments)} weight storage(s), {size} bytes, stored once for several methods")
    else:
        progress("no weight is held alike by several methods: each method keeps its weights blob")
    return result.methods, result.segments, result.kept_blobs


def with_call_helper(methods: Mapping[str, MethodSpec], segments: dict[str, Any], progress: Callable[[str], None]) -> tuple[dict[str, MethodSpec], str | None]:
    """Add the call helper (one segment shared by every method) where it can be
    built; returns the methods, and why there is no helper (None if there is)."""
    from .helper import SEGMENT_NAME, build_call_helper

    built = build_call_helper()
    if built.library is None:
        progress(built.note)
        return dict(methods), built.note
    segments[SEGMENT_NAME] = built.library
    return {name: dataclasses.replace(spec, call_helper_segment=SEGMENT_NAME) for name, spec in methods.items()}, None


@dataclass(frozen=True)
class _WrittenState:
    buffers: list[str]  # buffers a run writes to (state the next run sees)
    inputs: list[str]  # inputs a run writes into, in the signature's order
    read_only: list[str]  # the program's other buffers

    def options(self) -> dict[str, list[str]]:
        return {MUTATED_BUFFERS_OPTION: self.buffers, READ_ONLY_BUFFERS_OPTION: self.read_only, MUTATED_INPUTS_OPTION: self.inputs}


def _written_state(program: Any) -> _WrittenState | None:
    """What a run of `program` writes to. torch.export's default IR keeps
    in-place ops as they are and leaves its signature's mutation tables empty
    (a buffer's `add_` is recorded nowhere); only the functional form fills
    them, so they are read from a decomposed copy (no decompositions applied
    beyond functionalization), leaving the program itself as it is. None where
    that fails: the bundle then says nothing, and the runtime assumes what it
    does for older bundles (state wherever the library has buffers, read-only
    inputs copied)."""
    if not _may_write(program):  # no op that writes: the retrace (seconds on a large model) is not needed
        return _WrittenState([], [], sorted(set(program.graph_signature.buffers)))
    try:
        functional = program.run_decompositions({})
    except Exception:  # torch raises anything here; what is written is then not recorded
        return None
    signature = functional.graph_signature
    written_inputs = set(signature.user_inputs_to_mutate.values())
    written_buffers = set(signature.buffers_to_mutate.values())
    return _WrittenState(sorted(written_buffers), [name for name in signature.user_inputs if name in written_inputs],
                         sorted(set(signature.buffers) - written_buffers))


def _with_library_buffers(written: _WrittenState, library: bytes, device: str) -> _WrittenState:
    """The read-only buffers as the compiled library has them: module buffers
    no run writes, and the buffers the compiler made (frozen parameters, which
    the program never had). The runtime checks every buffer the library has
    against the two lists; where the library cannot be asked, the program's list stands."""
    from .sharing import library_buffers

    try:
        found = library_buffers(library, device)
    except (CudaRunnerError, OSError):
        return written
    if found is None:
        return written
    return dataclasses.replace(written, read_only=sorted(found - set(written.buffers)))


def _may_write(program: Any) -> bool:
    """Whether any op of the program (its subgraphs included) may write to a
    tensor: an ATen op whose schema says so, or anything this cannot tell
    (a higher-order op, a Python callable)."""
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        if any(may_write(node) for node in (graph.nodes if graph is not None else ())):
            return True
    return False


def _state_kept(torch: Any, options: Mapping[str, Any], written: _WrittenState | None, read_from_others: frozenset[str]) -> Mapping[str, Any]:
    """The options that keep Inductor from taking state for constants, unless
    the caller set them: `written` is what the method writes, `read_from_others`
    the buffers it reads that another method of the bundle writes."""
    chosen = dict(options)
    if (written is not None and written.buffers) or read_from_others:
        # Inductor's joint-graph constant folding takes buffers for constants:
        # a buffer's new value computed from buffers alone (a step counter's
        # add_(1)) was folded into the code, so every run wrote the same value
        # and nothing was kept between calls (torch's own aoti_load_package too).
        chosen.setdefault("joint_graph_constant_folding", False)
    if read_from_others and hasattr(torch._inductor.config, "always_keep_tensor_constants"):
        # A buffer of at most a few elements that the method does not write is
        # put into the code as a number: what another method writes to it
        # would never be read (a prefill's count, read by decode as 0).
        chosen.setdefault("always_keep_tensor_constants", True)
    return chosen


def _state_read_as_buffers(method: str, source: MethodSource, progress: Progress) -> MethodSource:
    """The method's source with the constants its program writes read as
    buffers (compile/written_constants.py: transformers' static cache)."""
    program, names = written_constants_as_buffers(source.program)
    if not names:
        return source
    progress(f"method {method!r} writes {len(names)} tensor(s) it holds as constants (a KV cache kept outside the module's buffers): "
             "they are compiled as its state")
    return dataclasses.replace(source, program=program)


def _written_by_methods(sources: Mapping[str, MethodSource]) -> frozenset[str]:
    """The module tensors some method of a bundle of several may write (a KV
    cache): the methods share them, so what one method's compile takes for a
    constant may be one another writes. Empty for one method."""
    if len(sources) < 2:
        return frozenset()
    return frozenset().union(*(matvec.written_tensors(source.program.module().graph) for source in sources.values()))


def _compile_method(
    torch: Any, method: str, source: MethodSource, device: str, progress: Progress, options: Mapping[str, Any],
    cpu_target: str = DEFAULT_CPU_TARGET, runtime: str = "auto", warn: Warn = lambda note: None,
    written_by_methods: frozenset[str] = frozenset(),
) -> tuple[MethodSpec, dict[str, Any], Any, dict[str, Any]]:
    """The method's spec and segments, its program (on `device`), and the
    constants its build added to the program by name (rotation tables).
    `written_by_methods`: module tensors the bundle's methods write (_written_by_methods)."""
    program = source.program
    if device != "cpu":
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, device)
    signature = with_bounds(program_signature(program, source.dim_names), *all_input_bounds(program, written_by_methods))
    written = _written_state(program)
    args, kwargs = _example_inputs(program, device)
    progress(f"compiling method {method!r} for {device}")
    own_writes = set(written.buffers) if written is not None else set()
    options = _state_kept(torch, options, written, written_by_methods & set(program.graph_signature.buffers) - own_writes)
    build = functools.partial(_compiled, program, args, kwargs, device, progress, cpu_target=cpu_target, runtime=runtime, method=method,
                                warn=warn, written_by_methods=written_by_methods)
    compiled, spec, segments = _checked_against_eager(torch, method, program, signature, written, args, kwargs, device, progress, options,
                                                      warn, build, build(options))
    if compiled.note:
        warn(f"method {method!r}: {compiled.note}")
    if source.sample_inputs is not None:
        from .samples import sample_segments

        progress(f"computing eager reference outputs for {method!r}'s samples")
        spec, sample_data = sample_segments(torch, program, spec, source.sample_inputs, device)
        segments.update(sample_data)
    return spec, segments, program, dict(compiled.added_constants)


def _method_spec(torch: Any, method: str, signature: Any, compiled: CompiledLibrary, written: _WrittenState | None, device: str,
                 ) -> tuple[MethodSpec, dict[str, Any]]:
    """The spec of a method compiled into `compiled`, and its library and weights segments."""
    signature = with_positions(signature, compiled.positions)
    if written is not None:
        written = _with_library_buffers(written, compiled.library, device)
    segments: dict[str, Any] = {f"{method}_so_blob": compiled.library, f"{method}_weights_blob": compiled.weights}
    spec = MethodSpec(
        name=method,
        device=compiled.device,
        library_segment=f"{method}_so_blob",
        weights_segment=f"{method}_weights_blob",
        inputs=signature.inputs,
        outputs=signature.outputs,
        dims=signature.dims,
        torch_version=torch.__version__,
        compile_options={
            **compiled.options,
            **({} if written is None else written.options()),
        },
    )
    return spec, segments


@dataclass(frozen=True)
class _Choice:
    """Something in a CUDA method's build that the check against eager can take back."""

    what: str  # for the warning: "compiled with <what>"
    off: dict[str, Any]  # the options that compile it without
    record: str  # the manifest key that says why it was taken back


_SINGLE_ROW = _Choice("coordinate-descent tuning (matrix-vector kernels)", {"coordinate_descent_tuning": False}, "coordinate_descent_disagreed")
_FUSED_ATTENTION = _Choice("the fused decode attention", {attention.OPTION: False}, "fused_decode_attention_disagreed")
_CACHE_UPDATE = _Choice("the cache writes and rotations in the fused attention", {attention.UPDATE_OPTION: False}, "fused_cache_updates_disagreed")
_MATVEC = _Choice("the matrix-vector kernel", {matvec.OPTION: False}, "matvec_disagreed")
_COMBO = _Choice("Inductor's combo kernels", {"combo_kernels": False}, "combo_kernels_disagreed")


def _own_choices(compiled: CompiledLibrary, options: Mapping[str, Any]) -> list[_Choice]:
    """What the check against eager may take back from this CUDA method,
    likeliest first: cuda-runner's matrix-vector kernel wherever it took
    calls over, the cache writes and rotations the fused attention took over
    (where the caller did not set the option), the single-row rule's coordinate-descent tuning, the combo
    kernels cuda-runner turned on with the fused attention (each of the two
    where the caller did not set the option; combo kernels only launch
    kernels together, and go with the attention anyway), and the fused
    decode attention. Inductor's kernels as programmatic dependents are
    only ever the caller's choice, and kept."""
    if compiled.device.type != "cuda":
        return []
    choices = []
    if compiled.options.get("matvec_products"):
        choices.append(_MATVEC)
    if compiled.options.get("fused_cache_updates") and attention.UPDATE_OPTION not in options:
        choices.append(_CACHE_UPDATE)
    if compiled.options.get("coordinate_descent_tuning") and "coordinate_descent_tuning" not in options:
        choices.append(_SINGLE_ROW)
    if compiled.options.get("combo_kernels") is True and "combo_kernels" not in options:
        choices.append(_COMBO)
    if compiled.options.get("fused_decode_attention"):
        choices.append(_FUSED_ATTENTION)
    return choices


def _checked_against_eager(
    torch: Any, method: str, program: Any, signature: Any, written: _WrittenState | None, args: tuple, kwargs: dict,
    device: str, progress: Progress, options: Mapping[str, Any], warn: Warn, build: Callable[[Mapping[str, Any]], CompiledLibrary],
    compiled: CompiledLibrary,
) -> tuple[CompiledLibrary, MethodSpec, dict[str, Any]]:
    """The method's library run once on its example inputs against eager where
    its build has something the check may take back (_own_choices;
    compile/check.py); where they disagree, compiled again without them, one
    at a time, the likeliest first."""
    spec, segments = _method_spec(torch, method, signature, compiled, written, device)
    choices = _own_choices(compiled, options)
    taken_back: dict[str, str] = {}
    while choices or taken_back:  # a rebuild with nothing left to take back is checked once more, to say so
        progress(f"checking {method!r} against eager PyTorch on its example inputs")
        try:
            problem = disagreement(torch, program, spec, segments, args, kwargs, device, None if written is None else written.buffers)
        except NotChecked as reason:
            if choices:
                warn(f"method {method!r}: compiled with {' and '.join(choice.what for choice in choices)} "
                     f"and not checked against eager here ({reason})")
            break
        if problem is None:
            break
        if not choices:
            warn(f"method {method!r}: its library still disagrees with eager PyTorch on the example inputs ({problem}); "
                 "bundled as compiled: check its outputs (run --expected)")
            break
        choice = choices.pop(0)
        warn(f"method {method!r}: compiled with {choice.what}, its library disagreed with eager PyTorch on the example inputs "
             f"({problem}); compiled again without it")
        options = {**options, **choice.off}
        taken_back[choice.record] = problem
        compiled = build(options)
        spec, segments = _method_spec(torch, method, signature, compiled, written, device)
        spec = dataclasses.replace(spec, compile_options={**spec.compile_options, **taken_back})
        choices = [choice for choice in _own_choices(compiled, options) if choice.record not in taken_back]  # what this build has
    return compiled, spec, segments


def _compiled(program: Any, args: tuple, kwargs: dict, device: str, progress: Progress, options: Mapping[str, Any], *, cpu_target: str,
              runtime: str, method: str, warn: Warn, written_by_methods: frozenset[str]) -> CompiledLibrary:
    """compile_program, saying where one of cuda-runner's own kernels was asked for and did not compile."""
    compiled = compile_program(program, args, kwargs, device, progress, options, cpu_target, runtime, written_elsewhere=written_by_methods)
    for kernel, (_, failed) in OWN_KERNEL_RECORDS.items():
        failure = compiled.options.get(failed)
        if failure:
            warn(f"method {method!r}: {given_up(kernel, failure, 'compiled')}")
    unavailable = compiled.options.get(PDL_UNAVAILABLE)
    if unavailable:
        warn(f"method {method!r}: {OWN_KERNEL_NAMES['pdl']} were asked for and not taken ({unavailable}); compiled without them")
    return compiled


def _example_inputs(program: Any, device: str) -> tuple[tuple, dict]:
    examples = getattr(program, "example_inputs", None)
    if examples:
        args, kwargs = examples
        return tuple(_to_device(arg, device) for arg in args), {key: _to_device(value, device) for key, value in kwargs.items()}
    raise CompileError("the exported program carries no example inputs; re-export it with torch.export.export and save it again")


def _to_device(value: Any, device: str) -> Any:
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda leaf: leaf.to(device) if hasattr(leaf, "to") else leaf, value)
