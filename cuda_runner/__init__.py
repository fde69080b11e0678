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

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .errors import (
    BundleError,
    ClosedError,
    CompileError,
    CudaRunnerError,
    DeviceError,
    ExitCode,
    IncompatibleBundleError,
    InputError,
    ModelRuntimeError,
    WriteError,
)
from .format import open_bundle, read_manifest

if TYPE_CHECKING:
    from .runtime.model import Model, ModelPool


def load(
    path: str | os.PathLike[str],
    device: str | None = None,
    *,
    verify_weights: bool = True,
    methods: Iterable[str] | None = None,
    cuda_graph: bool = False,
    lanes: int = 1,
    check_inputs: bool = False,
    trusted_keys: Iterable[str | os.PathLike[str]] | None = None,
    require_signature: bool = False,
    data: str | os.PathLike[str] | None = None,
    warm_up: bool = True,
    call_helper: bool = True,
    provider: str | None = None,
) -> Model:
    """Load a bundle's methods onto a device ("cpu", "cuda", "cuda:1"; None picks the bundle's).

    `path` may also be an ExecuTorch CUDA program (`.pte`); `data` is its data
    file (`.ptd`), by default the `aoti_cuda_blob.ptd` next to it.

    On CUDA each method runs once on zeros while it loads (`warm_up`), so the
    first real call does not pay for the library's lazy set-up.

    A bundle compiled with its call helper makes each call one foreign call
    (`call_helper=False` goes through ctypes alone, as bundles without one do).

    `provider` picks whose shim functions each model library runs on: "auto"
    (the default, or CUDA_RUNNER_PROVIDER), "shim" (cuda-runner's own, with no
    libtorch in the process) or "libtorch" (README, "Running without torch").

    The model is safe to call from any number of threads; `lanes` is how many
    calls of one method run at once (each lane has its own CUDA stream and
    staging buffers). `check_inputs` turns on the library's own input checks;
    `cuda_graph` captures each (static-shape) method into a CUDA graph.

    `trusted_keys` (public key files; CUDA_RUNNER_TRUSTED_KEYS adds more): the
    bundle must be signed by one of them (`<bundle>.sig`), checked before any
    of its code loads. `require_signature` makes having no trusted key an error."""
    from .runtime.model import load_model
    from .signing import keys_for_loading

    keys = keys_for_loading(trusted_keys or (), require_signature)
    return load_model(path, device, verify_weights=verify_weights, methods=methods, cuda_graph=cuda_graph, lanes=lanes,
                      check_inputs=check_inputs, trusted_keys=keys, data=data, warm_up=warm_up,
                      call_helper=call_helper, provider=provider)


def load_pool(path: str | os.PathLike[str], devices: str | Iterable[int | str] = "all", **options: Any) -> ModelPool:
    """Load a bundle on several GPUs ("all", "0,1", or [0, 1]); `run` and `map`
    spread calls over them, to the device with the fewest calls in flight.
    Takes load()'s options."""
    from .runtime.model import load_pool as _load_pool
    from .signing import keys_for_loading

    keys = keys_for_loading(options.pop("trusted_keys", None) or (), options.pop("require_signature", False))
    return _load_pool(path, devices if isinstance(devices, str) else list(devices), trusted_keys=keys, **options)


def compile_module(*args: Any, **kwargs: Any) -> Any:
    """Export and AOT-compile an nn.Module into a bundle; see cuda_runner.compile.compile_module."""
    from .compile import compile_module as _compile_module

    return _compile_module(*args, **kwargs)


def compile_programs(*args: Any, **kwargs: Any) -> Any:
    """AOT-compile saved ExportedPrograms (.pt2) into one bundle; see cuda_runner.compile."""
    from .compile import compile_programs as _compile_programs

    return _compile_programs(*args, **kwargs)


def compile_methods(*args: Any, **kwargs: Any) -> Any:
    """AOT-compile several methods of one nn.Module into a bundle, shared weights stored once; see cuda_runner.compile.compile_methods."""
    from .compile import compile_methods as _compile_methods

    return _compile_methods(*args, **kwargs)


__all__ = [
    "BundleError",
    "ClosedError",
    "CompileError",
    "CudaRunnerError",
    "DeviceError",
    "ExitCode",
    "IncompatibleBundleError",
    "InputError",
    "ModelRuntimeError",
    "WriteError",
    "__version__",
    "compile_methods",
    "compile_module",
    "compile_programs",
    "load",
    "load_pool",
    "open_bundle",
    "read_manifest",
]
