"""What a model library needs, read from its ELF file without loading it.

Loading a library runs its constructors, so the facts that decide whether to
load it at all come from the file: the shared libraries it names (NEEDED),
the symbols it leaves for others to define (the aoti_torch_* shim functions
it expects from libtorch), and the GPU architectures of the CUDA kernels
embedded in it (fatbins). Only 64-bit little-endian ELF is read; every offset
is checked against the file.

`rename_imports` writes the one change the runtime ever makes to a library:
in a private copy, the names of some undefined symbols get another prefix of
the same length, so that they bind to cuda-runner's own shim (runtime/providers.py).
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

from ..errors import BundleError

_SECTION = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
_DYNAMIC = struct.Struct("<qQ")
_SHT_DYNAMIC, _SHT_DYNSYM = 6, 11
_DT_NEEDED = 1
_STB_GLOBAL, _STB_WEAK = 1, 2
_SHT_GNU_VERNEED = 0x6FFFFFFE
_SHT_GNU_VERSYM = 0x6FFFFFFF
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
    defined: tuple[str, ...] = ()  # exported (defined, global or weak) dynamic symbols, sorted

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
    defined: set[str] = set()
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
            for name, info, _other, section_index, _value, _size in _SYMBOL.iter_unpack(view[offset:offset + size - size % _SYMBOL.size]):
                if name and section_index == 0:
                    undefined.add(_string(strings, name))
                elif name and info >> 4 in (_STB_GLOBAL, _STB_WEAK):
                    defined.add(_string(strings, name))
    return LibraryFacts(tuple(needed), tuple(sorted(undefined)), fatbin_kernels(view), tuple(sorted(defined)))


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


def rename_imports(data: bytes | memoryview, renames: dict[str, str]) -> bytes:
    """A copy of the library in which every undefined dynamic symbol whose name
    starts with a key of `renames` starts with its value instead.

    Each new prefix has its old one's length, so only bytes of the dynamic
    string table change. Refused (BundleError) where that could change any
    other name: a string the dynamic section, another symbol or the version
    tables point into, or an import that asks for a symbol version."""
    if any(len(old) != len(new) or not old for old, new in renames.items()):
        raise ValueError("a renamed prefix must keep its length")
    view = memoryview(data).cast("B")
    facts = read_library_facts(view)  # the same checks as for reading
    del facts
    out = bytearray(view)
    section_offset = int(struct.unpack_from("<Q", view, 0x28)[0])
    _entry_size, count = struct.unpack_from("<HH", view, 0x3A)
    sections = [_SECTION.unpack_from(view, section_offset + index * _SECTION.size) for index in range(count)]
    for index, section in enumerate(sections):
        if section[1] != _SHT_DYNSYM:
            continue
        strings = sections[section[6]]
        base, table = strings[4], _span(view, strings)
        versions = _symbol_versions(view, sections, index)
        changes: list[tuple[int, bytes]] = []
        references: list[int] = []
        for number, (name, _info, _other, section_index, _value, _size) in enumerate(_SYMBOL.iter_unpack(view[section[4]:section[4] + section[5] - section[5] % _SYMBOL.size])):
            if not name:
                continue
            text = _string(table, name)
            new = next((renames[old] + text[len(old):] for old in renames if text.startswith(old)), None)
            if new is None or section_index != 0:
                references.append(name)
                continue
            if versions is not None and number < len(versions) and versions[number] > 1:
                raise _fail(f"its import {text!r} asks for a symbol version, so it cannot be bound to another provider")
            changes.append((name, new.encode()))
        references += _other_string_references(view, sections, section[6])
        _check_no_overlap(changes, references, table)
        for name, new_bytes in changes:
            out[base + name:base + name + len(new_bytes)] = new_bytes
    return bytes(out)


def _symbol_versions(view: memoryview, sections: list[tuple[int, ...]], dynsym_index: int) -> list[int] | None:
    for section in sections:
        if section[1] == _SHT_GNU_VERSYM and section[6] == dynsym_index:
            span = _span(view, section)
            return [value & 0x7FFF for (value,) in struct.iter_unpack("<H", span[:len(span) - len(span) % 2])]
    return None


def _other_string_references(view: memoryview, sections: list[tuple[int, ...]], strings_index: int) -> list[int]:
    """Offsets into the dynamic string table used by the dynamic section and the
    version-needed table (library names, versions, run paths)."""
    found: list[int] = []
    for section in sections:
        if section[6] != strings_index:
            continue
        if section[1] == _SHT_DYNAMIC:
            span = _span(view, section)
            # NEEDED, SONAME, RPATH, RUNPATH, AUXILIARY, FILTER: values that are string offsets.
            found += [value for tag, value in _DYNAMIC.iter_unpack(span[:len(span) - len(span) % _DYNAMIC.size]) if tag in (1, 14, 15, 29, 0x7FFFFFFD, 0x7FFFFFFF)]
        elif section[1] == _SHT_GNU_VERNEED:
            found += _verneed_strings(_span(view, section))
    return found


def _verneed_strings(span: memoryview) -> list[int]:
    found: list[int] = []
    cursor, budget = 0, 1 << 12
    while budget > 0 and cursor + 16 <= len(span):
        budget -= 1
        _version, count, file_name, aux, following = struct.unpack_from("<HHIII", span, cursor)
        found.append(file_name)
        entry = cursor + aux
        for _ in range(min(count, 1 << 12)):
            if entry + 16 > len(span):
                break
            _hash, _flags, _other, name, step = struct.unpack_from("<IHHII", span, entry)
            found.append(name)
            if not step:
                break
            entry += step
        if not following:
            break
        cursor += following
    return found


def _check_no_overlap(changes: list[tuple[int, bytes]], references: list[int], table: memoryview) -> None:
    changed = sorted((start, start + len(new)) for start, new in changes)
    for reference in references:
        end = bytes(table[reference:reference + 4096]).find(b"\0")
        stop = reference + (end if end >= 0 else 4096)
        position = bisect.bisect_right(changed, (stop, stop)) - 1
        if position >= 0 and changed[position][1] > reference and changed[position][0] < stop:
            raise _fail("a renamed import shares its name's bytes with another name, so it cannot be bound to another provider")
