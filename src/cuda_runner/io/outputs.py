"""Writing outputs: one .npy per output or one .npz, all or nothing, with safe names."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..names import safe_filename
from .npy import atomic_write_many, save_archive, write_npy


def output_filenames(names: list[str]) -> dict[str, str]:
    """Sanitised, distinct file names: 'aux.loss' -> 'aux.loss.npy', '../x' -> '_.._x.npy'."""
    taken: set[str] = set()
    result = {}
    for name in names:
        stem = safe_filename(name)
        candidate, counter = stem, 1
        while candidate.lower() in taken:  # distinct on case-insensitive file systems too
            counter += 1
            candidate = f"{stem}_{counter}"
        taken.add(candidate.lower())
        result[name] = f"{candidate}.npy"
    return result


def write_output_dir(directory: str | os.PathLike, outputs: Mapping[str, np.ndarray]) -> dict[str, Path]:
    """Write every output as <dir>/<name>.npy; returns {output name: path}."""
    directory = Path(directory)
    files = {name: directory / filename for name, filename in output_filenames(list(outputs)).items()}
    atomic_write_many({files[name]: _npy_writer(array) for name, array in outputs.items()})
    return files


def _npy_writer(array: np.ndarray):
    return lambda handle: write_npy(handle, array)


def write_output_archive(path: str | os.PathLike, outputs: Mapping[str, np.ndarray]) -> Path:
    """Write all outputs into one .npz keyed by output name."""
    return save_archive(path, outputs)
