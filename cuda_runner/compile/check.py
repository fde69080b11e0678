"""A compiled method run once on its example inputs and compared with eager PyTorch.

The single-row rule (compile/aot.py, SINGLE_ROW_OPTIONS) turns coordinate-descent
tuning on for a CUDA method by itself. On the H200 machine, Whisper-base's
decoder step compiled standalone with it disagreed with eager by 3% of the
logits' scale, where the libtorch-bound library with it and the standalone
one without it agreed within 1e-4 (docs/benchmarks.md, "Whisper-base").
So a method that got the rule, or the fused decode attention
(compile/attention.py), is checked here before it is bundled, and compiled
again without them, one at a time, where it disagrees
(compile/__init__.py, _checked_against_eager).

The library is checked as the runtime will run it: written to a temporary
one-method bundle and loaded through cuda_runner's own load path. Eager runs
the exported program on the same inputs, with the buffers a run writes put
back afterwards, so that both start from the state the bundle stores.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CudaRunnerError
from ..format import Manifest, MethodSpec, write_bundle
from .samples import to_numpy

# How far an output may be from eager, as a fraction of the eager output's
# largest magnitude: several times what reordered sums give in each dtype.
RELATIVE_TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}


class NotChecked(Exception):
    """The library could not be run here (no CuPy, say): the caller says so and keeps it."""


def disagreement(torch: Any, program: Any, spec: MethodSpec, segments: Mapping[str, Any], args: tuple, kwargs: Mapping[str, Any],
                 device: str, written_buffers: Sequence[str] | None) -> str | None:
    """How the method's library differs from eager on these inputs, or None where it agrees."""
    import torch.utils._pytree as pytree

    flat, _ = pytree.tree_flatten((args, dict(kwargs)))
    if len(flat) != len(spec.inputs) or not all(isinstance(leaf, torch.Tensor) for leaf in flat):
        raise NotChecked("its example inputs are not one tensor per input")
    inputs = {tensor.name: to_numpy(torch, leaf) for tensor, leaf in zip(spec.inputs, flat)}
    _check_room(torch, spec, segments, device)
    expected = [to_numpy(torch, value) for value in _eager(torch, program, args, kwargs, written_buffers)]
    got = _library(spec, segments, inputs, device)
    if isinstance(got, str):
        return got
    overall = max((_largest(reference) for reference in expected), default=0.0)
    for output, reference in zip(spec.outputs, expected):
        problem = _difference(output.name, got[output.name], reference, overall)
        if problem:
            return problem
    return None


def _check_room(torch: Any, spec: MethodSpec, segments: Mapping[str, Any], device: str) -> None:
    """The library's weights go to the GPU beside the eager program's: refuse where they would not fit."""
    if not device.startswith("cuda") or spec.weights_segment is None:
        return
    needed = memoryview(segments[spec.weights_segment]).nbytes
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    if needed * 1.1 > free:
        raise NotChecked(f"a second copy of its weights ({needed / 1e9:.1f} GB) would not fit in the GPU's {free / 1e9:.1f} GB free")


def _eager(torch: Any, program: Any, args: tuple, kwargs: Mapping[str, Any], written_buffers: Sequence[str] | None) -> list[Any]:
    import torch.utils._pytree as pytree

    module = program.module()
    # On copies of the inputs too: a program may write into an input, and these are the caller's example inputs.
    args, kwargs = pytree.tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, (args, dict(kwargs)))
    with torch.no_grad(), _state_put_back(module, written_buffers):
        return [leaf.detach().clone() for leaf in pytree.tree_leaves(module(*args, **kwargs))]


@contextlib.contextmanager
def _state_put_back(module: Any, names: Sequence[str] | None) -> Iterator[None]:
    """The module's buffers (those named, or all) as they were before, once the run is done: the
    program's own tensors, which the compile goes on using."""
    buffers = dict(module.named_buffers())
    kept = {name: buffers[name].clone() for name in (names if names is not None else buffers) if name in buffers}
    try:
        yield
    finally:
        for name, value in kept.items():
            buffers[name].copy_(value)


def _library(spec: MethodSpec, segments: Mapping[str, Any], inputs: dict[str, np.ndarray], device: str) -> dict[str, np.ndarray] | str:
    """The library's outputs on the inputs, or how it failed on them; NotChecked where it cannot be run here."""
    from ..runtime.model import load_model
    from ..runtime.options import LoadOptions

    own = {name: segments[name] for name in (spec.library_segment, spec.weights_segment) if name is not None}
    try:
        with tempfile.TemporaryDirectory(prefix="cuda-runner-check-") as folder:
            path = Path(folder) / "method.bundle"
            write_bundle(path, Manifest(methods={spec.name: spec}), own)
            try:
                model = load_model(path, device, LoadOptions(warm_up=False, verify_weights=False))
            except CudaRunnerError as error:  # no CuPy, no room: this machine, not the library
                raise NotChecked(str(error)) from error
            with model:
                try:
                    return model.run(inputs, spec.name)
                except Exception as error:  # the library failed on inputs eager took: as wrong as a wrong result
                    return f"the library failed on them ({type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''})"
    except (OSError, CudaRunnerError) as error:  # the temporary bundle could not be written (a full /tmp)
        raise NotChecked(f"no room for a temporary bundle: {error}") from error


def _largest(values: np.ndarray) -> float:
    """The largest finite magnitude of a float array (0 for others)."""
    if values.dtype.kind != "f" and values.dtype.name != "bfloat16":
        return 0.0
    finite = values.astype(np.float64)
    return float(np.abs(finite[np.isfinite(finite)]).max(initial=0.0))


def _difference(name: str, got: np.ndarray, expected: np.ndarray, overall: float) -> str | None:
    """How far `got` is from eager's `expected`, where that is more than the dtype's share of
    the output's largest value (at least a thousandth of the method's largest output, and
    the dtype's epsilon: an output of zeros is not held to a tolerance of zero)."""
    if got.shape != expected.shape:
        return f"output {name!r} has shape {list(got.shape)} where eager's has {list(expected.shape)}"
    tolerance = RELATIVE_TOLERANCE.get(expected.dtype.name)
    if tolerance is None:  # integers and bools: exactly
        return None if np.array_equal(got, expected) else f"output {name!r} differs from eager's"
    reference, value = expected.astype(np.float64), got.astype(np.float64)
    alike = (value == reference) | (np.isnan(value) & np.isnan(reference))  # infinities and NaNs where eager has them
    with np.errstate(invalid="ignore"):  # inf - inf where they are alike: masked out
        error = float(np.where(alike, 0.0, np.abs(value - reference)).max(initial=0.0))
    scale = max(_largest(expected), 1e-3 * overall, float(_EPSILON.get(expected.dtype.name, 0.0)))
    if not np.isfinite(error) or error > tolerance * scale:
        return f"output {name!r} is {error:.3g} from eager's (largest value {_largest(expected):.3g})"
    return None


_EPSILON = {"float64": 2.2e-16, "float32": 1.2e-7, "float16": 9.8e-4, "bfloat16": 7.8e-3}
