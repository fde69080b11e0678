"""Reading and writing .npy/.npz files: never unpickling, always atomic, bfloat16-aware.

NumPy writes ml_dtypes' bfloat16 as an anonymous 2-byte void ('<V2') and
reads it back as such. We write the descriptor 'bfloat16' instead, which
np.load resolves to ml_dtypes' bfloat16 once ml_dtypes is imported.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

import ml_dtypes  # noqa: F401  (registers 'bfloat16' with NumPy for np.load)
import numpy as np

from ..errors import InputError
from ..format.bundle import WriteError


def load_array(path: str | os.PathLike) -> np.ndarray:
    """A .npy file, memory-mapped where possible; object arrays are refused."""
    path = Path(path)
    _require_file(path)
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as error:
        if "allow_pickle" in str(error) or "object" in str(error).lower():
            raise InputError(f"{path} holds Python objects; only plain numeric arrays are accepted (files are never unpickled)") from None
        raise InputError(f"{path} is not a valid .npy file: {error}") from None
    except (OSError, EOFError) as error:
        raise InputError(f"cannot read {path}: {error}") from None


def load_archive(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All arrays of an .npz archive, by key."""
    path = Path(path)
    _require_file(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}
    except ValueError as error:
        if "allow_pickle" in str(error):
            raise InputError(f"{path} holds Python objects; only plain numeric arrays are accepted (files are never unpickled)") from None
        raise InputError(f"{path} is not a valid .npz archive: {error}") from None
    except (OSError, EOFError, zipfile.BadZipFile) as error:
        raise InputError(f"cannot read {path} as an .npz archive: {error}") from None


def _require_file(path: Path) -> None:
    if not path.exists():
        raise InputError(f"{path} does not exist")
    if not path.is_file():
        raise InputError(f"{path} is not a file")


def write_npy(handle: BinaryIO, array: np.ndarray) -> None:
    array = np.asarray(array)
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # not ascontiguousarray: it turns 0-d arrays into 1-d
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        header = {"descr": "bfloat16", "fortran_order": False, "shape": array.shape}
        np.lib.format.write_array_header_1_0(handle, header)
        handle.write(array.tobytes())
    else:
        np.lib.format.write_array(handle, array, allow_pickle=False)


def _write_npz(handle: BinaryIO, arrays: Mapping[str, np.ndarray]) -> None:
    with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                write_npy(member, array)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Write through a temp file beside `path`, fsync, then rename over it."""
    return atomic_write_many({Path(path): write})[0]


def atomic_write_many(writers: Mapping[Path, Callable[[BinaryIO], None]]) -> list[Path]:
    """Write all files or none: every temp file is complete before any is renamed."""
    temps: dict[Path, str] = {}
    try:
        for path, write in writers.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False) as handle:
                temps[path] = handle.name
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(handle.name, 0o644)
        for path, temp in temps.items():
            os.replace(temp, path)
        return list(writers)
    except OSError as error:
        raise WriteError(f"cannot write {error.filename or 'output'}: {error.strerror or error}") from None
    finally:
        for temp in temps.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)


def save_array(path: str | os.PathLike, array: np.ndarray) -> Path:
    return atomic_write(path, lambda handle: write_npy(handle, array))


def save_archive(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> Path:
    return atomic_write(path, lambda handle: _write_npz(handle, arrays))


def archive_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """An .npz archive in memory (sample data stored inside bundles)."""
    import io

    buffer = io.BytesIO()
    _write_npz(buffer, arrays)
    return buffer.getvalue()


def archive_from_bytes(data: bytes | memoryview) -> dict[str, np.ndarray]:
    import io

    with np.load(io.BytesIO(bytes(data)), allow_pickle=False) as archive:
        return {key: archive[key] for key in archive.files}
