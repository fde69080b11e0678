"""Dynamic batching: input sets that arrive together run as one call.

`run --batch DIR --batch-size N` hands sets to a Stacker from many threads.
Dispatcher threads (one per lane) take a set, wait briefly for up to N-1 more
that fit with it, concatenate their inputs along the method's batch dim, run
once, and split every output back. A method qualifies when one dynamic dim
leads every output and at least one input; inputs without that dim must be
equal across the stacked sets. Sets must not interact across rows (true of
models in eval mode; a model that, say, normalises over the whole batch would
give different numbers stacked, which is why every output must lead with the
batch dim: a reduction over the batch has no such output).
"""

from __future__ import annotations

import hashlib
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..arrays import dtype_name
from ..errors import ClosedError, InputError, ModelRuntimeError
from ..format.manifest import MethodSpec
from ..format.validation import validate_inputs

LINGER_SECONDS = 0.002  # how long a dispatcher waits for more sets to stack


def batch_dim(spec: MethodSpec) -> str:
    """The dynamic dim sets can be stacked along, or InputError saying why there is none."""
    for name in spec.dims:
        leads_outputs = all(output.shape[:1] == (name,) for output in spec.outputs)
        leads_an_input = any(tensor.shape[:1] == (name,) for tensor in spec.inputs)
        mentions = re.compile(rf"(?<![A-Za-z0-9_.]){re.escape(name)}(?![A-Za-z0-9_.])")
        used_elsewhere = any(
            isinstance(entry, str) and mentions.search(entry) and (axis > 0 or entry != name)
            for tensor in (*spec.inputs, *spec.outputs) for axis, entry in enumerate(tensor.shape)
        )
        if leads_outputs and leads_an_input and not used_elsewhere:
            return name
    leading = [output.name for output in spec.outputs if not output.shape or output.shape[0] not in spec.dims]
    reason = f"output {leading[0]!r} does not start with a dynamic dim" if leading else "no dynamic dim leads every output and an input"
    raise InputError(f"method {spec.name!r} cannot stack input sets: {reason}", subject="batch_size")


@dataclass
class _Request:
    key: tuple[Any, ...]
    arrays: dict[str, np.ndarray]
    rows: int
    future: Future


class Stacker:
    def __init__(self, spec: MethodSpec, run: Callable[[dict[str, Any]], dict[str, Any]], size: int, lanes: int):
        if size < 1:
            raise InputError("the batch size must be at least 1", subject="batch_size")
        self.dim = batch_dim(spec)
        self._spec = spec
        self._run = run
        self._size = size
        self._max_rows = spec.dims[self.dim].max
        self._batched = [tensor.name for tensor in spec.inputs if tensor.shape[:1] == (self.dim,)]
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._dispatch, name="cuda-runner-stack", daemon=True) for _ in range(max(1, lanes))]
        for thread in self._threads:
            thread.start()

    def run(self, arrays: dict[str, Any]) -> dict[str, Any]:
        """Run one set (from any thread); returns its own outputs."""
        arrays = {name: np.asarray(value) for name, value in arrays.items()}
        # Each set must be valid on its own: stacked, a wrong size could pass unseen.
        validate_inputs(self._spec, {name: (dtype_name(array.dtype), array.shape) for name, array in arrays.items()})
        rows = int(arrays[self._batched[0]].shape[0])
        request = _Request(self._key(arrays), arrays, rows, Future())
        with self._lock:
            if self._closed:
                raise ClosedError("the stacker is closed")
            self._queue.put(request)
        return request.future.result()

    def _key(self, arrays: dict[str, np.ndarray]) -> tuple[Any, ...]:
        """Sets stack together when this matches: the batched inputs' other sizes
        and dtypes, and the other inputs' exact contents."""
        parts: list[Any] = []
        for name, array in sorted(arrays.items()):
            if name in self._batched:
                parts.append((name, array.dtype.str, array.shape[1:]))
            else:
                digest = hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=16).digest()
                parts.append((name, array.dtype.str, array.shape, digest))
        return tuple(parts)

    def _dispatch(self) -> None:
        carried: _Request | None = None
        while True:
            first = carried or self._queue.get()
            carried = None
            if first is None:
                self._queue.put(None)  # let the other dispatchers stop too
                return
            group, rows = [first], first.rows
            deadline = time.monotonic() + LINGER_SECONDS
            while len(group) < self._size:
                try:
                    following = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if following is None:
                    self._queue.put(None)  # stop after this group
                    break
                fits = following is not None and following.key == first.key and (self._max_rows is None or rows + following.rows <= self._max_rows)
                if not fits:
                    carried = following  # starts the next group (or stops this dispatcher)
                    break
                assert following is not None
                group.append(following)
                rows += following.rows
            self._run_group(group)

    def _run_group(self, group: list[_Request]) -> None:
        try:
            results = [self._run(group[0].arrays)] if len(group) == 1 else self._stacked(group)
        except BaseException as error:  # every waiting set gets the failure
            for request in group:
                request.future.set_exception(error)
            return
        for request, outputs in zip(group, results):
            request.future.set_result(outputs)

    def _stacked(self, group: list[_Request]) -> list[dict[str, Any]]:
        first = group[0].arrays
        stacked = {name: np.concatenate([request.arrays[name] for request in group]) if name in self._batched else array
                   for name, array in first.items()}
        outputs = self._run(stacked)
        rows = [request.rows for request in group]
        total = sum(rows)
        bounds = np.cumsum(rows)[:-1]
        split: list[dict[str, Any]] = [{} for _ in group]
        for name, array in outputs.items():
            if array.shape[:1] != (total,):
                raise ModelRuntimeError(f"output {name!r} of {len(group)} stacked sets has {array.shape[:1]} rows, not {total}")
            for index, part in enumerate(np.split(array, bounds)):
                split[index][name] = part
        return split

    def close(self) -> None:
        """Refuse new sets, run those already queued, and stop the dispatchers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
