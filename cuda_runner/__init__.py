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
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

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
from .runtime.options import LoadOptions
from .version import __version__

if TYPE_CHECKING:
    from .compile import compile_methods, compile_module, compile_programs
    from .runtime.model import Model, ModelPool


def load(
    path: str | os.PathLike[str],
    device: str | None = None,
    *,
    options: LoadOptions | None = None,
    methods: Iterable[str] | None = None,
    data: str | os.PathLike[str] | None = None,
    trusted_keys: Iterable[str | os.PathLike[str]] | None = None,
    require_signature: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    **option_fields: Any,
) -> Model:
    """Load a bundle's methods onto a device ("cpu", "cuda", "cuda:1"; None picks the bundle's).

    `path` may also be an ExecuTorch CUDA program (`.pte`); `data` is its data
    file (`.ptd`), by default the `aoti_cuda_blob.ptd` next to it. `methods`
    loads only those (all by default).

    How it loads is a `LoadOptions` (`options`), or its fields given as
    keywords (`lanes=2`, `cuda_graph=True`, `provider="shim"`, ...), which
    change `options`; LoadOptions' docstring says what each does. The model is
    safe to call from any number of threads; `lanes` is how many calls of one
    method run at once.

    `trusted_keys` (public key files; CUDA_RUNNER_TRUSTED_KEYS adds more): the
    bundle must be signed by one of them (`<bundle>.sig`), checked before any
    of its code loads. `require_signature` makes having no trusted key an error.

    `progress(method, done, total)` is called, on the loading thread, as each
    method's weights go up (bytes), for a progress bar of a large model."""
    from .runtime.model import load_model

    return load_model(path, device, _options(options, trusted_keys, require_signature, option_fields), methods=methods, data=data,
                      progress=progress)


def load_pool(
    path: str | os.PathLike[str],
    devices: str | Iterable[int | str] = "all",
    *,
    options: LoadOptions | None = None,
    methods: Iterable[str] | None = None,
    data: str | os.PathLike[str] | None = None,
    trusted_keys: Iterable[str | os.PathLike[str]] | None = None,
    require_signature: bool = False,
    **option_fields: Any,
) -> ModelPool:
    """Load a bundle on several GPUs ("all", "0,1", or [0, 1]); `run` and `map`
    spread calls over them, to the device with the fewest calls in flight.
    Takes load()'s options."""
    from .runtime.model import load_pool as _load_pool

    chosen = _options(options, trusted_keys, require_signature, option_fields)
    return _load_pool(path, devices if isinstance(devices, str) else list(devices), chosen, methods=methods, data=data)


def _options(options: LoadOptions | None, trusted_keys: Iterable[str | os.PathLike[str]] | None, require_signature: bool,
             fields: dict[str, Any]) -> LoadOptions:
    from .format.signing import keys_for_loading

    if options is not None and not isinstance(options, LoadOptions):
        raise InputError(f"options must be a cuda_runner.LoadOptions, not {type(options).__name__}; or give its fields as keywords")
    chosen = (options or LoadOptions()).with_fields(**fields)
    keys = keys_for_loading(trusted_keys or (), require_signature and not chosen.trusted_keys)
    return chosen.with_fields(trusted_keys=(*chosen.trusted_keys, *keys)) if keys else chosen


def __getattr__(name: str) -> Any:
    """compile_module, compile_programs and compile_methods, imported when first used (their
    module is light, but compiling is the only thing that needs it)."""
    if name in ("compile_module", "compile_programs", "compile_methods"):
        from . import compile as compiling

        return getattr(compiling, name)
    raise AttributeError(f"module 'cuda_runner' has no attribute {name!r}")


__all__ = [
    "BundleError",
    "ClosedError",
    "CompileError",
    "CudaRunnerError",
    "DeviceError",
    "ExitCode",
    "IncompatibleBundleError",
    "InputError",
    "LoadOptions",
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
