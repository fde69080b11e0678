"""How to load a model: one value that every load takes.

`cuda_runner.load`, `load_model`, `Method.load` and the run, bench and batch
requests all carry a `LoadOptions`, so an option added here reaches every
way of loading, and none can drop one on the way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ..format.signing import TrustedKey

# Each lane holds a stream, staging buffers and a model instance: thousands would only exhaust the device.
MAX_LANES = 256


@dataclass(frozen=True)
class LoadOptions:
    """What a load does, beyond which file, which device and which methods.

    - `verify_weights`: check the weights' digests while they load (a signed
      bundle's are checked whatever this says).
    - `cuda_graph`: capture each (static-shape) method into a CUDA graph.
    - `lanes`: how many calls of one method run at once (each lane has its own
      CUDA stream and staging buffers).
    - `check_inputs`: turn on the library's own input checks.
    - `warm_up`: on CUDA, run each method once on zeros while it loads, so
      that the first real call does not pay for the library's lazy set-up.
    - `call_helper`: a bundle's call helper makes each call one foreign call;
      False goes through ctypes alone.
    - `provider`: whose shim functions each library runs on: "auto" (None
      means CUDA_RUNNER_PROVIDER, or "auto"), "shim" or "libtorch".
    - `trusted_keys`: the bundle must be signed by one of these (checked
      before any of its code loads)."""

    verify_weights: bool = True
    cuda_graph: bool = False
    lanes: int = 1
    check_inputs: bool = False
    warm_up: bool = True
    call_helper: bool = True
    provider: str | None = None
    trusted_keys: tuple[TrustedKey, ...] = ()

    def __post_init__(self) -> None:
        for name in ("verify_weights", "cuda_graph", "check_inputs", "warm_up", "call_helper"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"load option {name} must be True or False, not {getattr(self, name)!r}")
        if isinstance(self.lanes, bool) or not isinstance(self.lanes, int) or not 1 <= self.lanes <= MAX_LANES:
            raise InputError(f"lanes must be a whole number from 1 to {MAX_LANES}, not {self.lanes!r}", subject="lanes")
        if not isinstance(self.trusted_keys, tuple) or not all(isinstance(key, TrustedKey) for key in self.trusted_keys):
            raise InputError("trusted_keys must be a tuple of keys read with keys_for_loading (cuda_runner.load takes key file paths)")
        if self.provider is not None:
            from .providers import check_provider

            check_provider(self.provider)

    def with_fields(self, **fields: Any) -> LoadOptions:
        """A copy with some fields changed; an unknown name is an InputError naming the known ones."""
        known = {field.name for field in dataclasses.fields(self)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise InputError(f"unknown load option {unknown[0]!r}; the options are: {', '.join(sorted(known))}")
        return dataclasses.replace(self, **fields) if fields else self
