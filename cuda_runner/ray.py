"""Ray Data integration: run a bundle over a dataset, one loaded model per actor.

    import ray, cuda_runner.ray
    predictions = cuda_runner.ray.map_bundle(ray.data.read_parquet("s3://..."), "model.bundle", concurrency=4)

or directly:

    dataset.map_batches(cuda_runner.ray.BundlePredictor, fn_constructor_args=("model.bundle",),
                        batch_format="numpy", concurrency=4, num_gpus=1)

Ray schedules the actors (one GPU each for a CUDA bundle); each loads the
bundle once and maps NumPy column batches, keyed by input names, to output
columns named as in the manifest. A batch larger than the method's dynamic
bound is split; a method with static shapes runs row by row. Needs
`pip install 'cuda-runner[ray]'`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .errors import InputError
from .format.manifest import MethodSpec, choose_method


def _batch_dim(spec: MethodSpec) -> tuple[str | None, int | None]:
    """The dynamic dim every input leads with (its name and upper bound), if there is one."""
    leading = {tensor.shape[0] if tensor.shape else None for tensor in spec.inputs}
    if len(leading) != 1:
        return None, None
    name = leading.pop()
    if not isinstance(name, str) or name not in spec.dims:
        return None, None
    return name, spec.dims[name].max


class BundlePredictor:
    """A callable class for `Dataset.map_batches`: loads the bundle once per actor."""

    def __init__(self, bundle: str | os.PathLike[str], method: str | None = None, device: str | None = None,
                 trusted_keys: Iterable[str | os.PathLike[str]] | None = None, lanes: int = 1, outputs: list[str] | None = None,
                 require_signature: bool = False):
        import cuda_runner

        self.model = cuda_runner.load(bundle, device, trusted_keys=trusted_keys, lanes=lanes, require_signature=require_signature)
        self.method = self.model.method(method)
        self.spec = self.method.spec
        self.batch_dim, self.max_rows = _batch_dim(self.spec)
        self.outputs = outputs or self._row_outputs()
        unknown = [name for name in self.outputs if name not in {tensor.name for tensor in self.spec.outputs}]
        if unknown:
            raise InputError(f"{unknown[0]!r} is not an output of method {self.spec.name!r}")

    def _row_outputs(self) -> list[str]:
        """Outputs that have one value per row: all of them for static shapes, else those led by the batch dim."""
        if self.batch_dim is None:
            return [tensor.name for tensor in self.spec.outputs]
        names = [tensor.name for tensor in self.spec.outputs if tensor.shape and tensor.shape[0] == self.batch_dim]
        if not names:
            raise InputError(f"no output of method {self.spec.name!r} has the batch dimension {self.batch_dim!r}, so none can be a column")
        return names

    def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [tensor.name for tensor in self.spec.inputs]
        missing = [name for name in names if name not in batch]
        if missing:
            raise InputError(f"the batch has no column {missing[0]!r}; the method takes {', '.join(names)}")
        columns = {name: np.asarray(batch[name]) for name in names}
        rows = len(next(iter(columns.values()))) if columns else 0
        if self.batch_dim is None:
            # Static shapes: each row is one call, outputs stacked back into columns.
            results = [self.method.run({name: column[row] for name, column in columns.items()}) for row in range(rows)]
        else:
            step = self.max_rows or rows or 1
            results = [self.method.run({name: column[start:start + step] for name, column in columns.items()}) for start in range(0, rows, step)]
        if not results:  # an empty batch: empty columns of the outputs' dtypes
            from .arrays import numpy_dtype

            return {tensor.name: np.empty((0,), numpy_dtype(tensor.dtype)) for tensor in self.spec.outputs if tensor.name in self.outputs}
        return _concatenated(results, stack=self.batch_dim is None, outputs=self.outputs)

    def __del__(self) -> None:
        model = getattr(self, "model", None)
        if model is not None:
            model.close()


def _concatenated(results: list[dict[str, np.ndarray]], *, stack: bool, outputs: list[str]) -> dict[str, np.ndarray]:
    join = np.stack if stack else np.concatenate
    return {name: join([result[name] for result in results]) for name in outputs}


def map_bundle(dataset: Any, bundle: str | os.PathLike[str], *, method: str | None = None, concurrency: int = 1,
               batch_size: int | None = None, trusted_keys: Iterable[str | os.PathLike[str]] | None = None,
               outputs: list[str] | None = None, require_signature: bool = False) -> Any:
    """`dataset.map_batches` with one BundlePredictor actor per slot; CUDA bundles get one GPU per actor.

    The trusted keys are resolved here, on the driver (with CUDA_RUNNER_TRUSTED_KEYS),
    and handed to every actor by path: the key files must exist on every node."""
    from .format.bundle import read_manifest
    from .format.signing import keys_for_loading

    keys = [str(key.path) for key in keys_for_loading(trusted_keys or (), require_signature)]
    manifest = read_manifest(bundle)
    on_gpu = manifest.methods[choose_method(list(manifest.methods), method)].device.type == "cuda"
    return dataset.map_batches(
        BundlePredictor, fn_constructor_args=(str(bundle), method, None, keys, 1, outputs, bool(keys)), batch_format="numpy",
        concurrency=concurrency, num_gpus=1 if on_gpu else 0, batch_size=batch_size,
    )
