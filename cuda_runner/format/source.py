"""Opening a model file, whichever format it is in.

A cuda-runner bundle and an ExecuTorch program (`.pte`, with its `.ptd`) are
read by different modules but look the same to everything else: a
`ModelReader`, with a Manifest and segments by name. `open_model` tells them
apart by their first bytes, not by their names.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

from ..errors import CudaRunnerError, InputError
from ..files import open_regular
from .bundle import open_bundle, read_manifest
from .manifest import Manifest
from .signing import SignedFile, TrustedKey


class ModelReader(Protocol):
    """What the runtime needs of an open model file, whichever format it is in."""

    path: Path
    manifest: Manifest
    file_size: int
    #: The checked signature, once require_signature succeeded; None before (and always for programs).
    signature: SignedFile | None

    @property
    def version(self) -> str:
        """The format version, for reports."""
        ...

    def identity(self) -> str:
        """A digest naming exactly this model's contents ("xxh3-128:..."): what a
        batch's set records name as the model that wrote a set (commands/batch.py)."""
        ...

    def segment(self, name: str, *, verify: bool = True) -> memoryview:
        """A zero-copy view of a segment, its digest checked (where it has one) unless verify=False."""
        ...

    def read_verified(self, name: str) -> bytes:
        """A private copy of a segment, checked after copying (code is loaded from it)."""
        ...

    def verify_in_background(self, name: str) -> Future[None]:
        """Check a segment on other threads; the future raises BundleError on a mismatch."""
        ...

    def verify_all(self) -> dict[str, bool]:
        """{segment: digest matches} for every segment that can be checked."""
        ...

    def require_signature(self, keys: Sequence[TrustedKey]) -> SignedFile:
        """Check the file's signature against trusted keys, or raise BundleError."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> ModelReader: ...

    def __exit__(self, *exc: object) -> None: ...


def is_program(path: str | os.PathLike[str]) -> bool:
    """Whether the file starts like an ExecuTorch program: "ET" and two letters
    or digits at bytes 4-8, where a bundle has its magic."""
    try:
        with open_regular(path, "a model") as handle:  # never blocks; the bundle reader then says what is wrong
            head = handle.read(8)
    except (CudaRunnerError, OSError):
        return False
    return len(head) == 8 and head[4:6] == b"ET" and head[6:8].isalnum()


def device_types(path: str | os.PathLike[str]) -> frozenset[str]:
    """The devices a model file's methods target, as a hint read before the
    file is opened for running: from a bundle's manifest; an ExecuTorch program
    is taken to be CUDA (its libraries may be in the data file, which is not
    read here). Empty when the file cannot be read: opening it says why."""
    if is_program(path):
        return frozenset({"cuda"})
    try:
        return frozenset(method.device.type for method in read_manifest(path).methods.values())
    except (CudaRunnerError, OSError):
        return frozenset()


def open_model(path: str | os.PathLike[str], data: str | os.PathLike[str] | None = None) -> ModelReader:
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
