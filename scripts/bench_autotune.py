"""Compiled code quality, side by side in one run (GPU): default options, `--autotune`, and eager.

An MLP of 8 Linear(4096, 4096) + GELU layers in bfloat16 with a dynamic batch,
compiled twice (default Inductor options; AUTOTUNE_OPTIONS), timed per call on
device-resident inputs (run_device + synchronize) at batch 1, 64 and 1024,
against eager PyTorch on the same GPU. With --resnet, ResNet-18 at batch 1 and
32 too (static shapes, one bundle per batch; torchvision's model where it is
installed, else the same layout defined here).

    python scripts/bench_autotune.py --output autotune.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_compare  # scripts/ is this script's own folder

import cuda_runner
from cuda_runner.compile.aot import AUTOTUNE_OPTIONS


def _per_call(call: Any, synchronize: Any, runs: int = 200) -> dict[str, float]:
    for _ in range(10):
        call()
    synchronize()
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        synchronize()
        samples.append(time.perf_counter() - started)
    return {"median_us": statistics.median(samples) * 1e6, "min_us": min(samples) * 1e6, "max_us": max(samples) * 1e6, "n": runs}


def _bundle_times(bundle: Path, inputs_by_case: dict[str, Any]) -> dict[str, Any]:
    with cuda_runner.load(bundle) as model:
        method = model.method()
        name = method.spec.inputs[0].name
        return {case: _per_call(lambda array=array: method.run_device({name: array}), method.stream.synchronize) for case, array in inputs_by_case.items()}


def _eager_times(torch: Any, module: Any, inputs_by_case: dict[str, Any]) -> dict[str, Any]:
    with torch.no_grad():
        return {case: _per_call(lambda tensor=tensor: module(tensor), torch.cuda.synchronize) for case, tensor in inputs_by_case.items()}


def mlp(torch: Any, work: Path) -> dict[str, Any]:
    import cupy
    from torch.export import Dim

    torch.manual_seed(0)
    module = torch.nn.Sequential(*[part for _ in range(8) for part in (torch.nn.Linear(4096, 4096), torch.nn.GELU())]).to(torch.bfloat16).eval()
    example = torch.randn(64, 4096, dtype=torch.bfloat16)
    batches = (1, 64, 1024)
    results: dict[str, Any] = {"batches": list(batches)}
    tensors = {f"batch_{b}": torch.randn(b, 4096, dtype=torch.bfloat16, device="cuda") for b in batches}
    # CuPy has no bfloat16: the runner takes its bits as uint16.
    device_inputs = {case: cupy.asarray(tensor.view(torch.int16).cpu().numpy().view("uint16")) for case, tensor in tensors.items()}
    # With a dynamic batch Inductor tunes at the example size only. Two ways
    # round it were tried: keeping GEMMs to ATen ("autotune_aten", slower than
    # the default at every batch on the H200) and multi_kernel_hints (fails to
    # compile under AOTInductor in torch 2.11); the first stays measured here.
    aten = {**AUTOTUNE_OPTIONS, "max_autotune_gemm_backends": "ATEN"}
    for label, options in (("default", None), ("autotune", AUTOTUNE_OPTIONS), ("autotune_aten", aten)):
        bundle = work / f"mlp-{label}.bundle"
        started = time.perf_counter()
        try:
            cuda_runner.compile_module(module, (example,), bundle, device="cuda", dynamic_shapes={"input": {0: Dim("batch", min=1, max=1024)}}, options=options)
        except Exception as error:  # an option this torch lacks
            results[label] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            continue
        results[f"{label}_compile_s"] = time.perf_counter() - started
        results[label] = _bundle_times(bundle, device_inputs)
    results["eager"] = _eager_times(torch, module.cuda(), tensors)
    return results


def resnet18(torch: Any) -> Any:
    """ResNet-18 (He et al., 2015): the standard layout of basic blocks, written
    here so that the benchmark runs where torchvision is not installed."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, inputs: int, outputs: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(outputs)
            self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(outputs)
            self.shortcut = nn.Identity()
            if stride != 1 or inputs != outputs:
                self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))

    stages, width = [], 64
    for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        stages += [Block(width, outputs, stride), Block(outputs, outputs, 1)]
        width = outputs
    stem = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    return nn.Sequential(*stem, *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)).eval()


def resnet(torch: Any, work: Path, progress: Any = None) -> dict[str, Any]:
    """`progress(results)` after each bundle: ResNet autotuning takes minutes."""
    import cupy

    try:
        import torchvision

        model = torchvision.models.resnet18().eval()
    except ImportError:
        torch.manual_seed(0)
        model = resnet18(torch)
    results: dict[str, Any] = {}
    for batch in (1, 32):
        x = torch.randn(batch, 3, 224, 224)
        device_input = {"case": cupy.asarray(x.numpy())}
        results[f"batch_{batch}_eager"] = _eager_times(torch, model.cuda(), {"case": x.cuda()})["case"]
        for label, options in (("default", None), ("autotune", AUTOTUNE_OPTIONS)):
            bundle = work / f"resnet-{batch}-{label}.bundle"
            started = time.perf_counter()
            cuda_runner.compile_module(model, (x,), bundle, device="cuda", options=options)
            results[f"batch_{batch}_{label}_compile_s"] = time.perf_counter() - started
            results[f"batch_{batch}_{label}"] = _bundle_times(bundle, device_input)["case"]
            if progress is not None:
                progress(results)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path)
    parser.add_argument("--resnet", action="store_true", help="also ResNet-18 (torchvision's, or the same layout defined here)")
    options = parser.parse_args()
    import torch

    work = Path(tempfile.mkdtemp(prefix="cuda-runner-autotune-"))
    report: dict[str, Any] = {"machine": bench_compare.machine_info(torch, "cuda"), "options": AUTOTUNE_OPTIONS}
    report["mlp_bf16_8x4096"] = mlp(torch, work)
    bench_compare.write_report(report, options.output)
    if options.resnet:

        def keep(partial: dict[str, Any]) -> None:
            report["resnet18"] = partial
            bench_compare.write_report(report, options.output)

        keep(resnet(torch, work, keep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
