"""Opening a model file, whichever format it is in.

A cuda-runner bundle and an ExecuTorch program (`.pte`, with its `.ptd`) are
read by different modules but look the same to everything else: a Manifest,
and segments by name (`AnyReader`). `open_model` tells them apart by their
first bytes, not by their names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Union

from ..errors import CudaRunnerError, InputError
from ..opening import open_regular
from .bundle import BundleReader, open_bundle

if TYPE_CHECKING:  # the ExecuTorch reader is imported only for a program
    from .program import ProgramReader


AnyReader = Union[BundleReader, "ProgramReader"]


def is_program(path: str | os.PathLike[str]) -> bool:
    """Whether the file starts like an ExecuTorch program: "ET" and two letters
    or digits at bytes 4-8, where a bundle has its magic."""
    try:
        with open_regular(path, "a model") as handle:  # never blocks; the bundle reader then says what is wrong
            head = handle.read(8)
    except (CudaRunnerError, OSError):
        return False
    return len(head) == 8 and head[4:6] == b"ET" and head[6:8].isalnum()


def open_model(path: str | os.PathLike[str], data: str | os.PathLike[str] | None = None) -> AnyReader:
    """A bundle, or an ExecuTorch program with its data file (`data`, or the
    one ExecuTorch names `aoti_cuda_blob.ptd`, found next to the program)."""
    if is_program(path):
        from .program import ProgramReader

        return ProgramReader(path, data)
    reader = open_bundle(path)  # a file that is neither is refused as a bad bundle
    if data is not None:
        reader.close()
        raise InputError(f"{Path(path).name} is a bundle, not an ExecuTorch program; a data file goes only with a program")
    return reader
