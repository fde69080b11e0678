"""Sample inputs stored in a bundle with the eager outputs for them, for `run --self-test`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from ..format.manifest import MethodSpec
from ..io.inputs import check_arrays
from ..io.npy import archive_bytes


def _to_torch(torch: Any, array: np.ndarray, device: str) -> Any:
    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":  # ml_dtypes: torch.from_numpy cannot take it
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(array).to(device)


def to_numpy(torch: Any, tensor: Any) -> np.ndarray:
    import ml_dtypes

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def sample_segments(torch: Any, program: Any, spec: MethodSpec, samples: Mapping[str, np.ndarray], device: str) -> tuple[MethodSpec, dict[str, bytes]]:
    """Validate the samples against the signature, run eager PyTorch on them, and pack both."""
    import torch.utils._pytree as pytree

    inputs = check_arrays(spec, dict(samples), []).arrays
    flat = [_to_torch(torch, inputs[input_spec.name], device) for input_spec in spec.inputs]
    args, kwargs = pytree.tree_unflatten(flat, program.call_spec.in_spec)
    with torch.no_grad():
        result = program.module()(*args, **kwargs)
    outputs = {output_spec.name: to_numpy(torch, value) for output_spec, value in zip(spec.outputs, pytree.tree_leaves(result))}
    names = (f"{spec.name}_sample_inputs", f"{spec.name}_sample_outputs")
    spec = replace(spec, sample_inputs_segment=names[0], sample_outputs_segment=names[1])
    return spec, {names[0]: archive_bytes(inputs), names[1]: archive_bytes(outputs)}
