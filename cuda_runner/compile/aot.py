"""The ahead-of-time side: ExportedProgram -> self-contained model library + weights blob.

The options follow docs/aoti-abi.md, "Building a library": the library does not link
libtorch (its aoti_torch_* symbols are bound at load time, which is what lets
it run where torch's own loaders crash), the weights go to a separate binary
blob, and CUDA kernels are embedded in the library.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CompileError, InputError
from ..format.manifest import DeviceSpec
from ..runtime.devices import cpu_isa_flags

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

# What the runtime relies on: a user option may not change these.
_PROTECTED_OPTIONS = frozenset(SELF_CONTAINED_OPTIONS) | {"aot_inductor.output_path", "cpp.cxx", "aot_inductor.check_lowerbound"}

Progress = Callable[[str], None]


def check_options(torch: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """Inductor config values given by the user: known keys, values of the default's type."""
    known = torch._inductor.config.get_config_copy()
    checked = {}
    for key, value in options.items():
        if key in _PROTECTED_OPTIONS:
            raise InputError(f"option {key!r} is set by cuda-runner (the bundle depends on it) and cannot be changed", subject="option")
        if key not in known:
            raise InputError(f"{key!r} is not an Inductor option (see torch._inductor.config)", subject="option")
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


def import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise CompileError("compiling needs PyTorch 2.10 or newer; install it with: pip install 'cuda-runner[torch]'") from None
    version = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    if version < MIN_TORCH:
        raise CompileError(f"torch {torch.__version__} is too old: AOTInductor weight blobs and link_libtorch=False need torch 2.10 or newer")
    return torch


def check_device(torch: Any, device: str) -> str:
    """Normalise and check the compile device: 'cpu', 'cuda' or 'cuda:N'."""
    if device == "cpu":
        return device
    if not re.fullmatch(r"cuda(:\d{1,4})?", device):
        raise InputError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'", subject="device")
    if not torch.cuda.is_available():
        raise CompileError("--device cuda needs a CUDA GPU visible to PyTorch, and none is; compile with --device cpu, or on a GPU machine")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise CompileError(f"{device} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}"


def compile_program(
    program: Any, example_args: tuple, example_kwargs: Mapping[str, Any], device: str, progress: Progress,
    user_options: Mapping[str, Any] | None = None,
) -> CompiledLibrary:
    """Compile an ExportedProgram that already lives on `device`."""
    torch = import_torch()
    work_dir = Path(tempfile.mkdtemp(prefix="cuda-runner-compile-"))
    options = {**(user_options or {}), **SELF_CONTAINED_OPTIONS, "aot_inductor.output_path": str(work_dir)}
    try:
        options["cpp.cxx"] = (None, _unloadable_compiler(work_dir))
        if hasattr(torch._inductor.config.aot_inductor, "check_lowerbound"):
            # The library's own input checks (run --check-inputs) would refuse
            # sizes 0 and 1 of every dynamic dim, which export assumes >= 2 but
            # the generated code handles; the manifest's bounds are checked anyway.
            options["aot_inductor.check_lowerbound"] = False
        progress("compiling with AOTInductor (this takes tens of seconds)")
        try:
            library_path = Path(torch._inductor.aot_compile(program.module(), example_args, dict(example_kwargs), options=options))
        except Exception as error:  # inductor raises many types; report one line
            raise CompileError(f"AOTInductor compile failed: {type(error).__name__}: {_first_line(error)}") from error
        weights_path = library_path.with_name(library_path.name[: -len(".so")] + "_weights.blob")
        metadata = _sidecar_metadata(library_path)
        recorded = {key: value for key, value in options.items() if key not in ("aot_inductor.output_path", "cpp.cxx")}
        recorded["cxx_flags"] = list(EXTRA_CXX_FLAGS)
        return CompiledLibrary(
            library=library_path.read_bytes(),
            weights=weights_path.read_bytes() if weights_path.exists() else b"",
            device=_device_spec(torch, device, metadata),
            options=recorded,
        )
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


# Without STB_GNU_UNIQUE symbols a library can be unloaded (dlclose) once no
# live thread has called into it. Inductor has no option for extra compiler
# flags, but it runs the compiler named by the `cpp.cxx` option: a wrapper
# that adds the flag. Its name ends in g++ so inductor still treats it as gcc.
EXTRA_CXX_FLAGS = ("-fno-gnu-unique",)


def _unloadable_compiler(work_dir: Path) -> str:
    """A wrapper script that adds EXTRA_CXX_FLAGS. It lives at a stable per-user
    path when one can be made private (inductor's compile cache is keyed by the
    compiler's path, so a new path per compile would defeat the cache)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or "g++"
    script = f'#!/bin/sh\nexec {shlex.quote(compiler)} {" ".join(EXTRA_CXX_FLAGS)} "$@"\n'
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


def _sidecar_metadata(library_path: Path) -> dict[str, str]:
    sidecar = library_path.with_name(library_path.name[: -len(".so")] + "_metadata.json")
    try:
        return json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return {}


def _device_spec(torch: Any, device: str, metadata: Mapping[str, str]) -> DeviceSpec:
    if device == "cpu":
        return DeviceSpec(type="cpu", cpu_isa=metadata.get("AOTI_CPU_ISA") or None, cpu_flags=tuple(sorted(cpu_isa_flags())))
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return DeviceSpec(type="cuda", compute_capability=f"{major}.{minor}")
