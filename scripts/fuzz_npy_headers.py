#!/usr/bin/env python3
"""Fuzz cuda-runner's .npy header parser against NumPy's own reader.

Headers NumPy writes (every dtype the runner knows, shapes from 0-d to 64-d,
C and Fortran order, format versions 1, 2 and 3) are mutated: characters
deleted, inserted (from an alphabet of the characters a header's grammar
turns on), replaced and repeated, headers cut short, declared lengths and
versions changed; a list of hand-written cases (an unclosed dict, comments,
adjacent strings, duplicate keys, structured and sub-array dtypes, Python 2
longs) is added. Each header is read by both parsers, and the rule is:

- what cuda-runner's parser accepts, NumPy reads the same way (dtype, shape, order);
- what NumPy refuses, cuda-runner's parser refuses with one HeaderError or InputError.

(cuda-runner may refuse what NumPy reads: comments, hex sizes and the like,
which no writer produces.) A violation is printed and the exit status is 1.
`--write FILE` keeps the corpus, as tests/data/npy-headers.json is kept.

    python scripts/fuzz_npy_headers.py --count 20000 --seed 1
"""

from __future__ import annotations

import argparse
import base64
import gzip
import io
import json
import random
import re
import struct
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuda_runner.errors import InputError
from cuda_runner.io.npy import ArrayHeader, _parse_header

ALPHABET = "{}()[],:'\"\\ \n\t#LluUbr0123456789-+.xe_TrueFalsN\x00\x7f\xe9"
DTYPES = ["<f4", "<f8", "<f2", "|u1", "|i1", "<i2", "<i4", "<i8", "|b1", "|V2", "bfloat16", ">f4", "<c8", "<U3", "|O", "<M8[ns]"]


def written_header(dtype: str, shape: tuple[int, ...], fortran: bool, version: tuple[int, int]) -> bytes:
    """A header as NumPy's writer makes it (the bfloat16 descr as cuda-runner writes it)."""
    return frame(_header_text(dtype, shape, fortran), version)


def _header_text(dtype: str, shape: tuple[int, ...], fortran: bool) -> str:
    return f"{{'descr': {dtype!r}, 'fortran_order': {fortran!r}, 'shape': {shape!r}, }}"


def frame(text: str, version: tuple[int, int], length_delta: int = 0) -> bytes:
    """Magic, version, length and the header padded to a multiple of 64, as NumPy lays it out."""
    body = text.encode("utf-8" if version == (3, 0) else "latin-1", "replace")
    prefix_size = 10 if version == (1, 0) else 12
    padding = (-(prefix_size + len(body) + 1)) % 64
    body = body + b" " * padding + b"\n"
    length = struct.pack("<H" if version == (1, 0) else "<I", max(0, len(body) + length_delta) % (1 << (16 if version == (1, 0) else 32)))
    return b"\x93NUMPY" + bytes(version) + length + body


HAND_WRITTEN = [
    "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 16), ",  # the dict is never closed (tokenize's TokenError)
    "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 16), } # a comment",
    "{'descr': '<' 'f4', 'fortran_order': False, 'shape': (2,), }",
    "{'descr': '<f4', 'descr': '<i4', 'fortran_order': False, 'shape': (2,), }",
    "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }",
    "{'descr': '(2,3)<f4', 'fortran_order': False, 'shape': (2,), }",
    "{'descr': 'i4,f4', 'fortran_order': False, 'shape': (2,), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (2l, 3), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (True, 3), }",
    "{'descr': '<f4', 'fortran_order': 0, 'shape': (3,), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (-3,), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (0x10,), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (1_000,), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (07,), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': [3], }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': ((3,),), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (" + ", ".join(["1"] * 65) + "), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (" + "9" * 40 + ",), }",
    " {'descr': '<f4', 'fortran_order': False, 'shape': (3,), }",
    "\n{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }",
    "{'descr': u'<f4', 'fortran_order': False, 'shape': (3,), }",
    "{'descr': b'<f4', 'fortran_order': False, 'shape': (3,), }",
    "{'descr': r'<f4', 'fortran_order': False, 'shape': (3,), }",
    "{'descr': '''<f4''', 'fortran_order': False, 'shape': (3,), }",
    "{'descr': '<f\\x34', 'fortran_order': False, 'shape': (3,), }",
    "{\"descr\": \"<f4\", \"fortran_order\": false, \"shape\": [3]}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'extra': 1}",
    "{'descr': '<f4', 'fortran_order': False}",
    "{'descr': '<f4' 'fortran_order': False, 'shape': (3,)}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3,),,}",
    "{,'descr': '<f4', 'fortran_order': False, 'shape': (3,)}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3,)} {}",
    "{'descr': '<f4', 'fortran_order': (False), 'shape': (3,)}",
    "{'descr': ('<f4'), 'fortran_order': False, 'shape': (3,)}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': ( 3 , 4 , )}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (,)}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': ()}",
    "{'descr': '<f4',\n 'fortran_order': False,\n 'shape': (3,)}",
    "{'descr': '\x00', 'fortran_order': False, 'shape': (3,)}",
    "{'descr': 'O', 'fortran_order': False, 'shape': (3,)}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3,)}\x00",
    "[1, 2, 3]",
    "",
    "{" * 200,
    "(" * 200,
]


def _numpy_header_reader():
    """NumPy's reader for every version (NumPy 2 keeps it in numpy.lib._format_impl, 1.x in numpy.lib.format)."""
    try:
        from numpy.lib import _format_impl as implementation  # type: ignore[attr-defined]
    except ImportError:
        implementation = np.lib.format
    return implementation._read_array_header


def numpy_reads(data: bytes) -> tuple[np.dtype, tuple[int, ...], bool] | BaseException:
    handle = io.BytesIO(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Python 2 headers are read with a warning
            version = np.lib.format.read_magic(handle)
            shape, fortran, dtype = _numpy_header_reader()(handle, version, max_header_size=1 << 20)
    except BaseException as error:  # any refusal counts, whatever its kind
        return error
    return np.dtype(dtype), tuple(shape), bool(fortran)


def ours_reads(data: bytes) -> ArrayHeader | InputError:
    try:
        return _parse_header(io.BytesIO(data), "fuzzed")
    except InputError as error:
        return error


def violation(data: bytes) -> str | None:
    """Why the two readers disagree in a way the rule forbids, or None."""
    theirs = numpy_reads(data)
    try:
        ours = ours_reads(data)
    except BaseException as error:
        return f"cuda-runner's parser raised {type(error).__name__}: {error}"
    if isinstance(ours, InputError):
        return None  # refusing is always allowed
    if isinstance(theirs, BaseException):
        return f"cuda-runner accepted what NumPy refuses ({type(theirs).__name__}: {theirs})"
    dtype, shape, fortran = theirs
    if dtype.name == "void16" and ours.dtype.name == "bfloat16":  # a bare 2-byte void: read as bfloat16 on purpose
        dtype = ours.dtype
    if (ours.dtype, ours.shape, ours.fortran_order) != (dtype, shape, fortran):
        return f"cuda-runner read {(ours.dtype, ours.shape, ours.fortran_order)}, NumPy {(dtype, shape, fortran)}"
    return None


def mutate(text: str, rng: random.Random) -> str:
    characters = list(text)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        position = rng.randrange(len(characters) + 1)
        action = rng.randrange(5)
        if action == 0 and characters and position < len(characters):
            del characters[position]
        elif action == 1:
            characters.insert(position, rng.choice(ALPHABET))
        elif action == 2 and characters and position < len(characters):
            characters[position] = rng.choice(ALPHABET)
        elif action == 3:
            end = min(len(characters), position + rng.randrange(1, 8))
            characters[position:position] = characters[position:end]
        else:
            characters = characters[:position]
    return "".join(characters)


def corpus(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    entries = [frame(text, version) for text in HAND_WRITTEN for version in ((1, 0), (3, 0))]
    valid = []
    for dtype in DTYPES:
        for shape in ((), (3,), (2, 16), (0, 5), (1,) * 64, (2**40, 1)):
            for fortran in (False, True):
                for version in ((1, 0), (2, 0), (3, 0)):
                    valid.append((dtype, shape, fortran, version))
    entries += [written_header(*case) for case in valid]
    while len(entries) < count:
        dtype, shape, fortran, version = rng.choice(valid)
        text = _header_text(dtype, shape, fortran)
        kind = rng.randrange(10)
        if kind == 0:  # the frame itself: a wrong length, version or magic
            data = bytearray(frame(text, version, rng.choice((-64, -1, 1, 64, 1 << 20))))
            if rng.random() < 0.3:
                data[rng.randrange(8)] = rng.randrange(256)
            entries.append(bytes(data))
        elif kind == 1:  # cut short
            data = frame(text, version)
            entries.append(data[:rng.randrange(len(data))])
        else:
            entries.append(frame(mutate(text, rng), version))
    return entries


def keepers(entries: list[bytes]) -> list[bytes]:
    """The headers worth keeping: all that NumPy reads (the ones the rule is
    about), and for each kind of refusal (its message with names and numbers
    taken out) the first five."""
    kept, kinds = [], {}
    for data in entries:
        ours = ours_reads(data)
        if not isinstance(numpy_reads(data), BaseException) or not isinstance(ours, InputError):
            kept.append(data)
            continue
        kind = re.sub(r"'[^']*'|\"[^\"]*\"|\d+", "_", str(ours))
        if kinds.setdefault(kind, 0) < 5:
            kinds[kind] += 1
            kept.append(data)
    return kept


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--write", type=Path, help="keep the corpus: every header NumPy reads and one of each way cuda-runner refuses (gzipped JSON)")
    args = parser.parse_args()
    entries = corpus(args.count, args.seed)
    failures = [(data, why) for data in entries if (why := violation(data)) is not None]
    accepted = sum(1 for data in entries if not isinstance(ours_reads(data), InputError))
    for data, why in failures[:20]:
        print(f"VIOLATION {data[:120]!r}: {why}")
    print(f"{len(entries)} headers: {accepted} accepted by both, {len(entries) - accepted} refused by cuda-runner, {len(failures)} violations")
    if args.write:
        kept = keepers(entries)
        args.write.write_bytes(gzip.compress(json.dumps([base64.b64encode(data).decode() for data in kept]).encode(), mtime=0))
        print(f"kept {len(kept)} headers in {args.write}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
