"""Test-only: a stand-in for the AOTInductor step of `cuda-runner compile`.

Python imports `sitecustomize` at start-up from the path, so an interpreter
started with this folder on PYTHONPATH and CUDA_RUNNER_TEST_PRECOMPILED set
to a bundle (tests/cli/test_stdout_contract.py does this) takes that bundle's
library and weights instead of running the C++ compiler, which takes tens of
seconds: the compile's own process, the program loaded, the bundle written
and the lines printed are all real. The compile's child process inherits the
environment, and so the stand-in.
"""

from __future__ import annotations

import os

_SOURCE = os.environ.get("CUDA_RUNNER_TEST_PRECOMPILED")

if _SOURCE:
    import cuda_runner.compile as _compile_package

    def _precompiled(program, args, kwargs, device, progress, user_options=None, cpu_target=None, standalone=False):
        from cuda_runner.compile.aot import CompiledLibrary
        from cuda_runner.format import open_bundle

        with open_bundle(_SOURCE) as reader:
            spec = next(iter(reader.manifest.methods.values()))
            weights = bytes(reader.segment(spec.weights_segment)) if spec.weights_segment else b""
            return CompiledLibrary(bytes(reader.segment(spec.library_segment)), weights, spec.device, dict(spec.compile_options))

    _compile_package.compile_program = _precompiled
