"""The executor interface: how a method's container is run on one kind of device.

Three implementations: `CpuExecutor` (NumPy memory), `CudaExecutor` (pinned
staging and one CUDA stream), and `CudaGraphExecutor` (replays one captured
Run). A `Method` owns one or more executors ("lanes"). An executor is made for
one container, after it exists: it binds its call path (the invoker) once,
and each call passes only arrays.

Thread safety: an executor serves one call at a time. It owns per-call state
(staging buffers, a stream, ctypes out-parameters), so the Method hands each
concurrent call its own executor, and never shares one between two threads.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InputError

_NO_DEVICE_ARRAYS = "device arrays need a method loaded on a CUDA device"


class Executor(abc.ABC):
    """Runs one container on host (NumPy) arrays; optionally on device arrays."""

    #: The CUDA stream every copy and run of this executor is ordered on, or None.
    stream: Any = None
    #: Where set, an object whose run(inputs) makes a whole host call in C from the inputs by name (a dict), checks
    #: included, returning the outputs by name, or None having queued nothing: the call is then run()'s. Only a
    #: graph executor has one (runtime/graphs.py), and says so in `offers_fast_calls`: a method whose lanes offer
    #: none does not borrow a lane to look.
    fast_call: Any = None
    offers_fast_calls = False

    @abc.abstractmethod
    def run(self, arrays: list[np.ndarray], phases: dict[str, float] | None = None) -> list[np.ndarray]:
        """Host arrays in (validated, in the library's input order), fresh host arrays out.

        With `phases`, fill in copy_in, compute and copy_out seconds."""

    def device_inputs(self, arrays: Sequence[Any], names: Sequence[str]) -> list[Any]:
        """The inputs as this executor's device arrays (CuPy), converting
        anything with `__cuda_array_interface__`; refuses where there are none."""
        raise InputError(_NO_DEVICE_ARRAYS)

    def copy_device(self, array: Any) -> Any:
        """A private copy of one of this executor's device arrays."""
        raise InputError(_NO_DEVICE_ARRAYS)

    def run_device(self, arrays: list[Any]) -> list[Any]:
        """Device arrays in (from device_inputs, in the library's order) and out, no host copies."""
        raise InputError(_NO_DEVICE_ARRAYS)

    def pinned_input(self, index: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A page-locked staging array for input `index`."""
        raise InputError("pinned inputs need a method loaded on a CUDA device")

    def take_over(self, old: Executor) -> None:
        """Keep what `old` (the lane this one replaces, to be closed next) handed
        out to callers and promised to keep (pinned_input's arrays). Nothing, by default."""
        return None  # optional: only the CUDA executor hands such memory out

    @abc.abstractmethod
    def close(self) -> None:
        """Finish queued work and free everything this executor owns."""
