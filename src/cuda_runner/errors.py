"""The one exception hierarchy of cuda-runner.

Every error a user can cause maps to one documented exit code, so that a CI
script can tell "wrong numbers" from "broken bundle" from "no GPU".
"""

from __future__ import annotations

import enum


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


class InputError(CudaRunnerError):
    """Bad arguments or input data: wrong count, name, dtype or shape."""

    exit_code = ExitCode.USAGE


class BundleError(CudaRunnerError):
    """The bundle is damaged, tampered with, or not a bundle at all."""

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
