"""The executor interface: how a method's container is run on one kind of device.

Three implementations: `CpuExecutor` (NumPy memory), `CudaExecutor` (pinned
staging and one CUDA stream), and `CudaGraphExecutor` (replays one captured
Run). A `Method` owns one or more executors ("lanes").

Thread safety: an executor serves one call at a time. It owns per-call state
(staging buffers, a stream, ctypes out-parameters), so the Method hands each
concurrent call its own executor, and never shares one between two threads.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from ..errors import InputError
from .container import Container


class Executor(abc.ABC):
    """Runs a container on host (NumPy) arrays; optionally on device arrays."""

    #: The CUDA stream every copy and run of this executor is ordered on, or None.
    stream: Any = None
    #: Whether run_device works (CuPy arrays in and out).
    takes_device_arrays = False

    @abc.abstractmethod
    def run(self, container: Container, dtypes: list[str], arrays: list[np.ndarray], phases: dict[str, float] | None = None) -> list[np.ndarray]:
        """Host arrays in (validated, in input order), fresh host arrays out.

        With `phases`, fill in copy_in, compute and copy_out seconds."""

    def run_device(self, container: Container, dtypes: list[str], arrays: list[Any]) -> list[Any]:
        """Device arrays in and out, no host copies."""
        raise InputError("device arrays need a method loaded on a CUDA device, without a CUDA graph")

    def pinned_input(self, index: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A page-locked staging array for input `index`."""
        raise InputError("pinned inputs need a method loaded on a CUDA device")

    @abc.abstractmethod
    def close(self) -> None:
        """Finish queued work and free everything this executor owns."""
