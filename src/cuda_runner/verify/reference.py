"""Reference outputs: an .npz keyed by output name, or a directory of <output>.npy files."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..io.npy import load_archive, load_array
from ..io.outputs import output_filenames


def load_reference(path: str | os.PathLike, output_names: Sequence[str]) -> dict[str, np.ndarray]:
    """Reads what `run --out` or `run --out-dir` writes, so a run can be checked against an earlier one."""
    path = Path(path)
    if path.is_dir():
        files = output_filenames(list(output_names))
        found = {name: load_array(path / filename) for name, filename in files.items() if (path / filename).is_file()}
        if not found:
            raise InputError(f"{path} holds no reference file for any output (expected names like {next(iter(files.values()), '')})")
        return found
    if path.suffix != ".npz":
        raise InputError(f"--expected {path}: give an .npz archive or a directory of .npy files")
    return load_archive(path)


def bundle_samples(reader, method) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The sample inputs and eager reference outputs stored in a bundle (compile --sample-inputs)."""
    from ..errors import BundleError
    from ..io.npy import archive_from_bytes

    if not method.has_samples:
        raise InputError(f"method {method.name!r} has no stored samples; compile with --sample-inputs to add them")
    try:
        inputs = archive_from_bytes(reader.segment(method.sample_inputs_segment))
        outputs = archive_from_bytes(reader.segment(method.sample_outputs_segment))
    except (ValueError, OSError, EOFError) as error:  # digests matched, yet not an archive: a writer bug
        raise BundleError(f"method {method.name!r}: stored samples are not readable archives: {error}") from None
    return inputs, outputs
