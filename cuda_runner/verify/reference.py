"""Reference outputs: an .npz keyed by output name, or a directory of <output>.npy files."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import BundleError, InputError
from ..io.npy import NpzArchive, load_archive, load_array
from ..io.outputs import output_filenames


def load_reference(path: str | os.PathLike[str], output_names: Sequence[str]) -> dict[str, np.ndarray]:
    """Reads what `run --out` or `run --out-dir` writes, so a run can be checked against an earlier one."""
    path = Path(path)
    if path.is_dir():
        files = output_filenames(list(output_names))
        found = {name: load_array(path / filename) for name, filename in files.items() if (path / filename).is_file()}
        if not found:
            raise InputError(f"{path} holds no reference file for any output (expected names like {next(iter(files.values()), '')})")
        return found
    if path.suffix != ".npz":
        raise InputError(f"{path}: a reference is an .npz archive or a directory of .npy files")
    return load_archive(path)


def stored_sample_outputs(archive: NpzArchive, method: str) -> dict[str, np.ndarray]:
    """The eager outputs stored beside a method's samples; damage there is a bad bundle."""
    try:
        return archive.load_all()
    except InputError as error:
        raise BundleError(f"method {method!r}: stored sample outputs are damaged: {error}") from None
