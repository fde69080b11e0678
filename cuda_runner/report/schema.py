"""The versioned schema names of every JSON document, in one place (docs/json.md).

Within a major version fields are only added; a breaking change bumps it."""

from __future__ import annotations

SCHEMAS = {
    "inspect": "cuda-runner/inspect/2",
    "run": "cuda-runner/run/2",
    "bench": "cuda-runner/bench/2",
    "devices": "cuda-runner/devices/2",
    "compare": "cuda-runner/compare/1",
    "batch": "cuda-runner/batch/1",
    "error": "cuda-runner/error/1",  # a failure of a command that has no document of its own
}
