"""Writing outputs: one .npy per output and/or one .npz, as one all-or-none transaction."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..arrays import dtype_name
from ..errors import InputError
from ..files import SET_RECORD, Writer, check_destination, set_record_matches, write_files
from ..format.manifest import MAX_NAME_LENGTH
from .npy import npy_writer, npz_writer

_UNSAFE_FILENAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def safe_filename(name: str) -> str:
    """A file-system-safe stem for an output name ('aux.loss' stays as it is).

    Anything outside [A-Za-z0-9._-] becomes '_', a leading dot is replaced so
    no hidden or relative names appear, and the length is bounded.
    """
    stem = _UNSAFE_FILENAME_CHARS.sub("_", unicodedata.normalize("NFKC", name))
    if not stem or stem.startswith("."):
        stem = "_" + stem
    return stem[:MAX_NAME_LENGTH]


@dataclass(frozen=True)
class OutputPlan:
    """Where outputs go. `bf16_as` converts bfloat16 outputs on the way out
    (e.g. "float32", for readers without ml_dtypes); None keeps them.
    `record`: the outputs also get a set record (files.py), so that
    `complete()` can tell a whole set from one cut short by a kill, or written
    by another model or from other inputs (`provenance` names what wrote it).
    The record of a directory is inside it; an archive's is beside it."""

    directory: Path | None = None
    archive: Path | None = None
    bf16_as: str | None = None
    record: bool = False
    provenance: Mapping[str, Any] | None = None

    @property
    def record_path(self) -> Path | None:
        """Where the set record goes, where there is one."""
        if not self.record:
            return None
        if self.directory is not None:
            if self.archive is not None:
                raise ValueError("a set record covers the files of one folder, not an archive beside them")
            return self.directory / SET_RECORD
        if self.archive is not None:
            return self.archive.with_name(f".{self.archive.name}{SET_RECORD}")
        return None

    @property
    def writes(self) -> bool:
        return self.directory is not None or self.archive is not None

    def written_dtype(self, dtype: str) -> str:
        """The dtype an output of `dtype` has in the files this plan writes."""
        return self.bf16_as if self.bf16_as is not None and dtype == "bfloat16" else dtype

    def check(self) -> None:
        """Refuse, before anything runs, destinations that cannot be written."""
        if self.archive is not None:
            if self.archive.suffix != ".npz":
                raise InputError(f"{self.archive}: an output archive must end in .npz")
            check_destination(self.archive)
        if self.directory is not None:
            check_destination(self.directory / "x.npy")
            if self.directory.exists() and not self.directory.is_dir():
                raise InputError(f"{self.directory} exists and is not a directory")

    def complete(self, names: list[str]) -> bool:
        """Whether the outputs `names` are all there, written whole by one write
        with this plan's provenance: with `record`, the set record must match
        them; without it, every file existing is all that can be told."""
        paths = [self.directory / filename for filename in output_filenames(names).values()] if self.directory is not None else []
        if self.archive is not None:
            paths.append(self.archive)
        record = self.record_path
        if record is not None:
            return set_record_matches(record, paths, self.provenance)
        return bool(paths) and all(path.is_file() for path in paths)


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


def _converted(outputs: Mapping[str, np.ndarray], plan: OutputPlan) -> dict[str, np.ndarray]:
    arrays = {}
    for name, array in outputs.items():
        dtype = dtype_name(array.dtype)
        written = plan.written_dtype(dtype)
        arrays[name] = array if written == dtype else array.astype(written)
    return arrays


def write_outputs(plan: OutputPlan, outputs: Mapping[str, np.ndarray]) -> dict[str, list[Path]]:
    """Write every destination of `plan` in one transaction; {output name: [files]}.
    Each output is written as `plan.written_dtype` of its dtype says."""
    arrays = _converted(outputs, plan)
    writers: dict[Path, Writer] = {}
    files: dict[str, list[Path]] = {name: [] for name in arrays}
    if plan.directory is not None:
        for name, filename in output_filenames(list(arrays)).items():
            path = plan.directory / filename
            writers[path] = npy_writer(arrays[name])
            files[name].append(path)
    if plan.archive is not None:
        writers[plan.archive] = npz_writer(arrays)
        for name in arrays:
            files[name].append(plan.archive)
    write_files(writers, record=plan.record_path, provenance=plan.provenance)
    return files
