"""Write the bytecode of what the test suite's processes import, once, before they start.

scripts/test.sh installs with no bytecode compiled (compiling all of torch,
Ray and pandas up front is about 50 s of a core, mostly for files nothing
imports), so each module is compiled where it is first imported. On a fresh
machine the suite's first processes all import torch at once: both workers,
and the compiles they start through the command line, each compiling the same
few thousand files (about 16 s of a core for torch, export and Inductor; 8 s
for Ray Data). Importing them here first, beside the rest of the install,
compiles each file once.

    python scripts/warm_bytecode.py torch|ray
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import sys
from typing import Any

# Packages whose every module a compile imports (Inductor's attention patterns).
PACKAGES = {"torch": ["torch._inductor.fx_passes.serialized_patterns"], "ray": []}
# What an AOTInductor compile imports (some only on their first use, which is
# why they are named), and what Ray's workers import.
MODULES = {
    "torch": [
        "torch", "torch.export", "torch.export._trace", "torch._export.serde.serialize", "torch._inductor.compile_fx",
        "torch._inductor.codecache", "torch._inductor.codegen.cpp_wrapper_cpu", "torch._inductor.codegen.cpp_wrapper_gpu",
        "torch._inductor.fx_passes.post_grad", "torch._inductor.fx_passes.pad_mm", "torch._inductor.fx_passes.fuse_attention",
        "torch._inductor.fx_passes.mkldnn_fusion", "torch._inductor.fx_passes.quantization", "torch._inductor.fx_passes.freezing_patterns",
        "torch._inductor.codegen.halide", "torch.utils.cpp_extension", "torch.fx.experimental.validator",
        "torch._inductor.fx_passes.apply_gumbel_max_trick", "torch._inductor.fx_passes.efficient_conv_bn_eval",
        "torch._inductor.bounds", "torch._inductor.choices", "torch._inductor.compiler_bisector", "torch._inductor.extern_node_serializer",
        "torch._inductor.kernel_template_choice", "torch._subclasses.schema_check_mode", "torch.utils._cpp_embed_headers",
        "torch._export.passes.replace_autocast_with_hop_pass", "torch._export.passes.replace_set_grad_with_hop_pass",
        "sympy.physics.units", "sympy.combinatorics", "sympy.tensor.tensor",
    ],
    "ray": ["ray", "ray.data"],
}


def main(group: str) -> int:
    for name in MODULES[group]:
        _import(name)
    for package in PACKAGES[group]:
        module = _import(package)
        for found in pkgutil.iter_modules(getattr(module, "__path__", [])):
            _import(f"{package}.{found.name}")
    # Inductor imports most devices' code generators when it first registers
    # them (a compile still imports a few more, such as their op overrides).
    registration = getattr(sys.modules.get("torch._inductor.codegen.common"), "init_backend_registration", None)
    if registration is not None:
        with contextlib.suppress(Exception):
            registration()
    return 0


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception:  # a module this version lacks, or one that fails to import: only a warm-up
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
