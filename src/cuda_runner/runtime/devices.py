"""Devices: parsing 'cpu' / 'cuda:N', finding what this machine has, and
deciding whether a method's library can run here."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import CudaRunnerError, DeviceError, IncompatibleBundleError, InputError
from ..format.manifest import MethodSpec

_ISA_FLAG_PATTERN = re.compile(r"^(sse\d\w*|ssse3|avx\w*|fma\w*|f16c|bmi\d|amx\w*|popcnt|movbe|lzcnt|abm|adx|sha_ni|vaes|vpclmulqdq|gfni)$")


@dataclass(frozen=True)
class Device:
    type: str  # "cpu" | "cuda"
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.type == "cpu" else f"cuda:{self.index}"


def parse_device(text: str) -> Device:
    match = re.fullmatch(r"(cpu)|cuda(?::(\d+))?", text.strip())
    if not match:
        raise InputError(f"unknown device {text!r}; use 'cpu', 'cuda' or 'cuda:N'")
    if match.group(1):
        return Device("cpu")
    return Device("cuda", int(match.group(2) or 0))


def cpu_isa_flags() -> frozenset[str]:
    """ISA extension flags of this CPU (/proc/cpuinfo) that -march=native code may use."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(flag for flag in line.partition(":")[2].split() if _ISA_FLAG_PATTERN.match(flag))
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    """CUDA devices visible through CuPy; 0 when CuPy or a driver is missing."""
    try:
        import cupy
    except Exception:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def compute_capability(index: int) -> str:
    import cupy

    digits = cupy.cuda.Device(index).compute_capability  # e.g. "90"
    return f"{digits[:-1]}.{digits[-1]}"


def available_devices() -> list[Device]:
    return [Device("cpu"), *(Device("cuda", index) for index in range(cuda_device_count()))]


def incompatibility(method: MethodSpec, device: Device) -> CudaRunnerError | None:
    """Why `method` cannot run on `device` here (an error to raise), or None if it can."""
    built = method.device
    if built.type != device.type:
        return IncompatibleBundleError(f"method {method.name!r} was compiled for {built.type}, not {device.type}")
    if device.type == "cpu":
        missing = sorted(set(built.cpu_flags) - cpu_isa_flags())
        if missing:
            return IncompatibleBundleError(f"method {method.name!r} was compiled for a CPU with {', '.join(missing)}, which this CPU lacks")
        return None
    count = cuda_device_count()
    if count == 0:
        return DeviceError("no CUDA device is available (CuPy is not installed, or no GPU or driver was found)")
    if device.index >= count:
        return DeviceError(f"{device} does not exist: this machine has {count} CUDA device(s)")
    if built.compute_capability:
        return _capability_problem(method.name, built.compute_capability, compute_capability(device.index))
    return None


def _capability_problem(method: str, built: str, here: str) -> CudaRunnerError | None:
    built_major, built_minor = (int(part) for part in built.split("."))
    here_major, here_minor = (int(part) for part in here.split("."))
    if here_major != built_major or here_minor < built_minor:
        return IncompatibleBundleError(f"method {method!r} was compiled for compute capability {built}; this GPU has {here}")
    return None


def choose_device(methods: Iterable[MethodSpec], requested: str | None) -> Device:
    """The requested device, or the bundle's own device if this machine has it."""
    methods = list(methods)
    if requested is not None:
        device = parse_device(requested)
    else:
        kinds = {method.device.type for method in methods}
        if len(kinds) != 1:
            raise InputError("the bundle's methods target different devices; choose one with --device")
        device = Device(kinds.pop())
    for method in methods:
        problem = incompatibility(method, device)
        if problem:
            raise problem
    return device
