"""The header of an .npy file, read by a parser of our own.

An .npy file starts with a magic string, a version, the header's length and
the header: the text of a Python dict literal with exactly the keys 'descr',
'fortran_order' and 'shape', padded with spaces and ended by a newline
(NumPy's format.py documents it). NumPy reads that text with its tokenizer and
`ast.literal_eval`, whose errors are many and varied (a dict that is never
closed ends in tokenize's TokenError, which nothing expects). This parser
reads the same grammar, narrowed to what a header can mean:

    header  := '{' space* entry (space* ',' space* entry)* space* [','] space* '}' space*
    entry   := key space* ':' space* value
    descr   := a string ('<f4', "bfloat16", u'<i8')
    fortran_order := True | False
    shape   := '(' space* ')' | '(' space* int space* ',' space* ')' | '(' int (',' int)+ [','] ')'
    int     := decimal digits without leading zeros (an 'L' suffix in version 1 and 2 headers,
               as Python 2 wrote them, is read as NumPy's reader reads it)

Everything else NumPy's reader would take (comments, adjacent strings, hex
or signed numbers, duplicate keys, a structured dtype given as a list) is
refused: no writer produces it. Every refusal is one `HeaderError` with the
reason, and everything this parser accepts NumPy reads the same way
(tests/io/test_npy_header.py checks both on a kept corpus of mutated headers).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"\x93NUMPY"
# NumPy refuses more dimensions than this (NPY_MAXDIMS in NumPy 2).
MAX_DIMS = 64
_SPACE = " \t\n\r\x0c"
_KEYS = ("descr", "fortran_order", "shape")
_MAX_DIGITS = 19  # a size of 2^63 has 19 digits; anything longer is no size


class HeaderError(ValueError):
    """The bytes are not an .npy header this runner reads."""


@dataclass(frozen=True)
class Header:
    version: tuple[int, int]
    descr: str
    fortran_order: bool
    shape: tuple[int, ...]
    data_offset: int  # bytes from the start of the file (or member) to the data


def read_prefix(prefix: bytes) -> tuple[tuple[int, int], int, int]:
    """(version, header length, offset of the header) from the first 12 bytes (fewer for version 1)."""
    if len(prefix) < 8 or prefix[:6] != MAGIC:
        raise HeaderError("it does not start with the .npy magic string")
    version = (prefix[6], prefix[7])
    if version == (1, 0):
        if len(prefix) < 10:
            raise HeaderError("it ends inside its header length")
        return version, struct.unpack_from("<H", prefix, 8)[0], 10
    if version in ((2, 0), (3, 0)):
        if len(prefix) < 12:
            raise HeaderError("it ends inside its header length")
        return version, struct.unpack_from("<I", prefix, 8)[0], 12
    raise HeaderError(f"unsupported .npy version {version[0]}.{version[1]}")


def parse_header(version: tuple[int, int], raw: bytes, data_offset: int) -> Header:
    """The header's dict, from its bytes (latin-1 in versions 1 and 2, UTF-8 in 3)."""
    try:
        text = raw.decode("utf-8" if version == (3, 0) else "latin-1")
    except UnicodeDecodeError:
        raise HeaderError("its header is not valid UTF-8") from None
    fields = _Parser(text, python2_longs=version != (3, 0)).header()
    return Header(version, fields["descr"], fields["fortran_order"], fields["shape"], data_offset)


class _Parser:
    def __init__(self, text: str, python2_longs: bool):
        self.text = text
        self.at = 0
        self.python2_longs = python2_longs

    def header(self) -> dict:
        if not self.take("{"):  # Python refuses an indented literal too
            raise HeaderError("its header is not a dict literal")
        fields: dict = {}
        while True:
            self.skip_space()
            if self.take("}"):
                break
            if fields and not self.take(","):
                raise self.unexpected("',' or '}'")
            self.skip_space()
            if fields and self.take("}"):
                break
            key = self.string()
            if key not in _KEYS:
                raise HeaderError(f"its header has the unknown key {key[:40]!r}")
            if key in fields:
                raise HeaderError(f"its header gives {key!r} twice")
            self.skip_space()
            if not self.take(":"):
                raise self.unexpected("':'")
            self.skip_space()
            fields[key] = self.value(key)
        self.skip_space()
        if self.at != len(self.text):
            raise self.unexpected("the end of the header")
        missing = [key for key in _KEYS if key not in fields]
        if missing:
            raise HeaderError(f"its header lacks {', '.join(repr(key) for key in missing)}")
        return fields

    def value(self, key: str) -> object:
        if key == "descr":
            if self.peek() == "[":
                raise HeaderError("it holds a structured array (a list of fields), which is no model input")
            return self.string()
        if key == "fortran_order":
            for word, meaning in (("True", True), ("False", False)):
                if self.text.startswith(word, self.at) and not self.text[self.at + len(word):self.at + len(word) + 1].isidentifier():
                    self.at += len(word)
                    return meaning
            raise self.unexpected("True or False")
        return self.shape()

    def shape(self) -> tuple[int, ...]:
        if not self.take("("):
            raise self.unexpected("a tuple of sizes")
        sizes: list[int] = []
        commas = 0
        while True:
            self.skip_space()
            if self.take(")"):
                break
            if sizes and not self.take(","):
                raise self.unexpected("',' or ')'")
            if sizes:
                commas += 1
                self.skip_space()
                if self.take(")"):
                    break
            sizes.append(self.size())
            if len(sizes) > MAX_DIMS:
                raise HeaderError(f"its shape has more than {MAX_DIMS} dimensions")
        if len(sizes) == 1 and commas == 0:
            raise HeaderError("its shape is a number in parentheses, not a tuple")
        return tuple(sizes)

    def size(self) -> int:
        start = self.at
        while self.at < len(self.text) and self.text[self.at] in "0123456789":
            self.at += 1
        digits = self.text[start:self.at]
        if not digits:
            if self.peek() == "-":
                raise HeaderError("its shape has a negative size")
            raise self.unexpected("a size")
        if len(digits) > 1 and digits[0] == "0":
            raise HeaderError(f"its shape has the size {digits[:20]!r} with a leading zero")
        if len(digits) > _MAX_DIGITS:
            raise HeaderError("its shape has a size too large for any array")
        if self.python2_longs and self.peek() == "L":
            self.at += 1
        following = self.peek()
        if following and (following.isidentifier() or following in "._"):
            raise self.unexpected("a decimal size")
        return int(digits)

    def string(self) -> str:
        if self.peek() in ("u", "U") and self.text[self.at + 1:self.at + 2] in ("'", '"'):
            self.at += 1
        quote = self.peek()
        if quote not in ("'", '"'):
            raise self.unexpected("a quoted string")
        end = self.text.find(quote, self.at + 1)
        if end < 0:
            raise HeaderError("its header has a string that is never closed")
        value = self.text[self.at + 1:end]
        if any(character < " " for character in value):
            raise HeaderError("its header has a string with a control character")
        if "\\" in value:
            raise HeaderError("its header has a string with a backslash escape, which no dtype name needs")
        if self.text[self.at + 1:self.at + 3] == quote * 2 or self.text[end + 1:end + 2] == quote:
            raise HeaderError("its header has a triple-quoted string")
        self.at = end + 1
        return value

    def skip_space(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in _SPACE:
            self.at += 1

    def take(self, token: str) -> bool:
        if self.text.startswith(token, self.at):
            self.at += len(token)
            return True
        return False

    def peek(self) -> str:
        return self.text[self.at:self.at + 1]

    def unexpected(self, wanted: str) -> HeaderError:
        found = self.text[self.at:self.at + 12]
        return HeaderError(f"its header has {found!r} at character {self.at} where {wanted} belongs" if found else
                           f"its header ends where {wanted} belongs")
