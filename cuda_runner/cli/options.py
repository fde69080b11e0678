"""Turning command-line strings into the library's typed values.

Every function here takes what the user typed and returns a typed value, or
raises UsageError naming the flag. The library never sees a flag or an
unparsed string; cross-option rules live here too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InputError

if TYPE_CHECKING:  # NumPy loads with the commands that need it, not with --help
    from ..io.inputs import InputEntry
    from ..verify.compare import Tolerances


class UsageError(InputError):
    """A flag's value cannot be parsed, or flags that exclude each other were given."""


# Input names users type: identifiers with dots (the manifest allows more;
# such inputs are given by position or in an .npz).
_INPUT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_MAX_DIM = (1 << 63) - 1


def input_entry(text: str) -> InputEntry:
    """One --inputs value:

        PATH.npy            by position          NAME=PATH.npy    by name
        @PATH.npy           IREE's spelling      NAME=@PATH
        PATH.npz            keyed by input names
        NAME=0.5, NAME=[1,2,3], [NAME=]2x3xf32=1 2 3 4 5 6   inline values
    """
    from ..io.inputs import IREE_LITERAL, InlineValue

    name, value = _split_name(text)
    if value.startswith("@"):
        return _file_entry(name, value[1:], text)
    if name is None and IREE_LITERAL.match(value):
        return InlineValue(value)
    if name is not None and _looks_inline(value):
        return InlineValue(value, name)
    return _file_entry(name, value, text)


def _file_entry(name: str | None, value: str, text: str) -> InputEntry:
    from ..io.inputs import ArchiveFile, ArrayFile

    path = Path(value)
    if path.suffix == ".npz":
        if name is not None:
            raise UsageError(f"--inputs {text!r}: an .npz archive supplies inputs by its keys; give it without NAME=")
        return ArchiveFile(path)
    return ArrayFile(path, name)


def _split_name(text: str) -> tuple[str | None, str]:
    """'x=a.npy' -> ('x', 'a.npy'); 'a.npy' -> (None, 'a.npy'). A path with '=' needs a NAME= or '@'."""
    if text.startswith("@"):
        return None, text
    name, sep, value = text.partition("=")
    if sep and _INPUT_NAME.match(name):
        return name, value
    return None, text


def _looks_inline(value: str) -> bool:
    from ..io.inputs import IREE_LITERAL

    if IREE_LITERAL.match(value):
        return True
    stripped = value.strip()
    if stripped.startswith("["):
        return True
    try:
        float(stripped)
        return True
    except ValueError:
        return stripped.lower() in ("true", "false")


def shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """--shape NAME=4x128 (a scalar is NAME=)."""
    result = {}
    for text in items:
        name, sep, value = text.partition("=")
        if not sep or not name:
            raise UsageError(f"--shape {text!r}: expected NAME=DIMS, e.g. x=4x128")
        if value and not re.fullmatch(r"\d+(x\d+)*", value):
            raise UsageError(f"--shape {text!r}: sizes must be non-negative integers separated by 'x'")
        sizes = tuple(int(size) for size in value.split("x")) if value else ()
        if any(size > _MAX_DIM for size in sizes):
            raise UsageError(f"--shape {text!r}: a size is larger than 2^63 - 1")
        result[name] = sizes
    return result


def ranges(items: Sequence[str]) -> dict[str, tuple[float, float]]:
    """--range NAME=LO:HI, finite, LO < HI (integers: HI exclusive)."""
    result = {}
    for text in items:
        name, sep, value = text.partition("=")
        low, colon, high = value.partition(":")
        try:
            bounds = (float(low), float(high))
        except ValueError:
            bounds = None
        if (not sep or not name or not colon or bounds is None or not math.isfinite(bounds[1] - bounds[0])
                or not bounds[0] < bounds[1]):
            raise UsageError(f"--range {text!r}: expected NAME=LO:HI with finite LO < HI, e.g. ids=0:30522")
        result[name] = bounds
    return result


def key_values(items: Sequence[str], option: str) -> dict[str, str]:
    result = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{option} {item!r}: expected KEY=VALUE")
        result[key] = value
    return result


def option_values(items: Sequence[str], autotune: bool, quick: bool = False) -> dict[str, object]:
    """--option KEY=VALUE values typed as written (true/false, numbers, JSON
    lists and objects, else text), on top of the --autotune or --quick preset."""
    import json

    from ..compile.aot import AUTOTUNE_OPTIONS, QUICK_OPTIONS

    values: dict[str, object] = dict(AUTOTUNE_OPTIONS) if autotune else dict(QUICK_OPTIONS) if quick else {}
    for key, text in key_values(items, "--option").items():
        lowered = text.strip().lower()
        if lowered in ("true", "false"):
            values[key] = lowered == "true"
            continue
        try:
            values[key] = json.loads(text) if text.strip()[:1] in "[{-0123456789" else text
        except ValueError:
            values[key] = text
    return values


def tolerances(atol: Sequence[str], rtol: Sequence[str], exact: bool = False) -> Tolerances:
    """--atol 1e-3 (every output) or --atol logits=1e-3 (one output)."""
    from ..verify.compare import Tolerances

    return Tolerances(_tolerance_values(atol, "--atol"), _tolerance_values(rtol, "--rtol"), exact)


def _tolerance_values(items: Sequence[str], option: str) -> dict[str, float]:
    values = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"{option} {item!r}: expected a number or NAME=NUMBER") from None
        if not (number >= 0 and math.isfinite(number)):
            raise UsageError(f"{option} {item!r}: a tolerance must be a finite number, zero or more")
        values[name if sep else ""] = number
    return values


def positive(value: float | None, option: str, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{option} {value:g}: expected a finite number {'>= 0' if allow_zero else '> 0'}")


def exclusive(**given: object) -> None:
    """At most one of these options may be given (truthy)."""
    named = [f"--{name.replace('_', '-')}" for name, value in given.items() if value]
    if len(named) > 1:
        raise UsageError(f"{' and '.join(named)} cannot be used together")


# What the user can change, by the library's error subject.
SUBJECT_HINTS = {
    "shape": "give sizes with --shape NAME=DIMS",
    "range": "see --range",
    "method": "choose one with --method",
    "inputs": "give them with --inputs NAME=FILE.npy, or generate them with --random-inputs",
    "device": "choose with --device",
    "cast": "--cast allows a conversion that keeps every value",
    "samples": "compile with --sample-inputs to store samples",
    "tolerance": "see --atol/--rtol",
    "cuda_graph": "run without --cuda-graph",
    "trusted_key": "see --trusted-key",
    "data": "give it with --data FILE.ptd",
    "option": "see --option",
    "batch_size": "run without --batch-size",
    "position": "name it with --position",
    "prompt_length": "see --prompt-length",
}
