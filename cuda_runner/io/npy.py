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

import encodings.cp437  # noqa: F401  (zipfile decodes names with it, imported at once: with no file descriptor left, a later import fails)
import io
import os
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np

from ..arrays import allocation_problem, shape_text
from ..errors import InputError, os_error
from ..files import open_regular, write_file
from .npy_header import HeaderError, parse_header, read_prefix

# An archive member's header is tiny; more than this is not an .npy header.
_MAX_HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class ArrayHeader:
    """What an .npy file or archive member holds, read from its header alone."""

    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    data_offset: int = 0  # where the data starts, in the file or archive member

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
    """The header at the handle's position, read by io/npy_header.py (never by
    NumPy's reader, whose tokenizer errors escape its own checks); the handle
    is left at the first byte of data."""
    try:
        prefix = _read_exactly(handle, 10)
        if prefix[6:8] in (b"\x02\x00", b"\x03\x00"):
            prefix += _read_exactly(handle, 2)
        version, length, _ = read_prefix(prefix)
        if length > _MAX_HEADER_BYTES:
            raise HeaderError(f"its header declares {length} bytes, more than an .npy header takes")
        raw = _read_exactly(handle, length)
        header = parse_header(version, raw, len(prefix) + length)
    except HeaderError as error:
        raise InputError(f"{where} is not a valid .npy file: {error}") from None
    return ArrayHeader(_header_dtype(header.descr, where), header.shape, header.fortran_order, header.data_offset)


def _read_exactly(handle: BinaryIO, count: int) -> bytes:
    data = handle.read(count)
    if len(data) != count:
        raise HeaderError("it ends inside its header")
    return data


def _header_dtype(descr: str, where: str) -> np.dtype:
    """The dtype a header's descr names, if it is a plain one (one number per element)."""
    if descr == "bfloat16":
        return _bfloat16()
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError, SyntaxError, RecursionError, MemoryError) as error:
        raise InputError(f"{where} is not a valid .npy file: its dtype {descr[:40]!r} is unknown ({_first_line(error)})") from None
    if dtype.hasobject:
        raise InputError(f"{where} holds Python objects; only plain numeric arrays are accepted (files are never unpickled)")
    if dtype.fields is not None or dtype.subdtype is not None:
        raise InputError(f"{where} holds a structured or sub-array dtype ({descr[:40]!r}), which is no model input")
    if dtype == _SAVED_BFLOAT16:
        return _bfloat16()
    return dtype


# What np.save writes for ml_dtypes' bfloat16 (it has no name for it): a bare
# 2-byte void. No other array is saved that way, so it is read as bfloat16.
_SAVED_BFLOAT16 = np.dtype("V2")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def read_array_header(path: str | os.PathLike[str]) -> ArrayHeader:
    path = Path(path)
    try:
        with open_regular(path, "an .npy file") as handle:
            header = _parse_header(handle, str(path))
            available = os.fstat(handle.fileno()).st_size - header.data_offset
    except OSError as error:
        raise os_error(error, f"cannot read {path}", InputError) from None
    if header.nbytes > available:
        raise InputError(f"{path} is truncated: its header declares {header.nbytes} bytes of data, the file holds {available}")
    return header


def load_array(path: str | os.PathLike[str]) -> np.ndarray:
    """A .npy file, memory-mapped (read-only) where it holds any data; object arrays are refused."""
    path = Path(path)
    header = read_array_header(path)
    order: Literal["C", "F"] = "F" if header.fortran_order else "C"
    if header.nbytes == 0:  # an empty file region cannot be mapped
        return np.empty(header.shape, header.dtype, order=order)
    try:
        return np.memmap(path, header.dtype, mode="r", offset=header.data_offset, shape=header.shape, order=order)
    except OSError as error:
        raise os_error(error, f"cannot read {path}", InputError) from None
    except ValueError as error:
        raise InputError(f"cannot read {path}: {_first_line(error)}") from None


def _read_data(member: io.BufferedIOBase, header: ArrayHeader) -> np.ndarray:
    """An archive member's data, after its header, into a new (writable) array."""
    buffer = bytearray(header.nbytes)
    view, filled = memoryview(buffer), 0
    while filled < header.nbytes:
        count = member.readinto(view[filled:])
        if not count:
            raise EOFError(f"its data ends after {filled} of {header.nbytes} bytes")
        filled += count
    return np.ndarray(header.shape, header.dtype, buffer, order="F" if header.fortran_order else "C")


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
            raise os_error(error, f"cannot read {self.label} as an .npz archive", InputError) from None
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
        except OSError as error:
            raise os_error(error, f"cannot read {where}", InputError) from None
        except (zipfile.BadZipFile, EOFError, ValueError, RuntimeError) as error:
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
                return _read_data(member, _parse_header(member, where))  # type: ignore[arg-type]
        except OSError as error:
            raise os_error(error, f"cannot read {where}", InputError) from None
        except (zipfile.BadZipFile, EOFError, ValueError, RuntimeError) as error:
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
