"""The one exception hierarchy of cuda-runner.

Every error a user can cause is a kind with one documented exit code, so that
a CI script can tell "wrong numbers" from "broken bundle" from "no GPU", and a
test can assert on the kind rather than on English text.

The library never names command-line flags. An error about a value the user
chose carries a `subject` (for example "shape" for the size of a dynamic
dimension); the command line maps subjects to its own flags.
"""

from __future__ import annotations

import enum
import errno
import os


class ExitCode(enum.IntEnum):
    OK = 0
    VERIFICATION_FAILED = 1
    USAGE = 2
    BAD_BUNDLE = 3
    RUNTIME = 4
    PERFORMANCE = 5


class CudaRunnerError(Exception):
    """Base class. `exit_code` is what the CLI exits with."""

    exit_code: ExitCode = ExitCode.RUNTIME

    def __init__(self, message: str, *, subject: str | None = None):
        super().__init__(message)
        # What the user should change, in the library's words: "shape",
        # "range", "method", "device", "cast", "samples", "tolerance", ...
        self.subject = subject


class InputError(CudaRunnerError):
    """Bad arguments or input data: wrong count, name, dtype or shape."""

    exit_code = ExitCode.USAGE


class BundleError(CudaRunnerError):
    """The bundle is damaged, tampered with, lies about its library, or is not a bundle at all."""

    exit_code = ExitCode.BAD_BUNDLE


class IncompatibleBundleError(BundleError):
    """The bundle is valid but cannot run here (device, CPU ISA, torch)."""


class DeviceError(CudaRunnerError):
    """No usable device, or the device failed."""

    exit_code = ExitCode.RUNTIME


class ModelRuntimeError(CudaRunnerError):
    """The model library failed to load, create or run."""

    exit_code = ExitCode.RUNTIME


class CompileError(CudaRunnerError):
    """The ahead-of-time compile could not be done."""

    exit_code = ExitCode.RUNTIME


class WriteError(CudaRunnerError):
    """An output or bundle file could not be written (disk full, permissions)."""

    exit_code = ExitCode.RUNTIME


class ClosedError(CudaRunnerError):
    """A method or model was used after it was closed."""

    exit_code = ExitCode.USAGE


class Interrupted(BaseException):
    """A signal the user sent (SIGINT, SIGTERM, SIGHUP): unwind, clean up, exit 128+N.

    A BaseException, like KeyboardInterrupt, so that no `except Exception`
    swallows it, and every `finally` on the way out runs."""

    def __init__(self, signal_number: int):
        super().__init__(f"interrupted by signal {signal_number}")
        self.signal_number = signal_number


# What an error says when the process ran out of file descriptors: not the
# file's fault, nor a bug, but a limit the user sets.
TOO_MANY_FILES = "too many open files in this process (raise the limit: ulimit -n)"
_TOO_MANY_FILES_TEXT = os.strerror(errno.EMFILE)  # "Too many open files", as dlopen and libraries word it


def too_many_open_files(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from or while handling, is
    the process running out of file descriptors (EMFILE, ENFILE)."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE):
            return True
        if _TOO_MANY_FILES_TEXT in str(error):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def os_error(error: OSError, message: str, kind: type[CudaRunnerError]) -> CudaRunnerError:
    """The error to raise for an OSError: `kind(message: reason)`, except that
    running out of file descriptors is the one line that names ulimit -n."""
    if too_many_open_files(error):
        return DeviceError(f"{message}: {TOO_MANY_FILES}")
    return kind(f"{message}: {error.strerror or error}")
