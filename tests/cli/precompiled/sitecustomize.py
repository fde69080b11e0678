"""Test-only: a stand-in for the work of `cuda-runner compile`'s child process.

Python imports `sitecustomize` at start-up from the path, so an interpreter
started with this folder on PYTHONPATH and CUDA_RUNNER_TEST_PRECOMPILED set
to a bundle (tests/cli/test_stdout_contract.py does this) writes that
bundle's methods, under the names asked for, where the compile would have
written its own, instead of importing torch, loading the program and running
AOTInductor: about 8 s of a core per command, most of it importing torch.
What the stdout contract is about is all real: the command's parsing and
checks, its child process (started, reporting back and waited for as
always) and the lines it prints. Real compiles through the command line are
run by tests/test_readme.py, tests/cli/test_cli.py and
tests/cli/test_provider_cli.py.
"""

from __future__ import annotations

import os

_SOURCE = os.environ.get("CUDA_RUNNER_TEST_PRECOMPILED")

if _SOURCE:
    from cuda_runner.compile import isolated as _isolated

    def _precompiled_bundle(report, *, programs, output, call_helper=True, **options):
        """compile_bundle's contract: the bundle written at `output`, the method names returned."""
        from dataclasses import replace

        from cuda_runner.format import open_bundle, write_bundle

        with open_bundle(_SOURCE) as reader:
            manifest = reader.manifest
            (spec,) = manifest.methods.values()
            segments = {entry.name: bytes(reader.segment(entry.name)) for entry in manifest.segments}
        for method in programs:
            report("progress", f"compiling {method} (stand-in: {_SOURCE})")
        methods = {method: replace(spec, name=method) for method in programs}
        write_bundle(output, replace(manifest, methods=methods), segments)
        return list(methods)

    # The parent pickles the function by module and name; the child, which
    # imports this file too, finds the stand-in under that name.
    _isolated.compile_bundle = _precompiled_bundle
