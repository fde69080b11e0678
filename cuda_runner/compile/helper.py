"""Build the call helper (cuda_runner/native/call_helper.c) with the system C compiler.

It is built where bundles are compiled, which needs a C++ compiler anyway
(AOTInductor's), and stored in the bundle beside the model libraries. Without
a C compiler the bundle is written without it and runs through ctypes alone.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "native" / "call_helper.c"
SEGMENT_NAME = "call_helper_so"
# No -march=native: the helper must load on any machine of the same
# architecture that can run the bundle's CPU-independent parts.
_FLAGS = ("-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-std=c11")
_TIMEOUT_S = 120


@dataclass(frozen=True)
class BuiltHelper:
    library: bytes | None
    note: str  # how it was built, or why it was not


def _compiler() -> str | None:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate:
            found = shutil.which(candidate)
            if found:
                return found
    return None


@functools.cache
def build_call_helper() -> BuiltHelper:
    """The helper's bytes, built once per process; None, with the reason, where no compiler can build it."""
    compiler = _compiler()
    if compiler is None:
        return BuiltHelper(None, "no C compiler found (set CC); the bundle runs without the call helper")
    with tempfile.TemporaryDirectory(prefix="cuda-runner-helper-") as directory:
        output = Path(directory) / "call_helper.so"
        command = [compiler, *_FLAGS, "-o", str(output), str(SOURCE)]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            return BuiltHelper(None, f"the C compiler failed to build the call helper: {error}")
        if result.returncode != 0:
            first = (result.stderr.strip().splitlines() or ["no message"])[0]
            return BuiltHelper(None, f"the C compiler failed to build the call helper: {first}")
        return BuiltHelper(output.read_bytes(), f"built with {Path(compiler).name}")
