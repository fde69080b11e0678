"""Builds cuda-runner's own AOTInductor shim (cuda_runner/native/aoti_shim.cpp).

It is a plain shared library that the runtime loads with ctypes, built as an
extension module so that wheels carry it and `pip install` builds it: running
a model never needs a compiler. Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cuda_runner._aoti_shim",
            sources=["cuda_runner/native/aoti_shim.cpp", "cuda_runner/native/cpu_kernels.cpp", "cuda_runner/native/vector_math.cpp"],
            language="c++",
            # Hidden by default: only the cudarunner_* and cr_sl_* functions are exported.
            # -fopenmp: the BLAS's parallel work runs on the OpenMP team the model's kernels use (cpu_kernels.cpp).
            extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", "-Wno-psabi", "-fopenmp"],
            # Only cudarunner_* and cr_sl_*: no libstdc++ template code either.
            extra_link_args=["-Wl,--version-script=cuda_runner/native/aoti_shim.map", "-fopenmp"],
            depends=["cuda_runner/native/aoti_shim.map", "cuda_runner/native/cpu_kernels.h", "cuda_runner/native/vector_math_kernels.inc"],
            libraries=["dl"],
        ),
        # run_device's per-call glue in C; optional: the runtime does the same in Python without it.
        Extension(
            "cuda_runner._device_call",
            sources=["cuda_runner/native/device_call.c"],
            depends=["cuda_runner/native/call_frame.h"],
            extra_compile_args=["-O2", "-fvisibility=hidden"],
            optional=True,
        ),
        # A graphed method's host calls (stage, launch, wait, copy out) in C; optional like the one above.
        Extension(
            "cuda_runner._graph_call",
            sources=["cuda_runner/native/graph_call.c"],
            extra_compile_args=["-O2", "-fvisibility=hidden"],
            optional=True,
        ),
    ],
)
