"""Rules for names that come from bundles and reach terminals or file systems."""

from __future__ import annotations

import re
import unicodedata

MAX_NAME_LENGTH = 128

_FORBIDDEN_IN_NAMES = re.compile(r"[/\\\x00-\x1f\x7f-\x9f]")
_UNSAFE_FILENAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def name_problem(name: object) -> str | None:
    """Why `name` is not acceptable as a method, segment, tensor or dim name."""
    if not isinstance(name, str):
        return "is not a string"
    if not name:
        return "is empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"is longer than {MAX_NAME_LENGTH} characters"
    if _FORBIDDEN_IN_NAMES.search(name):
        return "contains a path separator or control character"
    if name in (".", ".."):
        return "is a relative path component"
    return None


def safe_filename(name: str) -> str:
    """A file-system-safe stem for an output name ('aux.loss' stays as it is).

    Anything outside [A-Za-z0-9._-] becomes '_', a leading dot is replaced so
    no hidden or relative names appear, and the length is bounded.
    """
    stem = _UNSAFE_FILENAME_CHARS.sub("_", unicodedata.normalize("NFKC", name))
    if not stem or stem.startswith("."):
        stem = "_" + stem
    return stem[:MAX_NAME_LENGTH]


def printable(text: object) -> str:
    """Escape control characters so file-derived text cannot drive the terminal.

    Rich markup is handled separately: callers render with rich.text.Text,
    which never interprets markup.
    """
    out = []
    for char in str(text):
        if unicodedata.category(char) in ("Cc", "Cf", "Cs", "Co", "Cn") or char in "\u2028\u2029":
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(char)
    return "".join(out)
