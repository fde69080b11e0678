"""The ahead-of-time side: ExportedProgram -> self-contained model library + weights blob.

The options follow shared/docs/aoti-abi.md §1: the library does not link
libtorch (its aoti_torch_* symbols are bound at load time, which is what lets
it run where torch's own loaders crash), the weights go to a separate binary
blob, and CUDA kernels are embedded in the library.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CompileError
from ..format.manifest import DeviceSpec
from ..runtime.devices import cpu_isa_flags

MIN_TORCH = (2, 10)

SELF_CONTAINED_OPTIONS: dict[str, Any] = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "binary_blob",
    "aot_inductor.embed_kernel_binary": True,
    "aot_inductor.link_libtorch": False,
}

Progress = Callable[[str], None]


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
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise CompileError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise CompileError("--device cuda needs a CUDA GPU visible to PyTorch, and none is; compile with --device cpu, or on a GPU machine")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise CompileError(f"{device} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}"


def compile_program(program: Any, example_args: tuple, example_kwargs: Mapping[str, Any], device: str, progress: Progress) -> CompiledLibrary:
    """Compile an ExportedProgram that already lives on `device`."""
    torch = import_torch()
    work_dir = Path(tempfile.mkdtemp(prefix="cuda-runner-compile-"))
    options = dict(SELF_CONTAINED_OPTIONS, **{"aot_inductor.output_path": str(work_dir)})
    try:
        progress("compiling with AOTInductor (this takes tens of seconds)")
        try:
            library_path = Path(torch._inductor.aot_compile(program.module(), example_args, dict(example_kwargs), options=options))
        except Exception as error:  # inductor raises many types; report one line
            raise CompileError(f"AOTInductor compile failed: {type(error).__name__}: {_first_line(error)}") from error
        weights_path = library_path.with_name(library_path.name[: -len(".so")] + "_weights.blob")
        metadata = _sidecar_metadata(library_path)
        recorded = {key: value for key, value in options.items() if key != "aot_inductor.output_path"}
        return CompiledLibrary(
            library=library_path.read_bytes(),
            weights=weights_path.read_bytes() if weights_path.exists() else b"",
            device=_device_spec(torch, device, metadata),
            options=recorded,
        )
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


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
