"""A small, bounds-checked FlatBuffers table reader.

ExecuTorch's `.pte` and `.ptd` files are FlatBuffers. The `flatbuffers`
runtime package reads them, but trusts every offset it is given: a damaged
file makes it raise arbitrary exceptions or read far past the buffer. This
reader checks every offset, length and vtable against the buffer before
using it, and reports any violation as one BundleError that says where.

Only what the ExecuTorch schemas use is here: tables, scalars, strings,
byte vectors, vectors of scalars, vectors of tables and unions. Slots are
vtable field indices, as in the `.fbs` files (a union takes two slots: its
type tag, then its value).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TypeVar

from ..errors import BundleError

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")

_SCALARS = {
    "u8": struct.Struct("<B"), "i8": struct.Struct("<b"), "bool": struct.Struct("<?"),
    "u16": struct.Struct("<H"), "i16": struct.Struct("<h"),
    "u32": struct.Struct("<I"), "i32": struct.Struct("<i"),
    "u64": struct.Struct("<Q"), "i64": struct.Struct("<q"), "f64": struct.Struct("<d"),
}

T = TypeVar("T")


class FlatBuffer:
    """A buffer holding one FlatBuffer; `what` names it in error messages."""

    def __init__(self, data: bytes | memoryview, what: str):
        self.data = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        self.what = what
        # Offsets may point many times at one table or vector, so that a small
        # file describes a huge structure. A well-formed file visits each part
        # about once: these budgets refuse anything that reads much more.
        self._tables_left = len(self.data) // 4 + 4096
        self._items_left = 2 * len(self.data) + 4096

    def charge(self, items: int, field: str) -> None:
        self._items_left -= items
        if self._items_left < 0:
            raise self.fail(f"{field} is read over and over (its data is referred to many times)")

    def fail(self, message: str) -> BundleError:
        return BundleError(f"{self.what}: {message}")

    def _read(self, layout: struct.Struct, position: int, field: str) -> int:
        return int(self._unpack(layout, position, field))

    def _unpack(self, layout: struct.Struct, position: int, field: str) -> int | float:
        if position < 0 or position + layout.size > len(self.data):
            raise self.fail(f"{field} lies outside the data (offset {position})")
        value: int | float = layout.unpack_from(self.data, position)[0]
        return value

    def root(self, identifier: bytes | None = None) -> Table:
        if len(self.data) < 8:
            raise self.fail("too short to hold a FlatBuffer")
        if identifier is not None and bytes(self.data[4:8]) != identifier:
            raise self.fail(f"file identifier is {bytes(self.data[4:8])!r}, expected {identifier!r}")
        return self.table_at(self._read(_U32, 0, "the root offset"), "the root table")

    def table_at(self, position: int, field: str) -> Table:
        self._tables_left -= 1
        if self._tables_left < 0:
            raise self.fail(f"{field}: more tables are referred to than the data can hold")
        vtable = position - self._read(_I32, position, field)
        vtable_size = self._read(_U16, vtable, f"the vtable of {field}")
        table_size = self._read(_U16, vtable + 2, f"the vtable of {field}")
        if vtable_size < 4 or vtable_size % 2 or vtable + vtable_size > len(self.data):
            raise self.fail(f"the vtable of {field} is malformed")
        if table_size < 4 or position + table_size > len(self.data):
            raise self.fail(f"{field} runs past the end of the data")
        return Table(self, position, vtable, (vtable_size - 4) // 2, table_size, field)

    def follow(self, position: int, field: str) -> int:
        """The target of the uoffset stored at `position`."""
        target = position + self._read(_U32, position, field)
        if target >= len(self.data):
            raise self.fail(f"{field} points outside the data")
        return target

    def vector_span(self, start: int, element_size: int, field: str, limit: int) -> tuple[int, int]:
        """(first element position, count) of the vector whose length is at `start`."""
        count = self._read(_U32, start, f"the length of {field}")
        if count > limit:
            raise self.fail(f"{field} has {count} entries, over the limit of {limit}")
        first = start + 4
        if first + count * element_size > len(self.data):
            raise self.fail(f"{field} ({count} entries) runs past the end of the data")
        return first, count


class Table:
    def __init__(self, buffer: FlatBuffer, position: int, vtable: int, slots: int, size: int, field: str):
        self.buffer = buffer
        self.position = position
        self._vtable = vtable
        self._slots = slots
        self._size = size
        self.field = field

    def _offset(self, slot: int) -> int:
        """The field's offset within the table, 0 when absent."""
        if slot >= self._slots:
            return 0
        offset = int(_U16.unpack_from(self.buffer.data, self._vtable + 4 + 2 * slot)[0])
        if offset and offset >= self._size:
            raise self.buffer.fail(f"field {slot} of {self.field} lies outside its table")
        return offset

    def has(self, slot: int) -> bool:
        return self._offset(slot) != 0

    def scalar(self, slot: int, kind: str, default: int = 0) -> int:
        """An integer field (kind: u8 ... i64, bool)."""
        offset = self._offset(slot)
        if not offset:
            return default
        return self.buffer._read(_SCALARS[kind], self.position + offset, f"field {slot} of {self.field}")

    def double(self, slot: int, default: float = 0.0) -> float:
        """A double field, as it is (scalar() would make it an int)."""
        offset = self._offset(slot)
        if not offset:
            return default
        return float(self.buffer._unpack(_SCALARS["f64"], self.position + offset, f"field {slot} of {self.field}"))

    def _target(self, slot: int, name: str) -> int | None:
        offset = self._offset(slot)
        if not offset:
            return None
        return self.buffer.follow(self.position + offset, f"{name} of {self.field}")

    def table(self, slot: int, name: str) -> Table | None:
        target = self._target(slot, name)
        return None if target is None else self.buffer.table_at(target, f"{name} of {self.field}")

    def bytes(self, slot: int, name: str, limit: int) -> memoryview | None:
        """A vector of bytes (a [ubyte] or [byte] field) as a view."""
        target = self._target(slot, name)
        if target is None:
            return None
        first, count = self.buffer.vector_span(target, 1, f"{name} of {self.field}", limit)
        self.buffer.charge(count, name)
        return self.buffer.data[first:first + count]

    def string(self, slot: int, name: str, limit: int = 1 << 16) -> str | None:
        raw = self.bytes(slot, name, limit)
        if raw is None:
            return None
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise self.buffer.fail(f"{name} of {self.field} is not valid UTF-8") from None

    def scalars(self, slot: int, kind: str, name: str, limit: int) -> list[int]:
        target = self._target(slot, name)
        if target is None:
            return []
        layout = _SCALARS[kind]
        first, count = self.buffer.vector_span(target, layout.size, f"{name} of {self.field}", limit)
        self.buffer.charge(count, name)
        return [int(value[0]) for value in layout.iter_unpack(self.buffer.data[first:first + count * layout.size])]

    def tables(self, slot: int, name: str, limit: int) -> list[Table]:
        target = self._target(slot, name)
        if target is None:
            return []
        first, count = self.buffer.vector_span(target, 4, f"{name} of {self.field}", limit)
        self.buffer.charge(count, name)
        return [
            self.buffer.table_at(self.buffer.follow(first + 4 * index, f"{name}[{index}]"), f"{name}[{index}] of {self.field}")
            for index in range(count)
        ]

    def union(self, slot: int, name: str) -> tuple[int, Table | None]:
        """(type tag, value table) of the union whose tag is in `slot`."""
        tag = self.scalar(slot, "u8")
        return tag, self.table(slot + 1, name) if tag else None

    def each(self, slot: int, name: str, limit: int, read: Callable[[Table], T]) -> list[T]:
        return [read(item) for item in self.tables(slot, name, limit)]
