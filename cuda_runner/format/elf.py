"""What a model library needs, read from its ELF file without loading it.

Loading a library runs its constructors, so the facts that decide whether to
load it at all come from the file: the shared libraries it names (NEEDED),
the symbols it leaves for others to define (the aoti_torch_* shim functions
it expects from libtorch), and the GPU architectures of the CUDA kernels
embedded in it (fatbins). Only 64-bit little-endian ELF is read; every offset
is checked against the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import BundleError

_SECTION = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
_DYNAMIC = struct.Struct("<qQ")
_SHT_DYNAMIC, _SHT_DYNSYM = 6, 11
_DT_NEEDED = 1
_MAX_SECTIONS = 1 << 16
_MAX_SYMBOLS = 1 << 22

FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
_FATBIN_HEADER = struct.Struct("<IHHQ")
_FATBIN_ENTRY = struct.Struct("<HHIQ")  # kind, version, header size, payload size
_FATBIN_KINDS = {1: "ptx", 2: "sass"}
_MAX_FATBIN_ENTRIES = 1 << 16  # over the whole file: a large model embeds thousands of kernels


@dataclass(frozen=True)
class LibraryFacts:
    needed: tuple[str, ...]  # DT_NEEDED entries
    undefined: tuple[str, ...]  # undefined dynamic symbols, sorted
    kernels: tuple[str, ...]  # "sm_90 (sass)", "sm_90 (ptx)": the fatbin entries' architectures

    @property
    def uses_cuda(self) -> bool:
        return bool(self.kernels) or any(name.startswith("libcuda.so") or name.startswith("libcudart") for name in self.needed)

    @property
    def shim_symbols(self) -> tuple[str, ...]:
        return tuple(name for name in self.undefined if name.startswith("aoti_torch_"))

    @property
    def compute_capability(self) -> str | None:
        """The lowest SASS architecture as "9.0", or None (no SASS, or PTX only)."""
        sass = sorted(int(item.split()[0][3:]) for item in self.kernels if item.endswith("(sass)"))
        if not sass:
            return None
        return f"{sass[0] // 10}.{sass[0] % 10}"


def _fail(message: str) -> BundleError:
    return BundleError(f"model library: {message}")


def read_library_facts(data: bytes | memoryview) -> LibraryFacts:
    view = memoryview(data).cast("B")
    if len(view) < 64 or bytes(view[:4]) != b"\x7fELF":
        raise _fail("not an ELF shared object")
    if view[4] != 2 or view[5] != 1:
        raise _fail("not a 64-bit little-endian ELF file")
    section_offset = int(struct.unpack_from("<Q", view, 0x28)[0])
    entry_size, count = struct.unpack_from("<HH", view, 0x3A)
    if count > _MAX_SECTIONS or (count and entry_size != _SECTION.size) or section_offset + count * _SECTION.size > len(view):
        raise _fail("its section table lies outside the file")
    sections = [_SECTION.unpack_from(view, section_offset + index * _SECTION.size) for index in range(count)]
    needed: dict[str, None] = {}  # ordered, without repeats
    undefined: set[str] = set()
    seen: set[tuple[int, int, int]] = set()  # several headers may describe one section: read it once
    for section in sections:
        kind, offset, size, link, entsize = section[1], section[4], section[5], section[6], section[9]
        if kind not in (_SHT_DYNAMIC, _SHT_DYNSYM) or (kind, offset, size) in seen:
            continue
        seen.add((kind, offset, size))
        if offset + size > len(view) or link >= len(sections):
            raise _fail("a dynamic section lies outside the file")
        strings = _span(view, sections[link])
        if kind == _SHT_DYNAMIC:
            for tag, value in _DYNAMIC.iter_unpack(view[offset:offset + size - size % _DYNAMIC.size]):
                if tag == _DT_NEEDED and len(needed) < _MAX_NEEDED:
                    needed[_string(strings, value)] = None
        elif entsize == _SYMBOL.size and size // _SYMBOL.size <= _MAX_SYMBOLS:
            for name, _info, _other, section_index, _value, _size in _SYMBOL.iter_unpack(view[offset:offset + size - size % _SYMBOL.size]):
                if name and section_index == 0:
                    undefined.add(_string(strings, name))
    return LibraryFacts(tuple(needed), tuple(sorted(undefined)), fatbin_kernels(view))


_MAX_NEEDED = 256


def _span(view: memoryview, section: tuple[int, ...]) -> memoryview:
    offset, size = section[4], section[5]
    if offset + size > len(view):
        raise _fail("a string table lies outside the file")
    return view[offset:offset + size]


def _string(table: memoryview, offset: int) -> str:
    if offset >= len(table):
        raise _fail("a symbol name lies outside its string table")
    end = bytes(table[offset:offset + 4096]).find(b"\0")
    raw = bytes(table[offset:offset + end if end >= 0 else offset + 4096])
    return raw.decode("utf-8", "replace")


def fatbin_kernels(view: memoryview) -> tuple[str, ...]:
    """Architectures of every fatbin entry embedded anywhere in the file, e.g. ("sm_90 (sass)",)."""
    raw = bytes(view)
    found: set[str] = set()
    budget = [_MAX_FATBIN_ENTRIES]  # entries read over the whole file, not per fatbin
    position = raw.find(FATBIN_MAGIC)
    while position >= 0 and budget[0] > 0:
        entries, end = _fatbin_entries(raw, position, budget)
        found.update(entries)
        position = raw.find(FATBIN_MAGIC, max(position + 4, end))  # past the fatbin just read
    return tuple(sorted(found))


def _fatbin_entries(raw: bytes, start: int, budget: list[int]) -> tuple[set[str], int]:
    if start + _FATBIN_HEADER.size > len(raw):
        return set(), start
    _magic, _version, header_size, fat_size = _FATBIN_HEADER.unpack_from(raw, start)
    end = min(len(raw), start + header_size + fat_size)
    cursor = start + header_size
    found: set[str] = set()
    while budget[0] > 0:
        budget[0] -= 1
        if cursor + 32 > end:
            break
        kind, _entry_version, entry_header, payload = _FATBIN_ENTRY.unpack_from(raw, cursor)
        arch = int(struct.unpack_from("<I", raw, cursor + 28)[0])
        if kind not in _FATBIN_KINDS or entry_header < 32 or not 10 <= arch < 1000:
            return found, start + 4 if not found else cursor  # not a fatbin entry (the magic can occur by chance)
        found.add(f"sm_{arch} ({_FATBIN_KINDS[kind]})")
        cursor += entry_header + payload
    return found, cursor
