"""What a bundle holds and whether this machine can run it (`cuda-runner inspect`)."""

from __future__ import annotations

import os
from typing import Any

from .format.bundle import open_bundle
from .format.manifest import MethodSpec
from .report.documents import inspect_document
from .runtime.devices import Device, incompatibility


def runnable_problem(spec: MethodSpec) -> str | None:
    """Why this machine cannot run `spec` on the device it was built for, or None."""
    problem = incompatibility(spec, Device(spec.device.type))
    return None if problem is None else str(problem)


def inspect_bundle(path: str | os.PathLike, *, verify: bool = False) -> dict[str, Any]:
    """The `inspect` JSON document (schema cuda-runner/inspect/1).

    Opening already checks the header, manifest checksum and layout; with
    verify=True every segment digest is re-checked and reported."""
    with open_bundle(path) as reader:
        problems = {name: runnable_problem(spec) for name, spec in reader.manifest.methods.items()}
        verified = reader.verify_all() if verify else None
        return inspect_document(reader, problems, verified)
