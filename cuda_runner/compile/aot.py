"""The ahead-of-time side: ExportedProgram -> self-contained model library + weights blob.

The options follow docs/aoti-abi.md, "Building a library": the library does not link
libtorch (its aoti_torch_* symbols are bound at load time, which is what lets
it run where torch's own loaders crash), the weights go to a separate binary
blob, and CUDA kernels are embedded in the library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CompileError, InputError
from ..format.manifest import DeviceSpec
from ..runtime.devices import checked_isa_flags
from . import attention, convolution, inductor_pdl, matvec
from .inductor_fixes import int_arrays_declared_per_writer

MIN_TORCH = (2, 10)

SELF_CONTAINED_OPTIONS: dict[str, Any] = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "binary_blob",
    "aot_inductor.embed_kernel_binary": True,
    "aot_inductor.link_libtorch": False,
}

# `compile --autotune`: Inductor benchmarks its GEMM and convolution choices
# (Triton templates against the ATen/cuBLAS kernels) and tunes the tile sizes
# of its generated kernels, picking the fastest on this GPU.
AUTOTUNE_OPTIONS: dict[str, Any] = {"max_autotune": True, "coordinate_descent_tuning": True}

# A standalone CUDA compile (the default): GEMMs and convolutions from
# Inductor's Triton templates instead of cuBLAS/cuDNN extern kernels, as
# ExecuTorch's CUDA backend compiles, so the library imports only tensor
# basics, which cuda-runner's own shim provides (attention is lowered with
# SDPA's math backend while compiling, for the same reason; a decode step's
# attention can take a fused kernel of our own instead: compile/attention.py). CPU libraries
# need nothing extra: the shim has GEMMs on a BLAS, convolution and vector math.
#
# Epilogue fusions are not benchmarked (Inductor's benchmark_epilogue_fusion):
# that builds and times each template choice fused with its epilogue again
# for every GEMM and convolution node, not once per shape as the templates
# themselves are, so its cost grows with a network's depth (ViT-B/16's 12
# alike layers, ResNet-50's 53 convolutions). The epilogue is then fused into
# the fastest template, or left a kernel of its own where it cannot be.
#
# Nor are pointwise prologues fused into a template's loads (prologue_fusion):
# the GEMM template hints that its row indices (rows modulo M) are contiguous
# from a multiple of the tile, which is untrue in the last tile where they
# wrap, and harmless only while no load runs along the rows. A prologue that
# reads a value per row does: ViT-B/16's first qkv GEMM took its layer norm,
# whose mean and reciprocal deviation per token Triton then read as 16-byte
# vectors along the hinted rows. M is 197, so in the last tile the wrapped
# rows start vectors at token 3, 12 bytes off alignment: "misaligned
# address", which ends the process's CUDA context (H200, torch 2.11; the
# kernel named by synchronising after every launch, its loads read from the
# PTX Triton builds for it). The prologue runs as a kernel of its own instead.
#
# Choices whose shared memory Inductor estimates above the GPU's are dropped
# before they are built (max_autotune_prune_choices_based_on_shared_mem): the
# largest are the slowest to build, and some do not fit. On one of ResNet-50's
# 3x3 convolutions (128 channels at 28x28, fp32, torch 2.11, H200) Inductor's
# precompile of 16 choices took 19.6 s; the slowest two (BLOCK_K=128) took 8.7
# and 19.7 s and then needed 256 and 288 KiB of shared memory, of the 227 KiB
# there. Pruned, it built 12 in 7.0 s and chose the same kernel. The estimate
# is generous, so a choice that would just fit can be dropped.
STANDALONE_CUDA_OPTIONS: dict[str, Any] = {
    "max_autotune": True, "max_autotune_gemm_backends": "TRITON", "max_autotune_conv_backends": "TRITON",
    "benchmark_epilogue_fusion": False, "prologue_fusion": False, "max_autotune_prune_choices_based_on_shared_mem": True,
}

# A CUDA method whose weights mostly go to products of a single row (a decode
# step: one token through every Linear; single_row_share) is compiled with
# coordinate-descent tuning on. With it, Inductor lowers each such product as
# a reduction over the weight's rows, a matrix-vector kernel it fuses with its
# neighbours and tunes to the memory bandwidth, instead of a GEMM template
# made for tiles of many rows (docs/benchmarks.md, "A 1B-parameter
# Llama-shaped decoder").
SINGLE_ROW_OPTIONS: dict[str, Any] = {"coordinate_descent_tuning": True}

# `compile --quick`: less autotuning, for a standalone library sooner: one
# Triton configuration per GEMM and convolution (Inductor's first heuristic
# choice, so most are not benchmarked at all). Single-row methods keep their
# matrix-vector kernels: without them a decode step of the 1B decoder took
# 11.5 ms instead of 1.5 (docs/benchmarks.md has what --quick costs).
QUICK_OPTIONS: dict[str, Any] = {"test_configs.max_mm_configs": 1}

# cuda-runner's own compile options, next to Inductor's (never passed to it): the one that turns each own kernel on or off.
OWN_KERNEL_OPTIONS = {"attention": attention.OPTION, "update": attention.UPDATE_OPTION, "matvec": matvec.OPTION, "pdl": inductor_pdl.OWN_OPTION}
_OWN_OPTIONS = frozenset(OWN_KERNEL_OPTIONS.values())

# What the runtime relies on: a user option may not change these.
_PROTECTED_OPTIONS = frozenset(SELF_CONTAINED_OPTIONS) | {"aot_inductor.output_path", "cpp.cxx", "aot_inductor.check_lowerbound"}

# `compile --cpu-target`: what a CPU bundle's code may assume of the CPU it runs on.
# "native" is the build CPU (-march=native and Inductor's best vector ISA there);
# the others are portable: a psABI -march level and the vector width Inductor
# picks its ISA by (cpp.simdlen; 0 matches no ISA: scalar code).
CPU_TARGETS: dict[str, tuple[str, int] | None] = {
    "native": None,
    "avx512": ("x86-64-v4", 512),
    "avx2": ("x86-64-v3", 256),
    "scalar": ("x86-64", 0),
}
# The default: the widest portable level the build CPU has, so that a bundle
# built on one vendor's CPU runs on another's with the same vector width
# (-march=native made it require every flag of the build CPU: sse4a, sha_ni...).
PORTABLE = "portable"
DEFAULT_CPU_TARGET = PORTABLE
# /proc/cpuinfo flags of each level (the psABI's x86-64-v3 and -v4).
_LEVEL_FLAGS = {
    "avx2": frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "popcnt", "sse4_1", "sse4_2", "ssse3", "abm"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
}


def portable_target(host_flags: frozenset[str]) -> str:
    """The widest portable level a CPU with these flags can run ("native" off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "native"
    level = {name: checked_isa_flags(flags) for name, flags in _LEVEL_FLAGS.items()}  # what cpu_isa_flags can report
    if level["avx2"] <= host_flags:
        return "avx512" if level["avx512"] <= host_flags else "avx2"
    return "scalar"

Progress = Callable[[str], None]


def check_options(torch: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """Inductor config values given by the user: known keys, values of the default's type."""
    known = torch._inductor.config.get_config_copy()
    checked = {}
    for key, value in options.items():
        if key in _OWN_OPTIONS:
            if not isinstance(value, bool):
                raise InputError(f"option {key!r} takes true or false, not {value!r}", subject="option")
            checked[key] = value
            continue
        if key in _PROTECTED_OPTIONS:
            raise InputError(f"option {key!r} is set by cuda-runner (the bundle depends on it) and cannot be changed", subject="option")
        if key not in known:
            raise InputError(f"{key!r} is not an Inductor option (see torch._inductor.config)", subject="option")
        if isinstance(value, str) and inductor_pdl.PROGRAMMATIC_MARK in value:
            # Such a value can end up in kernel names (aot_inductor.model_name_for_generated_files), where the
            # shim would take a kernel without waits for one launched as a programmatic dependent.
            raise InputError(f"option {key!r}: {value!r} holds {inductor_pdl.PROGRAMMATIC_MARK!r}, which cuda-runner keeps for the names of "
                             "kernels it launches as programmatic dependents", subject="option")
        default = known[key]
        if isinstance(default, bool) and not isinstance(value, bool):
            raise InputError(f"option {key!r} takes true or false, not {value!r}", subject="option")
        if isinstance(default, (int, float)) and not isinstance(default, bool) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InputError(f"option {key!r} takes a number, not {value!r}", subject="option")
        checked[key] = value
    return checked


@dataclass(frozen=True)
class CompiledLibrary:
    library: bytes
    weights: bytes
    device: DeviceSpec
    options: dict[str, Any]
    note: str | None = None  # what the user should hear of this compile (a fallback to libtorch)
    added_constants: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # tensors the build added to the program, by name
    positions: tuple[tuple[str, int], ...] = ()  # inputs the fused attention takes as its position, proven for 0..length-1 (Fused)


# What a compiled library may need at run time (compile_module's `runtime`).
RUNTIMES = ("auto", "standalone", "libtorch")
# What a library bound to libtorch costs, for the line that says a compile fell back to one (docs/benchmarks.md).
LIBTORCH_COST = "it needs torch installed where it runs, and its cold start is about 0.5 s longer"


def import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise CompileError("compiling needs PyTorch 2.10 or newer; install it with: pip install 'cuda-runner[torch]'") from None
    version = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    if version < MIN_TORCH:
        raise CompileError(f"torch {torch.__version__} is too old: AOTInductor weight blobs and link_libtorch=False need torch 2.10 or newer")
    return torch


NO_GPU = "--device cuda needs a CUDA GPU visible to PyTorch, and none is; compile with --device cpu, or on a GPU machine"


def check_device(torch: Any, device: str) -> str:
    """Normalise and check the compile device: 'cpu', 'cuda' or 'cuda:N'."""
    if device == "cpu":
        return device
    if not re.fullmatch(r"cuda(:\d{1,4})?", device):
        raise InputError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'", subject="device")
    if not torch.cuda.is_available():
        raise CompileError(NO_GPU)
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise CompileError(f"{device} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}"


def check_cpu_target(target: str) -> str:
    """The target to build for: `portable` resolved to this CPU's level."""
    if target == PORTABLE:
        from ..runtime.devices import cpu_isa_flags

        return portable_target(cpu_isa_flags())
    if target not in CPU_TARGETS:
        raise InputError(f"unknown CPU target {target!r}; use one of {PORTABLE}, {', '.join(CPU_TARGETS)}", subject="cpu-target")
    if CPU_TARGETS[target] is not None and platform.machine() not in ("x86_64", "AMD64"):
        raise InputError(f"CPU target {target!r} is an x86-64 level; this machine is {platform.machine()} (use native)", subject="cpu-target")
    return target


def compile_program(
    program: Any, example_args: tuple, example_kwargs: Mapping[str, Any], device: str, progress: Progress,
    user_options: Mapping[str, Any] | None = None, cpu_target: str = DEFAULT_CPU_TARGET, runtime: str = "auto",
    written_elsewhere: frozenset[str] = frozenset(),
) -> CompiledLibrary:
    """Compile an ExportedProgram that already lives on `device`, for `runtime`
    (RUNTIMES): a CUDA library is compiled standalone unless runtime is
    "libtorch", and compiled again bound to libtorch where the standalone one
    still needs libtorch and runtime is "auto". `written_elsewhere` names the
    module tensors other methods of the bundle write (shared with this one)."""
    if device == "cpu" or runtime == "libtorch":
        # A standalone CPU compile differs only in its attention, lowered from SDPA's math form (the shim has no flash attention).
        standalone = runtime == "standalone"
        compiled = _compile_once(program, example_args, example_kwargs, device, progress, user_options, cpu_target, standalone=standalone,
                                 written_elsewhere=written_elsewhere)
        if standalone:
            _check_standalone(compiled.library)
            compiled.options["standalone"] = True
        return compiled
    try:
        compiled = _compile_once(program, example_args, example_kwargs, device, progress, user_options, cpu_target, standalone=True,
                                 written_elsewhere=written_elsewhere)
        refusal = standalone_refusal(compiled.library)
    except CompileError as error:
        failure = str(error).removeprefix("AOTInductor compile failed: ")
        if gpu_unusable_after(error):
            # A kernel fault (seen: a misaligned address compiling ViT-B/16) leaves this
            # process's CUDA context broken: a second compile here would only fail on it.
            raise CompileError(gpu_fault_message(failure, getattr(error, "in_graph", ()), libtorch=runtime != "standalone")) from error
        if runtime == "standalone":
            raise
        refusal = f"the standalone compile failed ({failure})"
    if refusal is None:
        compiled.options["standalone"] = True
        return compiled
    if runtime == "standalone":
        raise CompileError(f"--standalone: the compiled library cannot run without libtorch: {refusal}; compile without --standalone to run it on libtorch")
    progress("compiling again, bound to libtorch")
    compiled = _compile_once(program, example_args, example_kwargs, device, progress, user_options, cpu_target, standalone=False,
                             written_elsewhere=written_elsewhere)
    compiled.options["libtorch_because"] = refusal
    return dataclasses.replace(compiled, note=f"compiled bound to libtorch: {refusal}; {LIBTORCH_COST}")


# The ATen ops that multiply by a weight (or another operand): which argument
# is the left operand (None for convolutions, never one row) and which the
# right one, the weight whose elements a call reads.
_PRODUCTS: dict[str, tuple[int | None, int]] = {
    "mm": (0, 1), "addmm": (1, 2), "linear": (0, 1), "bmm": (0, 1), "baddbmm": (1, 2), "matmul": (0, 1),
    "convolution": (None, 1), "conv1d": (None, 1), "conv2d": (None, 1), "conv3d": (None, 1),
}
# The single-row rule applies where products of one row read at least this
# share of the weight elements all products read: a decode step (every
# projection one token), not a network with one batch-1 head (ViT's
# classifier, ResNet's fc), where coordinate descent would tune every kernel
# of the network for the sake of a small one.
SINGLE_ROW_SHARE = 0.5


def single_row_share(program: Any) -> float:
    """The share of the weight elements an ExportedProgram's matrix products and
    convolutions read that go to products of exactly one row, statically: the
    products Inductor can lower as matrix-vector kernels. A linear's input
    [..., K] is one row when every leading dim is 1; the left operand [..., M, K]
    of the others when M is 1 (per batch, for bmm), or when it is a vector."""
    single = total = 0
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(getattr(node.target, "__name__", "")).split(".")[0]
        operands = _PRODUCTS.get(name)
        if operands is None or len(node.args) <= operands[1]:
            continue
        elements = _static_elements(_shape(node.args[operands[1]]))
        total += elements
        if operands[0] is not None and _one_row(name, _shape(node.args[operands[0]])):
            single += elements
    return single / total if total else 0.0


def _shape(argument: Any) -> tuple[Any, ...]:
    return tuple(getattr(getattr(argument, "meta", {}).get("val"), "shape", ()))


def _static_elements(shape: tuple[Any, ...]) -> int:
    """Its element count, or 0 where a size is symbolic."""
    count = 1
    for size in shape:
        if not isinstance(size, int):
            return 0
        count *= size
    return count


def _one_row(product: str, shape: tuple[Any, ...]) -> bool:
    if product == "linear" or (product == "matmul" and len(shape) == 1):
        return len(shape) >= 1 and all(_is_one(size) for size in shape[:-1])
    return len(shape) >= 2 and _is_one(shape[-2])


def _is_one(size: Any) -> bool:
    return isinstance(size, int) and size == 1


def standalone_refusal(library: bytes) -> str | None:
    """Why a compiled library cannot run on cuda-runner's shim alone, or None."""
    from ..runtime.providers import own_shim_refusal

    return own_shim_refusal(library)


def _compile_once(
    program: Any, example_args: tuple, example_kwargs: Mapping[str, Any], device: str, progress: Progress,
    user_options: Mapping[str, Any] | None, cpu_target: str, standalone: bool, written_elsewhere: frozenset[str] = frozenset(),
) -> CompiledLibrary:
    torch = import_torch()
    work_dir = Path(tempfile.mkdtemp(prefix="cuda-runner-compile-"))
    profile = dict(STANDALONE_CUDA_OPTIONS) if standalone and device != "cpu" else {}
    one_row_method = device != "cpu" and single_row_share(program) >= SINGLE_ROW_SHARE
    if one_row_method:
        profile.update(SINGLE_ROW_OPTIONS)
    own = {key: value for key, value in (user_options or {}).items() if key in _OWN_OPTIONS}
    inductor_options = {key: value for key, value in (user_options or {}).items() if key not in _OWN_OPTIONS}
    options = {**profile, **inductor_options, **SELF_CONTAINED_OPTIONS, "aot_inductor.output_path": str(work_dir)}
    cpu_build: _CpuBuild | None = None
    isa_pin = contextlib.ExitStack()  # holds Inductor to the level's plain ISA until the compile ends
    try:
        cpu_target = check_cpu_target(cpu_target) if device == "cpu" else cpu_target
        level = CPU_TARGETS[cpu_target] if device == "cpu" else None
        has_march = _inductor_has_march(torch)
        compiler = _unloadable_compiler(work_dir, None if level is None or has_march else level[0])
        options["cpp.cxx"] = (None, compiler)
        if device == "cpu":
            cpu_build = _cpu_build(torch, compiler, cpu_target, has_march, options, isa_pin)
            options = {**cpu_build.options, **options}  # the user's cpp.* options win
        if hasattr(torch._inductor.config.aot_inductor, "check_lowerbound"):
            # The library's own input checks (run --check-inputs) would refuse
            # sizes 0 and 1 of every dynamic dim, which export assumes >= 2 but
            # the generated code handles; the manifest's bounds are checked anyway.
            options["aot_inductor.check_lowerbound"] = False
        kernels = own_kernels_for(own, standalone and device != "cpu" and triton_ops_available(), one_row_method, inductor_options)
        kernels.written_elsewhere = written_elsewhere
        library_path = _aot_compile(torch, program, example_args, example_kwargs, options, standalone, device, kernels, progress)
        weights_path = library_path.with_name(library_path.name[: -len(".so")] + "_weights.blob")
        metadata = _sidecar_metadata(library_path)
        built_with = _with_kernel_options(options, kernels.in_graph())
        recorded = {key: value for key, value in built_with.items() if key not in ("aot_inductor.output_path", "cpp.cxx")}
        recorded["cxx_flags"] = list(EXTRA_CXX_FLAGS)
        recorded.update(own)
        recorded.update(kernels.record())
        if own.get(inductor_pdl.OWN_OPTION) and not kernels.pdl and "pdl" not in kernels.failures:
            recorded[PDL_UNAVAILABLE] = (f"it needs a standalone CUDA build, Triton, {inductor_pdl.OPTION} left on, and an Inductor "
                                         "that generates the waits, as torch 2.11 and 2.13 do")
        if cpu_build is not None:
            recorded["cpu_target"] = cpu_target
            recorded["cpu_build_flags"] = list(cpu_build.flags)
            isa = metadata.get("AOTI_CPU_ISA")
            if isa is not None and isa != cpu_build.isa:
                raise CompileError(f"Inductor built {isa} code where its probe had chosen {cpu_build.isa}; compile in a fresh process")
        return CompiledLibrary(
            library=library_path.read_bytes(),
            weights=weights_path.read_bytes() if weights_path.exists() else b"",
            device=_device_spec(torch, device, metadata, cpu_build),
            options=recorded,
            added_constants=dict(kernels.added_constants),
            positions=kernels.positions,
        )
    finally:
        isa_pin.close()  # the one place the pin is released, however the compile ended
        shutil.rmtree(work_dir, ignore_errors=True)


def _one_ptxas_for_autotuning() -> None:
    """Name torch's own ptxas for Triton in this process, as Inductor's compile
    workers do. Autotuning has the workers build each choice, then loads and
    times it here; but this process names that ptxas only when it first builds
    a kernel of the finished graph, after autotuning. Triton keys its cache by
    the ptxas version, so until then every choice missed the workers' build
    and was built again, one at a time, on this thread: timing the 20 choices
    of one of ViT-B/16's GEMMs took 22-37 s on the H200 (torch 2.11), and 0.4-0.8 s
    once the ptxas was named first. It matters only where the torch wheel ships
    a ptxas of its own (the CUDA 13 builds); a TRITON_PTXAS_PATH the user set is
    kept. The name stays set in this process, as Inductor leaves it anyway."""
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # another torch layout: nothing to align
        return
    _set_triton_ptxas_path()


def own_kernels_for(own: Mapping[str, Any], possible: bool, one_row_method: bool, inductor_options: Mapping[str, Any]) -> OwnKernels:
    """cuda-runner's own kernels for a standalone CUDA build (`possible`): a decode
    step's attention in one kernel (compile/attention.py) wherever the graph has
    one, and products of one row, with the norms, gates and residuals around
    them, in another (compile/matvec.py: the 1B decoder's step 0.85 ms with a
    CUDA graph against 1.15-1.5 with Inductor's reductions) in a method that
    passes the single-row rule (SINGLE_ROW_SHARE), as a decode step does.
    Elsewhere a product of one row is a network's batch-1 head (ViT-B/16's
    classifier), a small share of its weights, where the kernel would gain
    little. =true asks for either anyway, =false turns it off. Combo kernels
    come with the attention unless `inductor_options` set them. Inductor's
    kernels become programmatic dependents (compile/inductor_pdl.py) where
    =true asks for it and the torch allows it, unless `inductor_options` turn
    triton.enable_pdl off."""
    return OwnKernels(attention=possible and bool(own.get(attention.OPTION, True)),
                      update=possible and bool(own.get(attention.OPTION, True)) and bool(own.get(attention.UPDATE_OPTION, True)),
                      matvec=possible and bool(own.get(matvec.OPTION, one_row_method)),
                      combo="combo_kernels" not in inductor_options,
                      pdl=possible and bool(own.get(inductor_pdl.OWN_OPTION, False)) and inductor_options.get(inductor_pdl.OPTION) is not False
                      and inductor_pdl.available(import_torch()))


def triton_ops_available() -> bool:
    """Whether this torch can compile cuda-runner's own kernels: Triton and torch.library.triton_op."""
    try:
        import triton  # noqa: F401
        from torch.library import triton_op, wrap_triton  # noqa: F401
    except ImportError:
        return False
    return True


# How the manifest's compile options name what happened to each own kernel: (calls it took, why it was given up).
# Combo kernels are Inductor's, taken with the fused attention (_with_kernel_options):
# given up like the kernels when a build fails, so that a failure of theirs costs
# neither kernel.
OWN_KERNEL_RECORDS = {"attention": ("fused_decode_attention", "fused_decode_attention_failed"),
                      "update": ("fused_cache_updates", "fused_cache_updates_failed"), "matvec": ("matvec_products", "matvec_failed"),
                      "combo": ("combo_kernels", "combo_kernels_failed"),
                      "pdl": ("programmatic_inductor_kernels", "programmatic_inductor_kernels_failed")}
# Where a build asked for Inductor's kernels as programmatic dependents could not take them: why.
PDL_UNAVAILABLE = "programmatic_inductor_kernels_unavailable"
# How a user hears of each, and the option that leaves it out.
OWN_KERNEL_NAMES = {"attention": "the fused decode attention", "update": "the cache writes and rotations in the fused attention",
                    "matvec": "the matrix-vector kernel", "combo": "Inductor's combo kernels",
                    "pdl": "Inductor's kernels as programmatic dependents"}
_OFF_OPTIONS = {**OWN_KERNEL_OPTIONS, "combo": "combo_kernels"}
# Own kernels a user hears of in the plural.
_PLURAL = frozenset({"update", "combo", "pdl"})


def given_up(kernel: str, failure: str, then: str) -> str:
    """One line for a kernel (OWN_KERNEL_NAMES) whose build failed: `then` is "compiling" or "compiled"."""
    return f"{OWN_KERNEL_NAMES[kernel]} did not compile ({failure}); {then} without {'them' if kernel in _PLURAL else 'it'}"


class GpuFault(CompileError):
    """A compile that faulted the GPU, with cuda-runner's own kernels that were in its graph."""

    def __init__(self, message: str, in_graph: tuple[str, ...]) -> None:
        super().__init__(message)
        self.in_graph = in_graph

    def __reduce__(self) -> tuple[Any, tuple[str, tuple[str, ...]]]:
        # As the isolated compile's child sends its error back: pickled, with both arguments.
        return (type(self), (str(self), self.in_graph))


def gpu_fault_message(failure: str, in_graph: Sequence[str], libtorch: bool = True) -> str:
    """One line for a compile that faulted the GPU: the fault, and what to compile
    again with, in a new process (this one cannot use the GPU any more)."""
    remedies = []
    if in_graph:
        named = [OWN_KERNEL_NAMES[kernel] for kernel in in_graph]
        names = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"
        options = " ".join(f"--option {_OFF_OPTIONS[kernel]}=false" for kernel in in_graph)
        one = len(in_graph) == 1
        remedies.append(f"{options} ({names} {'was' if one else 'were'} in the graph; leaving {'it' if one else 'them'} out may avoid the fault)")
    if libtorch:
        remedies.append("--libtorch")
    advice = f"; compile again in a new process with {' or with '.join(remedies)}" if remedies else "; compile again in a new process"
    return f"the standalone compile faulted the GPU ({failure}), and this process cannot use it again{advice}"


@dataclass
class OwnKernels:
    """cuda-runner's own kernels in one build: which to use, how many calls each
    took over, and why one was given up (its compile failed)."""

    attention: bool  # the fused decode attention (compile/attention.py)
    matvec: bool  # the matrix-vector kernel (compile/matvec.py)
    update: bool = False  # the attention writes the step's key and value, and rotates them (attention.UPDATE_OPTION)
    combo: bool = True  # Inductor's combo kernels with the attention (false where the user set the option)
    combo_on_trial: bool = False  # the last build left them out to see whether its failure was theirs
    combo_cleared: bool = False  # a build failed without them too: not suspected again
    pdl: bool = False  # Inductor's kernels as programmatic dependents (compile/inductor_pdl.py)
    written_elsewhere: frozenset[str] = frozenset()  # module tensors other methods of the bundle write
    fused: int = 0  # SDPA calls the attention took
    position_limits: int = 0  # of those, the ones whose mask it replaced by the step's position
    cache_updates: int = 0  # of those, the ones that write the step's key and value into the caches
    rotations: int = 0  # the queries and keys they rotate
    added_constants: dict[str, Any] = dataclasses.field(default_factory=dict)  # the rotation tables the last apply() added, by name
    positions: tuple[tuple[str, int], ...] = ()  # the inputs the last apply()'s attention took as its position (Fused.positions)
    products: int = 0  # products of one row the matvec took
    launches: int = 0  # the kernel launches they became (several share one where it fused them)
    programmatic: int = 0  # Inductor's kernels the last build named for programmatic launches
    failures: dict[str, str] = dataclasses.field(default_factory=dict)  # "attention"/"matvec" -> why given up

    def record(self) -> dict[str, Any]:
        counts = {"attention": self.fused, "update": self.cache_updates, "matvec": self.products, "combo": "combo" in self.in_graph(),
                  "pdl": self.programmatic if self.pdl else 0}
        recorded: dict[str, Any] = {}
        for kernel, (used, failed) in OWN_KERNEL_RECORDS.items():
            if counts[kernel]:
                recorded[used] = counts[kernel]
            if kernel in self.failures:
                recorded[failed] = self.failures[kernel]
        if self.products:
            recorded["matvec_launches"] = self.launches
        if self.position_limits:
            recorded["fused_decode_attention_position_limits"] = self.position_limits
        if self.rotations:
            recorded["fused_rotations"] = self.rotations
        return recorded

    def apply(self, module: Any, in_use: list[str]) -> None:
        """Put the kernels in `module`'s graph, each named in `in_use` (newest last)
        before its rewrite starts: a failure from then on may be the kernel's."""
        self.fused = self.products = self.launches = self.position_limits = self.cache_updates = self.rotations = 0
        self.added_constants, self.positions = {}, ()
        if self.attention:
            in_use.append("attention")
            if self.update:
                in_use.append("update")  # a rewrite that fails gives up the update first, the attention after
            # Before use_matvec: the attention's proof that a launch comes before it looks for aten's products.
            fused = attention.fuse_decode_attention(module, self.written_elsewhere, update_caches=self.update)
            if self.update:
                in_use.pop()  # back below, as the newest of the build's kernels, where it was taken
            self.fused, self.position_limits = fused.calls, fused.position_limits
            self.cache_updates, self.rotations = fused.cache_updates, fused.rotations
            self.added_constants, self.positions = dict(fused.tables), fused.positions
            if not self.fused:
                in_use.pop()
        if self.matvec:
            in_use.append("matvec")
            used = matvec.use_matvec(module, written_elsewhere=self.written_elsewhere)
            self.products, self.launches = used.products, used.launches
            if not self.products:
                in_use.pop()
        if self.cache_updates:
            in_use.append("update")  # newer than the attention and the products: given up before them
        if self.fused and self.combo:
            in_use.append("combo")
        if self.pdl:
            in_use.append("pdl")  # the newest: given up first

    def in_graph(self) -> list[str]:
        """The kernels the last apply() put in the graph."""
        return [kernel for kernel, count in (("attention", self.fused), ("matvec", self.products), ("update", self.cache_updates),
                                             ("combo", self.fused and self.combo), ("pdl", self.pdl)) if count]

    def give_up(self, kernel: str, failure: str) -> None:
        setattr(self, kernel, False)
        self.failures[kernel] = failure

    def blame(self, in_use: list[str], failure: str) -> list[str]:
        """Give up the newest of `in_use` (the build's, as apply() listed them)
        that may have made it fail; what to tell the user. Combo kernels are
        given up on trial: where the build fails without them too, the failure
        was not theirs, so they come back and the newest kernel goes; they are
        tried without again only after that (both may fail). Combo kernels are
        worth about 0.06 ms of the 1B decoder's step (docs/benchmarks.md)."""
        lines = []
        if self.combo_on_trial:
            self.combo, self.combo_on_trial, self.combo_cleared = True, False, True
            del self.failures["combo"]
            lines.append("the build failed without Inductor's combo kernels too: compiling with them again")
        suspect = [kernel for kernel in in_use if not (kernel == "combo" and self.combo_cleared)][-1]
        self.give_up(suspect, failure)
        self.combo_on_trial = suspect == "combo"
        self.combo_cleared = False  # something went: the next failure may be theirs again
        lines.append(given_up(suspect, failure, "compiling"))
        return lines


# What a user is told as the compile starts: an autotuned one (every standalone CUDA
# build) times every GEMM and convolution on this GPU, which took ResNet-50 over
# 200 s on the H200 (docs/standalone.md).
_COMPILE_NOTICE = {
    "plain": "compiling with AOTInductor (this takes tens of seconds)",
    "autotuned": "compiling with AOTInductor, timing each GEMM and convolution on this GPU (minutes for a large network; --quick is sooner)",
}


def _aot_compile(
    torch: Any, program: Any, example_args: tuple, example_kwargs: Mapping[str, Any], options: Mapping[str, Any], standalone: bool,
    device: str, kernels: OwnKernels, progress: Progress,
) -> Path:
    """The library AOTInductor builds from the program, with cuda-runner's own
    kernels where they apply (`kernels` says which were used). A compile that
    fails with one of them in the graph is done again without it, the newest
    first (OwnKernels.blame): a kernel is an optimisation, never a reason to lose the build. But
    not after a GPU fault, which no later compile in the process survives:
    that raises GpuFault, naming the kernels that were in the graph."""
    if device != "cpu":
        _one_ptxas_for_autotuning()
    while True:
        in_use: list[str] = []
        try:
            module = program.module()  # a new graph module: the program itself stays as exported
            kernels.apply(module, in_use)
            if standalone and device != "cpu":
                attention.pin_sdpa_layout(module)
                convolution.as_two_dimensional(module)
            progress(_COMPILE_NOTICE["autotuned" if options.get("max_autotune") else "plain"])
            with (_math_attention(torch) if standalone else contextlib.nullcontext(), torch_talking_to_itself(),
                  int_arrays_declared_per_writer(),
                  inductor_pdl.programmatic_kernels(torch) if "pdl" in in_use else contextlib.nullcontext() as named):
                built = Path(torch._inductor.aot_compile(module, example_args, dict(example_kwargs), options=_with_kernel_options(options, in_use)))
            kernels.programmatic = named.named if named is not None else 0
            return built
        except Exception as error:  # inductor raises many types; report one line
            if not in_use:
                raise CompileError(f"AOTInductor compile failed: {type(error).__name__}: {compile_failure(error)}") from error
            if gpu_unusable_after(error):  # no second compile can run in this process
                raise GpuFault(f"AOTInductor compile failed: {type(error).__name__}: {compile_failure(error)}", tuple(in_use)) from error
            for line in kernels.blame(in_use, f"{type(error).__name__}: {compile_failure(error)}"):
                progress(line)


@contextlib.contextmanager
def torch_talking_to_itself() -> Iterator[None]:
    """Silence what torch warns about its own code: torch 2.13 deep-copies its
    graphs through a TreeSpec check it deprecated itself (a FutureWarning on
    every compile, which no caller can act on). Other warnings pass."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        yield


def _math_attention(torch: Any) -> Any:
    """SDPA lowered from its math form (no flash/efficient-attention extern kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _check_standalone(library: bytes) -> None:
    """Refuse a --standalone library that still imports what only libtorch provides."""
    refusal = standalone_refusal(library)
    if refusal is not None:
        raise CompileError(f"--standalone: the compiled library cannot run without libtorch: {refusal}; "
                           "compile without --standalone to run it on libtorch")


@dataclass(frozen=True)
class _CpuBuild:
    options: dict[str, Any]  # Inductor config that pins the target and the probe's answer
    isa: str  # AOTI_CPU_ISA of the chosen vector ISA ("AVX2", "INVALID_VEC_ISA")
    flags: tuple[str, ...]  # the -march and vector-ISA flags the library is built with
    required: tuple[str, ...]  # /proc/cpuinfo flags those flags let the compiler use


# The plain Inductor ISA of each portable vector width (its str()).
_PLAIN_ISA = {512: "avx512", 256: "avx2"}


@contextlib.contextmanager
def _plain_isa_of(level: tuple[str, int] | None) -> Iterator[None]:
    """Inductor's vector ISA, for a portable level, is the plain one of its width.

    Inductor picks the first ISA of the width that the build CPU has, and on a
    CPU with AMX or AVX512-VNNI/BF16 that one adds their flags (-mamx-tile,
    -mavx512vnni, -mavx512bf16): a bundle for the portable level would then
    require them, and refuse an AVX-512 CPU without them (an Ice Lake, a Zen 4).
    Inductor's list of valid ISAs is a cached list it picks from on every
    call; for the compile it holds only the plain ISA, its bf16 build off.
    """
    from torch._inductor import cpu_vec_isa

    plain = _PLAIN_ISA.get(level[1]) if level is not None else None
    valid = cpu_vec_isa.valid_vec_isa_list()
    if plain is None or not isinstance(valid, list):
        yield
        return
    saved = list(valid)
    valid[:] = [isa for isa in saved if str(isa) == plain]
    bf16 = [(isa, vars(isa).get("_is_avx512_bf16_supported")) for isa in valid if hasattr(isa, "_is_avx512_bf16_supported")]
    for isa, _ in bf16:
        isa._is_avx512_bf16_supported = False
    _forget_bf16_answers(cpu_vec_isa)
    try:
        yield
    finally:
        valid[:] = saved
        for isa, before in bf16:
            if before is None:
                vars(isa).pop("_is_avx512_bf16_supported", None)
            else:
                isa._is_avx512_bf16_supported = before
        _forget_bf16_answers(cpu_vec_isa)


def _forget_bf16_answers(cpu_vec_isa: Any) -> None:
    """Drop the cached answers of VecAVX512.is_avx512_bf16_supported."""
    method: Any = getattr(getattr(cpu_vec_isa, "VecAVX512", None), "is_avx512_bf16_supported", None)
    clear = getattr(method, "cache_clear", None)
    if clear is not None:
        clear()


def _inductor_has_march(torch: Any) -> bool:
    """Whether Inductor takes the -march level from cpp.march (torch 2.13);
    before that it always passes -march=native, which our wrapper rewrites."""
    return hasattr(torch._inductor.config.cpp, "march")


def _cpu_build(
    torch: Any, compiler: str, target: str, has_march: bool, options: Mapping[str, Any], isa_pin: contextlib.ExitStack,
) -> _CpuBuild:
    """Choose the vector ISA before compiling, with Inductor's own probe.

    The probe (VecISA.check_build) compiles a tiny library that calls Sleef's
    exp and dlopens it in a child Python that does not import torch: the
    Sleef symbols resolve only because the probe links libtorch_cpu, which it
    does only when aot_inductor.link_libtorch is on. Under our
    link_libtorch=False every probe fails ("undefined symbol:
    Sleef_expf16_u10") and Inductor writes scalar code. So the probe runs here
    with link_libtorch on (the model library is still built without it), and
    its answer is pinned for the compile: Inductor caches the ISA list and each
    ISA's answer for the process, and cpp.vec_isa_ok=True skips any new probe.
    For a portable level the ISA is pinned to the level's plain one in
    `isa_pin`, which the caller holds open over the compile.
    """
    from torch._inductor import cpu_vec_isa

    config = torch._inductor.config
    settings: dict[str, Any] = {}
    level = CPU_TARGETS[target]
    if level is not None:
        settings["cpp.simdlen"] = level[1]
        if has_march:
            settings["cpp.march"] = level[0]
    probe = {**settings, **options, "aot_inductor.link_libtorch": True}
    with config.patch(probe), _probe_cache():
        # Inside the probe's settings: the list of valid ISAs is made (and
        # cached) by the first call, and only a probe linked to libtorch passes.
        isa_pin.enter_context(_plain_isa_of(level))
        isa = cpu_vec_isa.pick_vec_isa()
        arch = _arch_flags(config, compiler, level)
        isa_flags = isa.build_arch_flags().split() if isa else []
    name = str(isa).upper()
    if level is not None and level[1] and isa.bit_width() != level[1]:
        raise CompileError(f"--cpu-target {target} needs a build CPU, compiler and torch that can build {level[1]}-bit vector code; Inductor found {name}")
    if isa:
        settings["cpp.vec_isa_ok"] = True  # the probe passed: do not run it again without libtorch
    flags = tuple(arch + isa_flags)
    return _CpuBuild(settings, name, flags, _flags_enabled_by(compiler, flags))


@contextlib.contextmanager
def _probe_cache() -> Iterator[None]:
    """A cache folder of the probe's own. Inductor reuses a probe library it
    finds in its cache, keyed by compiler, ISA flags and torch version but not
    by the link flags: one left by a probe without libtorch (any earlier
    link_libtorch=False compile) fails to load, and the ISA is lost again."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    variable = "TORCHINDUCTOR_CACHE_DIR"
    previous = os.environ.get(variable)
    os.environ[variable] = os.path.join(cache_dir(), "cuda-runner-isa-probe")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = previous


def _arch_flags(config: Any, compiler: str, level: tuple[str, int] | None) -> list[str]:
    """The -march flag Inductor (or our wrapper) puts on the command line."""
    if level is not None:
        return [f"-march={level[0]}"]
    try:
        from torch._inductor.cpp_builder import _get_cpu_arch_cflags

        return [f"-{flag}" for flag in _get_cpu_arch_cflags(compiler)]
    except ImportError:  # before torch 2.13: always -march=native (mcpu on POWER)
        return ["-mcpu=native" if platform.machine() == "ppc64le" else "-march=native"]


# The compiler's predefined macros for an ISA extension, and its /proc/cpuinfo flag.
_MACRO_FLAGS = {
    "__SSE2__": "sse2", "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2",
    "__SSE4A__": "sse4a", "__POPCNT__": "popcnt", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma",
    "__FMA4__": "fma4", "__F16C__": "f16c", "__BMI__": "bmi1", "__BMI2__": "bmi2", "__LZCNT__": "abm",
    "__MOVBE__": "movbe", "__ADX__": "adx", "__SHA__": "sha_ni", "__VAES__": "vaes", "__VPCLMULQDQ__": "vpclmulqdq",
    "__GFNI__": "gfni", "__AVXVNNI__": "avx_vnni", "__AVX512F__": "avx512f", "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl", "__AVX512BW__": "avx512bw", "__AVX512CD__": "avx512cd", "__AVX512IFMA__": "avx512ifma",
    "__AVX512VBMI__": "avx512vbmi", "__AVX512VBMI2__": "avx512_vbmi2", "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BITALG__": "avx512_bitalg", "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq", "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16", "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16",
    "__AMX_INT8__": "amx_int8", "__AMX_FP16__": "amx_fp16",
}


def _flags_enabled_by(compiler: str, flags: Sequence[str]) -> tuple[str, ...]:
    """The CPU flags (as /proc/cpuinfo names them, among those the runner checks)
    whose instructions the compiler may emit under `flags`: the ISA macros it
    predefines for them. -march=native gives the build CPU's; a portable level
    gives that level's, whatever CPU builds it."""
    try:
        result = subprocess.run([compiler, *flags, "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        raise CompileError(f"cannot run the compiler to see what {' '.join(flags)} enable: {_first_line(error)}") from error
    if result.returncode != 0:
        raise CompileError(f"the compiler refuses {' '.join(flags)}: {_first_line(RuntimeError(result.stderr))}")
    macros = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define ")}
    return tuple(sorted(checked_isa_flags(flag for macro, flag in _MACRO_FLAGS.items() if macro in macros)))


# Without STB_GNU_UNIQUE symbols a library can be unloaded (dlclose) once no
# live thread has called into it. Inductor has no option for extra compiler
# flags, but it runs the compiler named by the `cpp.cxx` option: a wrapper
# that adds the flag. Its name ends in g++ so inductor still treats it as gcc.
EXTRA_CXX_FLAGS = ("-fno-gnu-unique",)


def _unloadable_compiler(work_dir: Path, march: str | None = None) -> str:
    """A wrapper script that adds EXTRA_CXX_FLAGS (and, given `march`, turns
    Inductor's -march=native into -march=`march`). It lives at a stable per-user
    path when one can be made private (inductor's compile cache is keyed by the
    compiler's path, so a new path per compile would defeat the cache)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or "g++"
    rewrite = ""
    if march is not None:
        rewrite = ('for arg do\n  shift\n  case $arg in -march=native) arg=' + shlex.quote(f"-march={march}")
                   + ' ;; esac\n  set -- "$@" "$arg"\ndone\n')
    script = f'#!/bin/sh\n{rewrite}exec {shlex.quote(compiler)} {" ".join(EXTRA_CXX_FLAGS)} "$@"\n'
    digest = hashlib.sha256(script.encode()).hexdigest()[:16]
    for folder in (_private_cache_dir(digest), work_dir):
        if folder is None:
            continue
        wrapper = folder / "cuda-runner-g++"
        try:
            if not wrapper.exists() or wrapper.read_text() != script:
                temp = folder / f".cuda-runner-g++.{os.getpid()}"
                temp.write_text(script)
                temp.chmod(0o700)
                os.replace(temp, wrapper)
            return str(wrapper)
        except OSError:
            continue
    raise CompileError("cannot write the compiler wrapper")


def _private_cache_dir(digest: str) -> Path | None:
    """~/.cache/cuda-runner/cxx/<digest>, made 0700 and owned by us, or None."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cuda-runner" / "cxx" / digest
    try:
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = base.stat()
    except OSError:
        return None
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None  # someone else could swap the script: use the private temp folder
    return base


# The CUDA errors that leave a context unusable (cudaErrorIllegalAddress, MisalignedAddress,
# IllegalInstruction, LaunchFailure, Assert, HardwareStackError, InvalidPc, ECCUncorrectable...).
_STICKY_FAULT = re.compile(
    r"(CUDA error|Triton Error \[CUDA\]): (misaligned address|an illegal memory access|illegal memory access|"
    r"an illegal instruction|illegal instruction|unspecified launch failure|device-side assert|hardware stack error|"
    r"invalid program counter|uncorrectable ECC error|operation not supported on global/shared address space)")


def gpu_unusable_after(error: BaseException) -> bool:
    """Whether `error`, or one it was raised from, is a CUDA fault (an illegal or misaligned
    address, say): CUDA reports those as sticky, and every later call in the process fails."""
    seen: BaseException | None = error
    for _ in range(16):  # a cause chain is short; never loop on a cyclic one
        if seen is None:
            return False
        # InductorError carries the fault as text only ("AcceleratorError: CUDA error: misaligned address"),
        # as Triton's launcher does ("Triton Error [CUDA]: misaligned address"); an error the process
        # recovers from (out of memory, an invalid argument) is no fault.
        if _STICKY_FAULT.search(str(seen)):
            return True
        seen = seen.__cause__ if seen.__cause__ is not None else None if seen.__suppress_context__ else seen.__context__
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


# What a compiler or linker says first about why it failed, in the log Inductor puts in its error.
_CAUSE = re.compile(r"error[:\s]|multiple definition|undefined reference|undefined symbol", re.IGNORECASE)


def compile_failure(error: BaseException) -> str:
    """The error's first line and, where that only says a C++ compile failed,
    the first line of the compiler's output that says why (a duplicate symbol,
    an undefined reference): what a note of one line can carry."""
    first = _first_line(error)
    if "compile error" not in first.lower():
        return first
    for line in str(error).strip().splitlines()[1:]:
        if _CAUSE.search(line):
            return f"{first}: {line.strip()[:300]}"
    return first


def _with_kernel_options(options: Mapping[str, Any], in_use: Sequence[str]) -> dict[str, Any]:
    """The compile's options, with what cuda-runner's kernels in the graph need.
    The matrix-vector kernel is one Triton function called with many sets of
    compile-time constants. Inductor names each set apart but, unless told to
    make the names unique, compiles every one under the function's own name,
    so two of its names can share one binary file in Triton's cache, and
    AOTInductor embeds binaries by file and name. The 16-layer decoder's decode
    method failed to build with the fused kernel on the H200 (a C++ compile
    error, its cause not recorded), where one and two layers of the same width
    built; unique names give every set a file of its own. That this was the
    cause is not yet seen on the GPU. Combo kernels where OwnKernels took them
    (with the fused decode attention, the user not having set them)."""
    chosen = dict(options)
    if "matvec" in in_use:
        chosen["triton.unique_user_kernel_names"] = True
    if "combo" in in_use:
        # A decode step's small pointwise kernels (RoPE on the query and the key,
        # the cache writes) depend on one product, not on each other: Inductor's
        # combo kernels launch them as one, which the step's time is mostly made of.
        chosen["combo_kernels"] = True
    if "pdl" in in_use:
        chosen[inductor_pdl.OPTION] = True
    return chosen


def _sidecar_metadata(library_path: Path) -> dict[str, str]:
    sidecar = library_path.with_name(library_path.name[: -len(".so")] + "_metadata.json")
    try:
        return json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return {}


def _device_spec(torch: Any, device: str, metadata: Mapping[str, str], cpu_build: _CpuBuild | None = None) -> DeviceSpec:
    if device == "cpu":
        assert cpu_build is not None
        return DeviceSpec(type="cpu", cpu_isa=metadata.get("AOTI_CPU_ISA") or cpu_build.isa, cpu_flags=cpu_build.required)
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return DeviceSpec(type="cuda", compute_capability=f"{major}.{minor}")
