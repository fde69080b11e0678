"""rename_imports against the dynamic table as the loader walks it.

The renaming (format/elf.py) reads a library through its section headers; the
loader reads the dynamic segment, stops at its first DT_NULL and keeps the
last value of each tag. A library where the two disagree could bind an import
the renaming never saw to whichever provider exports its original name. Here
a small library with aoti_torch_ and Sleef_ imports has its dynamic table
mutated thousands of times, and every copy the renaming accepts is read back
by a model of the loader written independently of elf.py: none of the imports
its relocations bind may keep an original prefix, and its NEEDED names must
be what they were.
"""

from __future__ import annotations

import random
import shutil
import struct
import subprocess

import pytest

from cuda_runner.errors import BundleError
from cuda_runner.format.elf import rename_imports

RENAMES = {"aoti_torch_": "cudarunner_", "Sleef_": "cr_sl_"}
DT_NULL, DT_NEEDED, DT_STRTAB, DT_SYMTAB, DT_RELA, DT_RELASZ, DT_STRSZ, DT_JMPREL, DT_PLTRELSZ, DT_VERSYM, DT_DEBUG = 0, 1, 5, 6, 7, 8, 10, 23, 2, 0x6FFFFFF0, 21
SOURCE = """
extern int aoti_torch_get_dim(void *, long *);
extern float Sleef_expf_u10(float);
int model_run(void *handle, long *dim) { return aoti_torch_get_dim(handle, dim) + (int) Sleef_expf_u10(1.0f); }
"""


def _build(folder, source: str) -> bytes:
    (folder / "model.c").write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(folder / "model.so"), str(folder / "model.c")], check=True)
    return (folder / "model.so").read_bytes()


def _dynstr(data: bytes) -> bytes:
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shnum, = struct.unpack_from("<H", data, 0x3C)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + 64 * index) for index in range(shnum)]
    dynsym = next(section for section in sections if section[1] == 11)
    strings = sections[dynsym[6]]
    return data[strings[4]:strings[4] + strings[5]]


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> bytes:
    """The library, holding in its read-only data a copy of its own dynamic
    string table (a static array: no new dynamic name): the table an attacker
    would point a second DT_STRTAB at, with the names as they were before renaming."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    folder = tmp_path_factory.mktemp("elf")
    names = _dynstr(_build(folder, SOURCE))
    decoy = "".join(f"\\x{byte:02x}" for byte in names)
    data = _build(folder, SOURCE + f'__attribute__((used)) static const char decoy[{len(names)}] = "{decoy}";\n')
    assert _dynstr(data) == names and data.count(names) == 2
    return data


class LoaderView:
    """What glibc's loader reads of a library: PT_LOAD maps, the PT_DYNAMIC table
    up to DT_NULL (the last value of a tag wins), and per relocation the name of
    its symbol, from DT_SYMTAB and DT_STRTAB. Raises ValueError where the loader
    would find nothing coherent (it would then refuse to load the library)."""

    def __init__(self, data: bytes):
        self.data = data
        phoff, = struct.unpack_from("<Q", data, 0x20)
        phnum, = struct.unpack_from("<H", data, 0x38)
        headers = [struct.unpack_from("<IIQQQQQQ", data, phoff + 56 * index) for index in range(phnum)]
        self.loads = [header for header in headers if header[0] == 1]
        (dynamic,) = [header for header in headers if header[0] == 2]
        self.tags: dict[int, int] = {}
        self.needed: list[int] = []
        cursor = dynamic[2]
        while True:
            tag, value = struct.unpack_from("<qQ", data, cursor)
            if tag == DT_NULL:
                break
            if tag == DT_NEEDED:
                self.needed.append(value)
            self.tags[tag] = value
            cursor += 16

    def offset(self, address: int) -> int:
        for _kind, _flags, offset, vaddr, _paddr, filesz, _memsz, _align in self.loads:
            if vaddr <= address < vaddr + filesz:
                return address - vaddr + offset
        raise ValueError("an address outside the loaded segments")

    def string(self, at: int) -> str:
        start = self.offset(self.tags[DT_STRTAB]) + at
        end = self.data.index(b"\0", start)
        return self.data[start:end].decode("latin-1")

    def bound_imports(self) -> set[str]:
        symbols = self.offset(self.tags[DT_SYMTAB])
        names = set()
        for table, size in ((DT_RELA, DT_RELASZ), (DT_JMPREL, DT_PLTRELSZ)):
            if table not in self.tags:
                continue
            start = self.offset(self.tags[table])
            for position in range(start, start + self.tags.get(size, 0), 24):
                _where, info, _addend = struct.unpack_from("<QQq", self.data, position)
                if info >> 32:
                    name, _, _, section, _, _ = struct.unpack_from("<IBBHQQ", self.data, symbols + 24 * (info >> 32))
                    if section == 0:
                        names.add(self.string(name))
        return names

    def needed_names(self) -> list[str]:
        return [self.string(value) for value in self.needed]


def dynamic_entries(data: bytes) -> tuple[int, int]:
    """(file offset, entry count) of the PT_DYNAMIC table."""
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phnum, = struct.unpack_from("<H", data, 0x38)
    for index in range(phnum):
        kind, _flags, offset, _vaddr, _paddr, filesz, _memsz, _align = struct.unpack_from("<IIQQQQQQ", data, phoff + 56 * index)
        if kind == 2:
            return offset, filesz // 16
    raise AssertionError("no dynamic segment")


def test_the_library_as_built_is_renamed_and_the_loader_binds_the_new_names(library):
    view = LoaderView(bytes(rename_imports(library, RENAMES)))
    assert {"cudarunner_get_dim", "cr_sl_expf_u10"} <= view.bound_imports()
    assert not any(name.startswith(tuple(RENAMES)) for name in view.bound_imports())


def test_a_second_string_table_entry_is_refused(library):
    """The case found: a second DT_STRTAB. The renaming read the first, the loader
    the last, so beside libtorch an import bound to it and the process crashed."""
    data = bytearray(library)
    start, count = dynamic_entries(library)
    entries = [struct.unpack_from("<qQ", data, start + 16 * index) for index in range(count)]
    spare = next(index for index, (tag, _) in enumerate(entries) if tag in (DT_DEBUG, DT_NULL) and index < count - 1)
    struct.pack_into("<qQ", data, start + 16 * spare, DT_STRTAB, _decoy_address(library))  # the names as they were
    with pytest.raises(BundleError, match="twice"):
        rename_imports(bytes(data), RENAMES)


def test_a_dynamic_table_without_its_end_is_refused(library):
    data = bytearray(library)
    start, count = dynamic_entries(library)
    for index in range(count):
        tag, value = struct.unpack_from("<qQ", data, start + 16 * index)
        if tag == DT_NULL:
            struct.pack_into("<qQ", data, start + 16 * index, 0x6FFFFEF5 if index == count - 1 else 0x7FFFFFFE - index, value)
    with pytest.raises(BundleError):
        rename_imports(bytes(data), RENAMES)


def _decoy_address(library: bytes) -> int:
    """The address of the copy of the dynamic string table (the second occurrence of its bytes)."""
    names = _dynstr(library)
    at = library.index(names, library.index(names) + 1)
    view = LoaderView(library)
    for _kind, _flags, offset, vaddr, _paddr, filesz, _memsz, _align in view.loads:
        if offset <= at < offset + filesz:
            return at - offset + vaddr
    raise AssertionError("the copy is not in a loaded segment")


def _mutations(library: bytes, rng: random.Random, count: int):
    start, entries = dynamic_entries(library)
    original = [struct.unpack_from("<qQ", library, start + 16 * index) for index in range(entries)]
    tags = [tag for tag, _ in original if tag] + [DT_NULL, DT_STRTAB, DT_SYMTAB, DT_STRSZ, DT_NEEDED, DT_RELA, DT_JMPREL, DT_VERSYM, 0x7FFFFFFF]
    values = [value for _, value in original] + [_decoy_address(library)] * 4
    for _ in range(count):
        data = bytearray(library)
        for _ in range(rng.choice((1, 1, 2, 3))):
            index = rng.randrange(entries)
            action = rng.randrange(5)
            if action == 4:  # an entry of its own: any tag with any value met
                struct.pack_into("<qQ", data, start + 16 * index, rng.choice(tags), rng.choice(values))
            elif action == 0:  # another tag, keeping the value
                struct.pack_into("<q", data, start + 16 * index, rng.choice(tags))
            elif action == 1:  # another entry's value, or one near it
                struct.pack_into("<Q", data, start + 16 * index + 8, max(0, rng.choice(values) + rng.choice((0, 0, 1, -1, 8, 16, 24))))
            elif action == 2:  # a copy of another entry: a tag given twice
                data[start + 16 * index:start + 16 * index + 16] = library[start + 16 * (other := rng.randrange(entries)):start + 16 * other + 16]
            else:  # two entries swapped
                other = rng.randrange(entries)
                first, second = bytes(data[start + 16 * index:start + 16 * index + 16]), bytes(data[start + 16 * other:start + 16 * other + 16])
                data[start + 16 * index:start + 16 * index + 16], data[start + 16 * other:start + 16 * other + 16] = second, first
        yield bytes(data)


def test_no_accepted_mutation_of_the_dynamic_table_lets_an_import_escape(library):
    accepted = refused = 0
    for mutated in _mutations(library, random.Random(20261202), 3000):
        try:
            renamed = bytes(rename_imports(mutated, RENAMES))
        except BundleError:
            refused += 1
            continue
        accepted += 1
        try:
            before, after = LoaderView(mutated), LoaderView(renamed)
            imports, needed, needed_before = after.bound_imports(), after.needed_names(), before.needed_names()
        except (ValueError, KeyError, struct.error):
            continue  # nothing the loader could load either
        escaped = sorted(name for name in imports if name.startswith(tuple(RENAMES)))
        assert escaped == [], f"the loader would bind {escaped} of a library the renaming accepted"
        assert needed == needed_before  # no library name changed
    assert accepted > 100 and refused > 100  # both kinds were met: the walk was exercised, not skipped
