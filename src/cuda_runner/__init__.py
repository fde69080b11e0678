"""cuda-runner: run AOTInductor-compiled PyTorch models from bundles.

The public API is small on purpose:

    import cuda_runner
    model = cuda_runner.load("model.bundle")          # device picked from the bundle
    outputs = model.run({"x": x})                      # NumPy in, NumPy out
    cuda_runner.compile_module(module, (x,), "model.bundle", device="cuda")

Nothing heavy is imported here: torch and CuPy load only when a function
that needs them is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .errors import (
    BundleError,
    CompileError,
    CudaRunnerError,
    DeviceError,
    ExitCode,
    IncompatibleBundleError,
    InputError,
    ModelRuntimeError,
)
from .format import open_bundle, read_manifest

if TYPE_CHECKING:
    from .runtime.model import Model


def load(path: Any, device: str | None = None, *, verify_weights: bool = True, methods: Any = None, cuda_graph: bool = False) -> Model:
    """Load a bundle's methods onto a device ("cpu", "cuda", "cuda:1"; None picks the bundle's).

    cuda_graph=True captures each (static-shape) method into a CUDA graph and replays it."""
    from .runtime.model import load_model

    return load_model(path, device=device, verify_weights=verify_weights, methods=methods, cuda_graph=cuda_graph)


def compile_module(*args: Any, **kwargs: Any) -> Any:
    """Export and AOT-compile an nn.Module into a bundle; see cuda_runner.compile.compile_module."""
    from .compile import compile_module as _compile_module

    return _compile_module(*args, **kwargs)


def compile_programs(*args: Any, **kwargs: Any) -> Any:
    """AOT-compile saved ExportedPrograms (.pt2) into one bundle; see cuda_runner.compile."""
    from .compile import compile_programs as _compile_programs

    return _compile_programs(*args, **kwargs)


__all__ = [
    "BundleError",
    "CompileError",
    "CudaRunnerError",
    "DeviceError",
    "ExitCode",
    "IncompatibleBundleError",
    "InputError",
    "ModelRuntimeError",
    "__version__",
    "compile_module",
    "compile_programs",
    "load",
    "open_bundle",
    "read_manifest",
]
