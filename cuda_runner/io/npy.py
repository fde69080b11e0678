""".npy/.npz files: headers read before data, never unpickled, written all-or-none, bfloat16-aware.

Reading is in two steps, so that an input is checked against the signature
before a byte of its data is allocated: `ArrayHeader` says what a file or an
archive member holds (dtype and shape, from its header), `load()` reads it.

NumPy writes ml_dtypes' bfloat16 as an anonymous 2-byte void ('<V2') and
reads it back as such. We write the descriptor 'bfloat16' instead, which
np.load resolves to ml_dtypes' bfloat16 once ml_dtypes is imported, and we
read a bare 2-byte void (what np.save/np.savez wrote) as bfloat16.

ml_dtypes is imported only when a file holds bfloat16: importing it costs
about 1 s of CPU (it registers NumPy loops), which every run would pay.
"""

from __future__ import annotations

import errno
import io
import os
import sys
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..arrays import allocation_problem, shape_text
from ..errors import DeviceError, InputError
from ..files import open_regular, write_file

# An archive member's header is tiny; more than this is not an .npy header.
_MAX_HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class ArrayHeader:
    """What an .npy file or archive member holds, read from its header alone."""

    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def _bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16 (importing ml_dtypes registers 'bfloat16' with NumPy, for np.load too)."""
    from ..arrays import numpy_dtype

    return numpy_dtype("bfloat16")


def _parse_header(handle: BinaryIO, where: str) -> ArrayHeader:
    start = handle.tell()
    try:
        return _parse_header_once(handle, where)
    except InputError as error:
        # A 'bfloat16' descriptor is known to NumPy only once ml_dtypes is imported.
        if "bfloat16" not in str(error) or "ml_dtypes" in sys.modules:
            raise
    _bfloat16()
    handle.seek(start)
    return _parse_header_once(handle, where)


def _parse_header_once(handle: BinaryIO, where: str) -> ArrayHeader:
    try:
        version = np.lib.format.read_magic(handle)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(handle, max_header_size=_MAX_HEADER_BYTES)
        elif version in ((2, 0), (3, 0)):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(handle, max_header_size=_MAX_HEADER_BYTES)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except (ValueError, OSError, EOFError, SyntaxError, TypeError, RecursionError, MemoryError) as error:
        raise InputError(f"{where} is not a valid .npy file: {_first_line(error)}") from None
    if dtype.hasobject:
        raise InputError(f"{where} holds Python objects; only plain numeric arrays are accepted (files are never unpickled)")
    if any(not isinstance(size, int) or size < 0 for size in shape):
        raise InputError(f"{where} is not a valid .npy file: its header declares the shape {shape}")
    dtype = np.dtype(dtype)
    if dtype == _SAVED_BFLOAT16 and dtype.fields is None:
        dtype = _bfloat16()
    return ArrayHeader(dtype, tuple(shape), bool(fortran_order))


# What np.save writes for ml_dtypes' bfloat16 (it has no name for it): a bare
# 2-byte void. No other array is saved that way, so it is read as bfloat16.
_SAVED_BFLOAT16 = np.dtype("V2")


def _bfloat16_if_saved_by_numpy(array: np.ndarray) -> np.ndarray:
    if array.dtype == _SAVED_BFLOAT16 and array.dtype.fields is None:
        return array.view(_bfloat16())
    return array


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def read_array_header(path: str | os.PathLike[str]) -> ArrayHeader:
    path = Path(path)
    try:
        with open_regular(path, "an .npy file") as handle:
            header = _parse_header(handle, str(path))
            data_offset = handle.tell()
            available = os.fstat(handle.fileno()).st_size - data_offset
    except OSError as error:
        raise InputError(f"cannot read {path}: {error.strerror or error}") from None
    if header.nbytes > available:
        raise InputError(f"{path} is truncated: its header declares {header.nbytes} bytes of data, the file holds {available}")
    return header


def load_array(path: str | os.PathLike[str]) -> np.ndarray:
    """A .npy file, memory-mapped where possible; object arrays are refused."""
    path = Path(path)
    read_array_header(path)
    try:
        return _bfloat16_if_saved_by_numpy(np.load(path, mmap_mode="r", allow_pickle=False))
    except (ValueError, OSError, EOFError) as error:
        raise InputError(f"cannot read {path}: {_first_line(error)}") from None


class NpzArchive:
    """An .npz archive read member by member: headers first, data on demand."""

    def __init__(self, source: str | os.PathLike[str] | bytes | memoryview, label: str | None = None):
        self.label = label or str(source)
        if isinstance(source, (bytes, memoryview)):
            stream: BinaryIO = io.BytesIO(bytes(source))
        else:
            stream = open_regular(source, "an .npz archive")  # closed by close()
        try:
            self._zip = zipfile.ZipFile(stream)
        except OSError as error:
            stream.close()
            if error.errno in (errno.EMFILE, errno.ENFILE):  # not the file's fault: say whose it is
                raise DeviceError(f"cannot read {self.label}: too many open files in this process (raise the limit: ulimit -n)") from None
            raise InputError(f"cannot read {self.label} as an .npz archive: {_first_line(error)}") from None
        except (zipfile.BadZipFile, EOFError, ValueError) as error:
            stream.close()
            raise InputError(f"cannot read {self.label} as an .npz archive: {_first_line(error)}") from None
        self._members = {}
        for info in self._zip.infolist():
            if not info.filename.endswith(".npy"):
                self.close()
                raise InputError(f"{self.label} is not an .npz archive: member {info.filename!r} is not an .npy file")
            self._members[info.filename[: -len(".npy")]] = info

    @property
    def keys(self) -> list[str]:
        return list(self._members)

    def header(self, key: str) -> ArrayHeader:
        where = f"{self.label} member {key!r}"
        try:
            with self._zip.open(self._members[key]) as member:
                header = _parse_header(member, where)  # type: ignore[arg-type]
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as error:
            raise InputError(f"cannot read {where}: {_first_line(error)}") from None
        if header.nbytes > self._members[key].file_size:
            raise InputError(f"{where} is truncated: its header declares {header.nbytes} bytes of data")
        return header

    def load(self, key: str) -> np.ndarray:
        header = self.header(key)  # checked again: the size cap holds before any data is read
        where = f"{self.label} member {key!r}"
        problem = allocation_problem(header.shape, header.dtype.itemsize)  # a member is read into memory, not mapped
        if problem is not None:
            raise InputError(f"cannot read {where} of shape {shape_text(header.shape)}: {problem}")
        try:
            with self._zip.open(self._members[key]) as member:
                return _bfloat16_if_saved_by_numpy(np.lib.format.read_array(member, allow_pickle=False, max_header_size=_MAX_HEADER_BYTES))
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as error:
            raise InputError(f"cannot read {where}: {_first_line(error)}") from None

    def load_all(self) -> dict[str, np.ndarray]:
        return {key: self.load(key) for key in self.keys}

    def close(self) -> None:
        self._zip.close()
        fp = self._zip.fp
        if fp is not None:
            fp.close()

    def __enter__(self) -> NpzArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_archive(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """All arrays of an .npz archive, by key."""
    with NpzArchive(path) as archive:
        return archive.load_all()


def write_npy(handle: BinaryIO, array: np.ndarray) -> None:
    array = np.asarray(array)
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # not ascontiguousarray: it turns 0-d arrays into 1-d
    if array.dtype.name == "bfloat16":  # made by ml_dtypes, so it is imported
        header = {"descr": "bfloat16", "fortran_order": False, "shape": array.shape}
        np.lib.format.write_array_header_1_0(handle, header)
        handle.write(array.tobytes())
    else:
        np.lib.format.write_array(handle, array, allow_pickle=False)


def write_npz(handle: BinaryIO, arrays: Mapping[str, np.ndarray]) -> None:
    with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                write_npy(member, array)  # type: ignore[arg-type]


def npy_writer(array: np.ndarray) -> Callable[[BinaryIO], None]:
    return lambda handle: write_npy(handle, array)


def npz_writer(arrays: Mapping[str, np.ndarray]) -> Callable[[BinaryIO], None]:
    return lambda handle: write_npz(handle, arrays)


def save_archive(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray]) -> Path:
    return write_file(path, npz_writer(arrays))


def archive_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """An .npz archive in memory (sample data stored inside bundles)."""
    buffer = io.BytesIO()
    write_npz(buffer, arrays)
    return buffer.getvalue()
