"""Devices: parsing 'cpu' / 'cuda:N', finding what this machine has, and
deciding whether a method's library can run here."""

from __future__ import annotations

import ctypes
import functools
import platform
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    match = re.fullmatch(r"(cpu)|cuda(?::(\d{1,4}))?", text.strip())
    if not match:
        raise InputError(f"unknown device {text!r}; use 'cpu', 'cuda' or 'cuda:N'", subject="device")
    if match.group(1):
        return Device("cpu")
    return Device("cuda", int(match.group(2) or 0))


def parse_devices(text: str | Sequence[int | str]) -> list[Device]:
    """"all" (every CUDA device), "0,1", or a list of indexes or device names."""
    if isinstance(text, str):
        if text.strip() == "all":
            count = cuda_device_count()
            if count == 0:
                raise InputError("no CUDA device is available for 'all'", subject="device")
            return [Device("cuda", index) for index in range(count)]
        items: Sequence[int | str] = [item for item in text.split(",") if item.strip()]
    else:
        items = text
    devices = [Device("cuda", int(item)) if isinstance(item, int) or str(item).strip().isdigit() else parse_device(str(item)) for item in items]
    if not devices or len(set(devices)) != len(devices):
        raise InputError(f"give distinct devices, e.g. 'all' or '0,1' (got {text!r})", subject="device")
    return devices


def checked_isa_flags(flags: Iterable[str]) -> frozenset[str]:
    """The ISA extension flags among `flags` (/proc/cpuinfo names) that a CPU bundle can require."""
    return frozenset(flag for flag in flags if _ISA_FLAG_PATTERN.match(flag))


def cpu_isa_flags() -> frozenset[str]:
    """ISA extension flags of this CPU (/proc/cpuinfo) that a CPU bundle can require."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return checked_isa_flags(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


class _Driver:
    """The CUDA driver API through ctypes: enough to count devices and read
    their compute capability without importing CuPy or torch."""

    _CAPABILITY_MAJOR = 75  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    _CAPABILITY_MINOR = 76

    def __init__(self) -> None:
        self.library = ctypes.CDLL("libcuda.so.1")
        if self.library.cuInit(0) != 0:
            raise OSError("cuInit failed")

    def count(self) -> int:
        value = ctypes.c_int()
        return value.value if self.library.cuDeviceGetCount(ctypes.byref(value)) == 0 else 0

    def _device(self, index: int) -> ctypes.c_int:
        device = ctypes.c_int()
        if self.library.cuDeviceGet(ctypes.byref(device), index) != 0:
            raise DeviceError(f"cannot open CUDA device {index}")
        return device

    def capability(self, index: int) -> str:
        device = self._device(index)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.library.cuDeviceGetAttribute(ctypes.byref(major), self._CAPABILITY_MAJOR, device)
        self.library.cuDeviceGetAttribute(ctypes.byref(minor), self._CAPABILITY_MINOR, device)
        return f"{major.value}.{minor.value}"

    def name(self, index: int) -> str:
        buffer = ctypes.create_string_buffer(256)
        self.library.cuDeviceGetName(buffer, len(buffer), self._device(index))
        return buffer.value.decode("utf-8", "replace")

    def total_memory(self, index: int) -> int:
        size = ctypes.c_size_t()
        self.library.cuDeviceTotalMem_v2(ctypes.byref(size), self._device(index))
        return size.value

    def version(self) -> str:
        """The CUDA version the driver supports, e.g. '13.0'."""
        value = ctypes.c_int()
        self.library.cuDriverGetVersion(ctypes.byref(value))
        return f"{value.value // 1000}.{value.value % 1000 // 10}"


@functools.lru_cache(maxsize=1)
def _driver() -> _Driver | None:
    try:
        return _Driver()
    except (OSError, AttributeError):
        return None


def cuda_device_count() -> int:
    """CUDA devices the driver can see; 0 with no driver or no GPU."""
    driver = _driver()
    return driver.count() if driver else 0


def compute_capability(index: int) -> str:
    driver = _driver()
    if driver is None:
        raise DeviceError("no CUDA driver is available")
    return driver.capability(index)


def missing_device(device: Device) -> DeviceError | None:
    """Why `device` does not exist on this machine, or None."""
    if device.type == "cpu":
        return None
    count = cuda_device_count()
    if count == 0:
        return DeviceError("no CUDA device is available on this machine (no NVIDIA driver or GPU was found)")
    if device.index >= count:
        return DeviceError(f"{device} does not exist: this machine has {count} CUDA device(s)")
    return None


def incompatibility(method: MethodSpec, device: Device) -> CudaRunnerError | None:
    """Why `method` cannot run on `device` here (an error to raise), or None if it can."""
    missing = missing_device(device)
    if missing is not None:
        return missing
    built = method.device
    if built.type != device.type:
        return IncompatibleBundleError(f"method {method.name!r} was compiled for {built.type}, not {device.type}")
    if device.type == "cpu":
        lacking = sorted(set(built.cpu_flags) - cpu_isa_flags())
        if lacking:
            return IncompatibleBundleError(f"method {method.name!r} was compiled for a CPU with {', '.join(lacking)}, which this CPU lacks")
        return None
    if built.compute_capability:
        return _capability_problem(method.name, built.compute_capability, compute_capability(device.index))
    return None


def _capability_problem(method: str, built: str, here: str) -> CudaRunnerError | None:
    built_major, built_minor = (int(part) for part in built.split("."))
    here_major, here_minor = (int(part) for part in here.split("."))
    if here_major != built_major or here_minor < built_minor:
        return IncompatibleBundleError(f"method {method!r} was compiled for compute capability {built}; this GPU has {here}")
    return None


def choose_device(methods: Iterable[MethodSpec], requested: str | Device | None) -> Device:
    """The requested device, or the bundle's own device if this machine has it."""
    methods = list(methods)
    if isinstance(requested, Device):
        device = requested
    elif requested is not None:
        device = parse_device(requested)
    else:
        kinds = {method.device.type for method in methods}
        if len(kinds) != 1:
            raise InputError("the bundle's methods target different devices; choose one", subject="device")
        device = Device(kinds.pop())
    for method in methods:
        problem = incompatibility(method, device)
        if problem:
            raise problem
    return device


# ---------------------------------------------------------------------------
# `cuda-runner devices`


@dataclass
class GpuInfo:
    device: str
    name: str
    compute_capability: str
    memory_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "name": self.name, "compute_capability": self.compute_capability, "memory_bytes": self.memory_bytes}


@dataclass
class DevicesResult:
    cpu_model: str
    cpu_cores: int
    cpu_flags: list[str]
    gpus: list[GpuInfo] = field(default_factory=list)
    cuda_driver: str | None = None  # the CUDA version the driver supports
    cuda_runtime: str | None = None  # CuPy's CUDA runtime, if CuPy is installed
    libtorch: str | None = None  # the torch whose libraries the runtime loads
    own_shim: str | None = None  # cuda-runner's shim library, where it is built

    def to_json(self) -> dict[str, Any]:
        from ..report.schema import SCHEMAS

        return {
            "schema": SCHEMAS["devices"],
            "cpu": {"device": "cpu", "model": self.cpu_model, "cores": self.cpu_cores, "isa_flags": self.cpu_flags},
            "gpus": [gpu.to_json() for gpu in self.gpus],
            "cuda_driver": self.cuda_driver,
            "cuda_runtime": self.cuda_runtime,
            "libtorch": self.libtorch,
            "own_shim": self.own_shim,
        }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cuda_runtime_version() -> str | None:
    try:
        from cupy_backends.cuda.api import runtime
    except ImportError:
        return None
    try:
        value = int(runtime.runtimeGetVersion())
    except Exception:  # CuPy present but its CUDA libraries are not
        return None
    return f"{value // 1000}.{value % 1000 // 10}"


def _own_shim() -> str | None:
    from .providers import own_shim_path

    path = own_shim_path()
    return None if path is None else path.name


def libtorch_version() -> str | None:
    """torch's version, read from its version.py without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    from pathlib import Path

    version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        for line in version_file.read_text().splitlines():
            if line.startswith("__version__"):
                return line.partition("=")[2].strip().strip("'\"")
    except OSError:
        pass
    return None


def describe_devices() -> DevicesResult:
    import os

    result = DevicesResult(_cpu_model(), os.cpu_count() or 1, sorted(cpu_isa_flags()), libtorch=libtorch_version(), own_shim=_own_shim())
    driver = _driver()
    if driver is not None:
        result.cuda_driver = driver.version()
        result.cuda_runtime = _cuda_runtime_version()
        for index in range(driver.count()):
            result.gpus.append(GpuInfo(f"cuda:{index}", driver.name(index), driver.capability(index), driver.total_memory(index)))
    return result
