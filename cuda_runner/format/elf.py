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
_NAME_AND_SECTION = struct.Struct("<I2xH16x")  # a symbol's name offset and section index, nothing else
_DYNAMIC = struct.Struct("<qQ")
_SHT_DYNAMIC, _SHT_DYNSYM = 6, 11
_DT_NEEDED = 1
_STB_GLOBAL, _STB_WEAK = 1, 2
_SHT_GNU_VERDEF = 0x6FFFFFFD
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
    # Exported (defined, global or weak) dynamic symbols, sorted; read only on
    # request (exports=True): a model library exports thousands (its static C++ runtime).
    defined: tuple[str, ...] = ()

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


def read_library_facts(data: bytes | memoryview, *, exports: bool = False) -> LibraryFacts:
    view = memoryview(data).cast("B")
    needed, undefined, defined = _dynamic_symbols(view, exports)
    raw = data if isinstance(data, bytes) else bytes(view)  # the fatbin search needs bytes.find: copy only a view
    return LibraryFacts(tuple(needed), tuple(sorted(undefined)), _fatbin_kernels(raw), tuple(sorted(defined)))


def _dynamic_symbols(view: memoryview, exports: bool = False) -> tuple[dict[str, None], set[str], set[str]]:
    """The checks every reader of a library makes, and its needed libraries
    (ordered, without repeats), undefined and (with `exports`) defined dynamic symbol names."""
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
    tables: dict[int, bytes] = {}  # each string table copied once, however many sections link to it
    for section in sections:
        kind, offset, size, link, entsize = section[1], section[4], section[5], section[6], section[9]
        if kind not in (_SHT_DYNAMIC, _SHT_DYNSYM) or (kind, offset, size) in seen:
            continue
        seen.add((kind, offset, size))
        if offset + size > len(view) or link >= len(sections):
            raise _fail("a dynamic section lies outside the file")
        if size == 0:
            continue
        strings = tables.get(link)
        if strings is None:
            strings = tables[link] = bytes(_span(view, sections[link]))  # names are found in it by bytes.find
        if kind == _SHT_DYNAMIC:
            for tag, value in _DYNAMIC.iter_unpack(view[offset:offset + size - size % _DYNAMIC.size]):
                if tag == _DT_NEEDED and len(needed) < _MAX_NEEDED:
                    needed[_string(strings, value)] = None
        elif entsize == _SYMBOL.size and size // _SYMBOL.size <= _MAX_SYMBOLS:
            for name, info, _other, section_index, _value, _size in _SYMBOL.iter_unpack(view[offset:offset + size - size % _SYMBOL.size]):
                if name and section_index == 0:
                    undefined.add(_string(strings, name))
                elif exports and name and info >> 4 in (_STB_GLOBAL, _STB_WEAK):
                    defined.add(_string(strings, name))
    return needed, undefined, defined


_MAX_NEEDED = 256


def _span(view: memoryview, section: tuple[int, ...]) -> memoryview:
    offset, size = section[4], section[5]
    if offset + size > len(view):
        raise _fail("a string table lies outside the file")
    return view[offset:offset + size]


def _string(table: bytes, offset: int) -> str:
    if offset >= len(table):
        raise _fail("a symbol name lies outside its string table")
    return table[offset:_string_end(table, offset)].decode("utf-8", "replace")


def _string_end(table: bytes, offset: int) -> int:
    """Where the name at `offset` ends: its NUL, or 4096 bytes on (names are capped there)."""
    end = table.find(b"\0", offset, offset + 4096)
    return end if end >= 0 else min(len(table), offset + 4096)


def _fatbin_kernels(raw: bytes) -> tuple[str, ...]:
    """Architectures of every fatbin entry embedded anywhere in the file, e.g. ("sm_90 (sass)",)."""
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


def rename_imports(data: bytes | memoryview, renames: dict[str, str]) -> bytearray:
    """A copy of the library in which every undefined dynamic symbol whose name
    starts with a key of `renames` starts with its value instead.

    Each new prefix has its old one's length, so only bytes of the dynamic
    string table change. Refused (BundleError) where that could change any
    other name: a string the dynamic section, another symbol or the version
    tables point into, or an import that asks for a symbol version."""
    if any(len(old) != len(new) or not old for old, new in renames.items()):
        raise ValueError("a renamed prefix must keep its length")
    view = memoryview(data).cast("B")
    _dynamic_symbols(view)  # the same checks as for reading
    out = bytearray(view)
    section_offset = int(struct.unpack_from("<Q", view, 0x28)[0])
    if section_offset == 0:
        raise _fail("it has no section table, so its imports cannot be read before loading it")
    _entry_size, count = struct.unpack_from("<HH", view, 0x3A)
    sections = [_SECTION.unpack_from(view, section_offset + index * _SECTION.size) for index in range(count)]
    _check_dynamic_agrees(view, sections)  # first: it also refuses more than one dynamic symbol table
    for index, section in enumerate(sections):
        if section[1] != _SHT_DYNSYM:
            continue
        strings = sections[section[6]]
        base, table = strings[4], bytes(_span(view, strings))
        versions = _symbol_versions(view, sections, index)
        changes: list[tuple[int, bytes]] = []
        raw_renames = {old.encode(): new.encode() for old, new in renames.items()}
        # A model library defines thousands of symbols (its static C++ runtime)
        # and imports a few hundred: the defined ones matter here only as names
        # another rename must not touch, so they are read in one comprehension
        # and only the imports are looked at one by one.
        entries = list(_NAME_AND_SECTION.iter_unpack(view[section[4]:section[4] + section[5] - section[5] % _SYMBOL.size]))
        if max((name for name, _ in entries if name), default=-1) >= len(table):
            raise _fail("a symbol name lies outside its string table")
        references = [name for name, section_index in entries if name and section_index]
        imports = [(number, name) for number, (name, section_index) in enumerate(entries) if name and not section_index]
        for number, name in imports:
            raw = table[name:name + 64]  # bytes, never decoded: the new name must have the old one's length exactly
            prefix = next((old for old in raw_renames if raw.startswith(old)), None)
            if prefix is None:
                references.append(name)
                continue
            if versions is not None and 2 * number + 2 <= len(versions) and struct.unpack_from("<H", versions, 2 * number)[0] & 0x7FFF > 1:
                raise _fail(f"its import {_string(table, name)!r} asks for a symbol version, so it cannot be bound to another provider")
            changes.append((name, raw_renames[prefix]))
        references += _other_string_references(view, sections, section[6])
        _check_no_overlap(changes, references, table)
        for name, new_prefix in changes:
            out[base + name:base + name + len(new_prefix)] = new_prefix
    return out  # not copied again into bytes: a model library is megabytes


_PT_LOAD, _PT_DYNAMIC = 1, 2
_PROGRAM = struct.Struct("<IIQQQQQQ")
_DT_STRTAB, _DT_SYMTAB, _DT_STRSZ, _DT_RELA, _DT_RELASZ, _DT_JMPREL, _DT_PLTRELSZ = 5, 6, 10, 7, 8, 23, 2
_DT_SYMENT, _DT_REL, _DT_PLTREL = 11, 17, 20
# The version tables the loader finds through the dynamic segment, and the section type each must have.
_VERSION_TABLES = ((0x6FFFFFF0, _SHT_GNU_VERSYM), (0x6FFFFFFC, _SHT_GNU_VERDEF), (0x6FFFFFFE, _SHT_GNU_VERNEED))
_RELA = struct.Struct("<QQq")


def _check_dynamic_agrees(view: memoryview, sections: list[tuple[int, ...]]) -> None:
    """The loader reads the dynamic segment, not the section headers this module
    renames by: refuse a library where they could disagree, so that no import
    the loader binds can escape the renaming. The dynamic symbol and string
    tables the section headers name must be the ones DT_SYMTAB and DT_STRTAB
    point at (same address and string-table size), the one dynamic section
    header must describe the dynamic segment and link that string table, each
    version table the segment names (DT_VERSYM, DT_VERDEF, DT_VERNEED) must
    have a section header of its kind there, linked as the renaming reads it,
    and every relocation must name a symbol inside the symbol table the headers
    give. A header retyped or relinked would otherwise hide a library name
    from the overlap check or a symbol version from the version check."""
    program_offset = int(struct.unpack_from("<Q", view, 0x20)[0])
    program_size, program_count = struct.unpack_from("<HH", view, 0x36)
    if program_size != _PROGRAM.size or program_offset + program_count * _PROGRAM.size > len(view):
        raise _fail("its program headers lie outside the file")
    headers = [_PROGRAM.unpack_from(view, program_offset + index * _PROGRAM.size) for index in range(program_count)]
    dynamic = [header for header in headers if header[0] == _PT_DYNAMIC]
    symbols = [section for section in sections if section[1] == _SHT_DYNSYM]
    if len(dynamic) != 1 or len(symbols) != 1:
        raise _fail("it does not have exactly one dynamic segment and one dynamic symbol table")
    loads = [header for header in headers if header[0] == _PT_LOAD]

    def file_offset(address: int) -> int:
        for _kind, _flags, offset, vaddr, _paddr, filesz, _memsz, _align in loads:
            if vaddr <= address < vaddr + filesz:
                return address - vaddr + offset
        raise _fail("a dynamic table lies outside its loaded segments")

    _kind, _flags, offset, _vaddr, _paddr, filesz, _memsz, _align = dynamic[0]
    if offset + filesz > len(view):
        raise _fail("its dynamic segment lies outside the file")
    entries = _loader_entries(view[offset:offset + filesz - filesz % _DYNAMIC.size])
    symbol_table = symbols[0]
    strings = sections[symbol_table[6]]
    if (_DT_SYMTAB not in entries or _DT_STRTAB not in entries or file_offset(entries[_DT_SYMTAB]) != symbol_table[4]
            or file_offset(entries[_DT_STRTAB]) != strings[4] or entries.get(_DT_STRSZ) != strings[5]):
        raise _fail("its section headers and its dynamic segment name different symbol tables")
    dynamic_sections = [section for section in sections if section[1] == _SHT_DYNAMIC]
    if len(dynamic_sections) != 1 or dynamic_sections[0][4] != offset or dynamic_sections[0][5] != filesz or dynamic_sections[0][6] != symbol_table[6]:
        raise _fail("its section headers and its dynamic segment describe different dynamic tables")
    symbol_index = sections.index(symbol_table)
    for tag, kind in _VERSION_TABLES:
        if sum(section[1] == kind for section in sections) > 1:  # the renaming would read the first
            raise _fail("it has more than one symbol version table of a kind")
        if tag in entries:
            at, link = file_offset(entries[tag]), symbol_index if kind == _SHT_GNU_VERSYM else symbol_table[6]
            if not any(section[1] == kind and section[4] == at and section[6] == link for section in sections):
                raise _fail("its section headers and its dynamic segment name different symbol version tables")
    count = symbol_table[5] // _SYMBOL.size
    for table_tag, size_tag in ((_DT_RELA, _DT_RELASZ), (_DT_JMPREL, _DT_PLTRELSZ)):
        if table_tag not in entries:
            continue
        start, size = file_offset(entries[table_tag]), entries.get(size_tag, 0)
        if start + size > len(view):
            raise _fail("its relocations lie outside the file")
        for _offset, info, _addend in _RELA.iter_unpack(view[start:start + size - size % _RELA.size]):
            if info >> 32 >= count:
                raise _fail("a relocation names a symbol outside its dynamic symbol table")


# Tags the loader reads every entry of; for any other tag it keeps the last
# entry it meets (glibc's elf_get_dynamic_info stores each in one slot).
_MULTI_VALUED_TAGS = frozenset({_DT_NEEDED, 0x7FFFFFFD, 0x7FFFFFFF})  # DT_NEEDED, DT_AUXILIARY, DT_FILTER


def _loader_entries(table: memoryview) -> dict[int, int]:
    """The dynamic segment's entries as the loader reads them: up to the first
    DT_NULL, one value per tag. A tag given twice is refused: this module and
    the loader would each read another of its values (the first, the last),
    and a second DT_STRTAB or DT_SYMTAB would bind imports the renaming never saw."""
    entries: dict[int, int] = {}
    for tag, value in _DYNAMIC.iter_unpack(table):
        if tag == 0:
            break
        if tag in entries and tag not in _MULTI_VALUED_TAGS:
            raise _fail(f"its dynamic table gives tag {tag:#x} twice, which the loader reads as one value")
        entries[tag] = value
    else:  # the loader would read on past the segment's end, into whatever memory follows it
        raise _fail("its dynamic table has no DT_NULL entry to end it")
    if entries.get(_DT_SYMENT, _SYMBOL.size) != _SYMBOL.size or entries.get(_DT_PLTREL, _DT_RELA) != _DT_RELA or _DT_REL in entries:
        raise _fail("its dynamic table describes its symbols or relocations in a layout other than x86-64's")
    return entries


def _symbol_versions(view: memoryview, sections: list[tuple[int, ...]], dynsym_index: int) -> memoryview | None:
    """The version table of the dynamic symbols (one little-endian 16-bit entry each), or None."""
    for section in sections:
        if section[1] == _SHT_GNU_VERSYM and section[6] == dynsym_index:
            return _span(view, section)
    return None


def _other_string_references(view: memoryview, sections: list[tuple[int, ...]], strings_index: int) -> list[int]:
    """Offsets into the dynamic string table used by the dynamic section and the
    version tables (library names, versions, run paths)."""
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
        elif section[1] == _SHT_GNU_VERDEF:
            found += _verdef_strings(_span(view, section))
    return found


# The two version tables as the walk below reads them: a chain of records,
# each (entry count, [its file name,] offset of its first entry, offset of the
# next record), and from each a chain of entries (name, offset of the next).
_VERNEED = (struct.Struct("<2xHIII"), struct.Struct("<8xII"))  # Elf64_Verneed, Elf64_Vernaux
_VERDEF = (struct.Struct("<6xH4xII"), struct.Struct("<II"))  # Elf64_Verdef, Elf64_Verdaux


def _verneed_strings(span: memoryview) -> list[int]:
    """The file and version names a library needs."""
    return _version_strings(span, *_VERNEED)


def _verdef_strings(span: memoryview) -> list[int]:
    """The names of the versions a library defines."""
    return _version_strings(span, *_VERDEF)


def _version_strings(span: memoryview, record: struct.Struct, entry_layout: struct.Struct) -> list[int]:
    found: list[int] = []
    cursor, budget = 0, 1 << 12
    while budget > 0 and cursor + record.size <= len(span):
        budget -= 1
        count, *own_name, aux, following = record.unpack_from(span, cursor)
        found += own_name
        entry = cursor + aux
        for _ in range(min(count, 1 << 12)):
            if entry + entry_layout.size > len(span):
                break
            name, step = entry_layout.unpack_from(span, entry)
            found.append(name)
            if not step:
                break
            entry += step
        if not following:
            break
        cursor += following
    return found


def _check_no_overlap(changes: list[tuple[int, bytes]], references: list[int], table: bytes) -> None:
    """Refuse where a name any other reference reads includes renamed bytes.
    A name read at `reference` runs to the next NUL, so it includes the bytes
    renamed at `start` exactly when it starts inside the string holding them,
    at or before their end: between that string's first byte and start + len.
    Those spans are merged, each is looked up by bisection among the sorted
    references, and the table is scanned once, so no table or name size makes
    this slow."""
    spans: list[list[int]] = []
    previous_start = previous_first = 0
    for start, new in sorted(changes):
        nul = table.rfind(b"\0", previous_start, start)  # only the bytes since the last change
        first = previous_first if nul < 0 else nul + 1
        previous_start, previous_first = start, first
        if spans and first <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], start + len(new))
        else:
            spans.append([first, start + len(new)])
    ordered = sorted(references)
    for first, end in spans:  # disjoint and in order: is any reference inside one?
        position = bisect.bisect_left(ordered, first)
        if position < len(ordered) and ordered[position] < end:
            raise _fail("a renamed import shares its name's bytes with another name, so it cannot be bound to another provider")
