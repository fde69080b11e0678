"""Inductor's own kernels as programmatic dependents, in standalone CUDA builds
for Hopper and later GPUs (docs/standalone.md, "Inductor's kernels as
programmatic dependents").

cuda-runner's shim launches a kernel as a programmatic dependent when its
name holds PROGRAMMATIC_MARK: its programs may then start while the launch
before it drains, so each must wait (griddepcontrol.wait) before it reads or
writes any memory. cuda-runner's own kernels do (compile/matvec_kernel.py);
Inductor's kernels in a decode step (RoPE, the cache writes) did not, so each
one cost the step a whole drain and fill, and held back the launch after it.

Inductor can emit those waits itself (`triton.enable_pdl`), but it leaves one
out where the kernel reads nothing the kernel scheduled just before it wrote,
and a kernel that waits for nothing may finish before the one before it, so
the launch after it could overtake that one. Here every load and store waits:
the scheduler's record of the node before is hidden while the build
generates code, which is how Inductor treats a kernel after one that is not
its own. A kernel is then named for the shim only where its source shows a
wait before every line that touches a pointer (each sub-kernel of a combo
kernel apart); any other is launched plainly, where its waits do nothing.
GEMM templates get no waits from Inductor, so they keep their names.

All of it is Inductor's private code: where this torch lacks any part, the
build goes on without (available() says so). A build takes it only where
asked (OWN_OPTION=true).
"""

from __future__ import annotations

import contextlib
import inspect
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# What the shim looks for in a kernel's name (native/aoti_shim.cpp, crLaunchKernel).
PROGRAMMATIC_MARK = "cudarunner_pdl_"
# cuda-runner's option that asks for it (off by default: its gain on the 1B decoder is not yet
# established, docs/benchmarks.md), and Inductor's, which cuda-runner then sets.
OWN_OPTION = "cuda_runner.programmatic_inductor_kernels"
OPTION = "triton.enable_pdl"

_WAIT = "gdc_wait()"
# Inductor's kernels take their tensors as in_ptrN, out_ptrN, in_out_ptrN, ws_ptr and sem_ptr (a
# workspace and its semaphores) and seedN, and make block_ptrN and tma_descriptorN from them.
_POINTER_USE = re.compile(r"\b(?:in_out_ptr|in_ptr|out_ptr|ws_ptr|sem_ptr|seed|block_ptr|tma_descriptor)\d*\b")
# A string literal on one line: what it holds is no code (a # in it starts no comment).
_STRING = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")
# Where a function's source ends and the next top-level thing (a benchmark harness) begins.
_TOP_LEVEL = ("def ", "@", "class ", "if __name__")
# The scheduler's record of the node it generated code for last (hidden while a build generates code).
_NODE_BEFORE = "previous_node"
# What Inductor's code generator for Triton names a kernel's fused part with.
_FUSED_NAME = "get_fused_kernel_name"
_DEFINE = "define_kernel"
# One build at a time in a process patches Inductor (each patch saves and puts back what it found).
_PATCHING = threading.RLock()


def waits_before_every_access(source: str) -> bool:
    """Whether a generated kernel's source waits (griddepcontrol.wait) before
    every line of its body that uses a pointer, on every path: a wait counts
    for the lines after it in its own block and the blocks inside that, not
    after the block ends (a combo kernel's next branch on the program id, an
    else, the code after a loop whose body waited)."""
    lines = source.splitlines()
    start = next((index for index, line in enumerate(lines) if line.lstrip().startswith("def ")), None)
    if start is None:
        return False
    indent = _indent(lines[start])
    # The signature may run over several lines: the body starts after the line ending it.
    while start < len(lines) and not _code(lines[start]).rstrip().endswith(":"):
        start += 1
    waits: list[int] = []  # the indentation of each wait still in scope
    touched = False
    for line in lines[start + 1:]:
        code = _code(line)
        if not code.strip():
            continue
        depth = _indent(code)
        if depth <= indent and code.lstrip().startswith(_TOP_LEVEL):
            break  # the kernel's function has ended (a benchmark harness may follow it)
        waits = [wait for wait in waits if wait <= depth]
        if _WAIT in code:
            waits.append(depth)
        elif _POINTER_USE.search(code):
            if not waits:
                return False
            touched = True
    return touched


def _code(line: str) -> str:
    """A line without its comment or what its string literals hold."""
    return _STRING.sub("''", line).split("#", 1)[0]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


@dataclass
class ProgrammaticNames:
    """The kernels of one build named for programmatic launches, and those that were not."""

    named: int = 0
    plain: int = 0

    def name(self, fused_name: str, source: str) -> str:
        # A fused name that starts with the mark by itself (a custom op so named) is put off it.
        plain = f"x{fused_name}" if fused_name.startswith(PROGRAMMATIC_MARK) else fused_name
        if _WAIT not in source:
            return plain  # a template, or PDL code generation off for this kernel
        if waits_before_every_access(source):
            self.named += 1
            return f"{PROGRAMMATIC_MARK}{fused_name}"
        self.plain += 1
        return plain


def available(torch: Any) -> bool:
    """Whether this torch's Inductor has every part used here: the option, a
    kernel-naming step that reads get_fused_kernel_name, and a PDL code
    generator that waits where the scheduler records no node before."""
    try:
        from torch._inductor.codegen import triton as triton_codegen
        from torch._inductor.scheduler import Scheduler  # noqa: F401
    except ImportError:
        return False
    handler = getattr(triton_codegen.TritonKernel, "_handle_pdl_before_access", None)
    define = getattr(getattr(triton_codegen, "TritonScheduling", None), _DEFINE, None)
    if handler is None or define is None or not hasattr(triton_codegen, _FUSED_NAME):
        return False
    if not hasattr(torch._inductor.config.triton, "enable_pdl"):
        return False
    try:
        return _NODE_BEFORE in inspect.getsource(handler) and _FUSED_NAME in inspect.getsource(define)
    except (OSError, TypeError):  # no source to read: the behaviour relied on is not known
        return False


class _NoNodeBefore:
    """Scheduler.previous_node, always None while installed: Inductor's PDL code
    then has every load and store of a kernel wait, as after a kernel not its own."""

    def __get__(self, instance: Any, owner: Any = None) -> None:
        return None

    def __set__(self, instance: Any, value: Any) -> None:
        # Kept where the class would keep it: a scheduler made meanwhile has it once the class is put back.
        instance.__dict__[_NODE_BEFORE] = value


@contextlib.contextmanager
def programmatic_kernels(torch: Any) -> Iterator[ProgrammaticNames]:
    """While a build generates code: every Inductor kernel waits before each
    memory access, and kernels whose source shows it are named for the shim.
    Yields the count of each; takes effect where the build's options set OPTION.
    Inductor's classes are patched for the process: one such build runs at a
    time, and a build on another thread meanwhile is named as usual (it still
    sees no node before, which only adds waits where its options ask for them).

    The name is given where Inductor names a kernel (TritonScheduling.define_kernel,
    from get_fused_kernel_name's part of it), as torch 2.11 and 2.13 both do; the
    kernel-name hook of newer ones (InductorChoices.customize_fused_kernel_name)
    is not in 2.11."""
    from torch._inductor.codegen import triton as triton_codegen
    from torch._inductor.scheduler import Scheduler

    names = ProgrammaticNames()
    defining: list[str] = []  # the source of the kernel being named, while it is
    building = threading.get_ident()

    with _PATCHING:
        fused_name = getattr(triton_codegen, _FUSED_NAME)
        define_kernel = triton_codegen.TritonScheduling.define_kernel

        def named(node_schedule: Any, descriptive_names: Any) -> str:
            name = fused_name(node_schedule, descriptive_names)
            return names.name(name, defining[-1]) if defining and threading.get_ident() == building else name

        def defined(self: Any, src_code: str, node_schedule: Any, kernel: Any) -> Any:
            if threading.get_ident() != building:
                return define_kernel(self, src_code, node_schedule, kernel)
            defining.append(src_code)
            try:
                return define_kernel(self, src_code, node_schedule, kernel)
            finally:
                defining.pop()

        with _patched(Scheduler, triton_codegen, named, defined):
            yield names


@contextlib.contextmanager
def _patched(scheduler: Any, triton_codegen: Any, named: Any, defined: Any) -> Iterator[None]:
    """Inductor with no node before seen by `scheduler` (the Scheduler class), and
    kernels named by `named` as `defined` defines them; put back after."""
    fused_name = getattr(triton_codegen, _FUSED_NAME)
    define_kernel = triton_codegen.TritonScheduling.define_kernel
    had_own = _NODE_BEFORE in scheduler.__dict__
    saved = scheduler.__dict__.get(_NODE_BEFORE)
    setattr(scheduler, _NODE_BEFORE, _NoNodeBefore())
    setattr(triton_codegen, _FUSED_NAME, named)
    setattr(triton_codegen.TritonScheduling, _DEFINE, defined)
    try:
        yield
    finally:
        setattr(triton_codegen.TritonScheduling, _DEFINE, define_kernel)
        setattr(triton_codegen, _FUSED_NAME, fused_name)
        if had_own:
            setattr(scheduler, _NODE_BEFORE, saved)
        else:
            delattr(scheduler, _NODE_BEFORE)
