"""Throughput at scale, side by side in one run (GPU): host copies, many input sets, several GPUs.

    python scripts/bench_throughput.py --output throughput.json [--sets 1000] [--multi-gpu]

1. Copies, 64 MiB in and 64 MiB out (x * 2 + 1 on a 4096x4096 float32), NumPy in
   and NumPy out: Model.run (chunked staging and pooled pinned outputs), the same
   with both switched off (one staging copy in, one copy out of staging), eager
   PyTorch .cuda()/.cpu(), pageable cudaMemcpy both ways, and pinned cudaMemcpy
   both ways (the limit). Effective GB/s = 128 MiB / seconds per round trip.
2. Many input sets from .npz files, outputs written: `run --batch` (lanes 2) vs a
   loop of single runs in one process (read, run, write, one after another) vs an
   eager PyTorch loop; for a small MLP and a copy-heavy model.
3. With --multi-gpu: sets per second of a compute-bound model on every GPU
   (load_pool) against one GPU.
4. --parts stacked: 1,000 small sets (8 rows) of an MLP with a dynamic batch:
   `run --batch` one set per call against `--batch-size 16` (stacked calls).
5. --parts compute: a compute-heavy model (8 x Linear 4096, 512 rows):
   `run --batch` from .npz files against pure compute (resident inputs, calls
   back to back), and the GPU's utilisation while the batch runs (nvidia-smi).

    python scripts/bench_throughput.py --parts stacked,compute --output part.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_compare  # scripts/ is this script's own folder
import numpy as np

import cuda_runner
from cuda_runner.commands.batch import BatchRequest, run_batch
from cuda_runner.io.npy import load_archive, save_archive
from cuda_runner.runtime import pinned

MIB = 1 << 20


def _median(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def _rounds(action: Any, rounds: int = 15) -> list[float]:
    action()
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return samples


def copies(torch: Any, work: Path) -> dict[str, Any]:
    from cupy_backends.cuda.api import runtime

    class BigIO(torch.nn.Module):
        def forward(self, x):
            return x * 2.0 + 1.0

    x = np.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32)
    bundle = bench_compare.compile_bundle(torch, "big_io", BigIO().eval(), (torch.from_numpy(x),), "cuda", work)
    moved = 2 * x.nbytes
    results: dict[str, Any] = {"bytes_each_way": x.nbytes}
    with cuda_runner.load(bundle) as model:
        held: list[Any] = []

        def run_pipelined() -> None:
            held[:] = [model.run([x])]  # the caller keeps its outputs, as a user would

        results["cuda_runner"] = _median(_rounds(run_pipelined))
        saved = (pinned.PIPELINE_MIN_BYTES, pinned.POOLED_MIN_BYTES)
        pinned.PIPELINE_MIN_BYTES = pinned.POOLED_MIN_BYTES = 1 << 62  # the plain path, for comparison
        try:
            results["cuda_runner_plain_staging"] = _median(_rounds(lambda: model.run([x])))
        finally:
            pinned.PIPELINE_MIN_BYTES, pinned.POOLED_MIN_BYTES = saved
    tensor = torch.from_numpy(x)
    results["eager_torch"] = _median(_rounds(lambda: (tensor.cuda() * 2.0 + 1.0).cpu().numpy()))
    device = runtime.malloc(x.nbytes)
    out = np.empty_like(x)
    results["pageable_memcpy"] = _median(_rounds(lambda: (runtime.memcpy(device, x.ctypes.data, x.nbytes, 1), runtime.memcpy(out.ctypes.data, device, x.nbytes, 2))))
    host = runtime.hostAlloc(x.nbytes, 0)
    results["pinned_memcpy_limit"] = _median(_rounds(lambda: (runtime.memcpy(device, host, x.nbytes, 1), runtime.memcpy(host, device, x.nbytes, 2))))
    runtime.freeHost(host)
    runtime.free(device)
    for key in ("cuda_runner", "cuda_runner_plain_staging", "eager_torch", "pageable_memcpy", "pinned_memcpy_limit"):
        results[key]["gb_s"] = moved / results[key]["median"] / 1e9
    return results


def _write_sets(folder: Path, shape: tuple[int, ...], count: int, name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    base = rng.standard_normal(shape, dtype=np.float32)
    for index in range(count):
        save_archive(folder / f"set{index:05d}.npz", {name: base + index})


def many_sets(torch: Any, work: Path, label: str, module: Any, example: Any, count: int) -> dict[str, Any]:
    bundle = bench_compare.compile_bundle(torch, label, module, (example,), "cuda", work)
    folder = work / f"{label}-sets"
    (input_name,) = [tensor.name for tensor in cuda_runner.read_manifest(bundle).methods["forward"].inputs]
    _write_sets(folder, tuple(example.shape), count, input_name)
    results: dict[str, Any] = {"sets": count, "set_bytes": example.numel() * 4}
    started = time.perf_counter()
    batch = run_batch(BatchRequest(bundle=bundle, inputs=folder, out_dir=work / f"{label}-batch"))
    results["batch_lanes2_sets_per_s"] = count / (time.perf_counter() - started)
    results["batch_failed"] = batch.count("error") + batch.count("failed")
    files = sorted(folder.glob("*.npz"))
    with cuda_runner.load(bundle) as model:
        out = work / f"{label}-loop"
        out.mkdir()
        started = time.perf_counter()
        for path in files:
            outputs = model.run(load_archive(path))
            save_archive(out / path.name, outputs)
        results["loop_sets_per_s"] = count / (time.perf_counter() - started)
    module = module.cuda()
    eager_out = work / f"{label}-eager"
    eager_out.mkdir()
    started = time.perf_counter()
    with torch.no_grad():
        for path in files:
            arrays = load_archive(path)
            result = module(torch.from_numpy(arrays[input_name]).cuda()).cpu().numpy()
            save_archive(eager_out / path.name, {"output_0": result})
    results["eager_loop_sets_per_s"] = count / (time.perf_counter() - started)
    results["batch_over_loop"] = results["batch_lanes2_sets_per_s"] / results["loop_sets_per_s"]
    return results


def stacked_sets(torch: Any, work: Path, count: int) -> dict[str, Any]:
    from torch.export import Dim

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).eval()
    bundle = work / "mlp-dynamic.bundle"
    cuda_runner.compile_module(mlp, (torch.randn(8, 256),), bundle, device="cuda", dynamic_shapes={"input": {0: Dim("batch", max=1024)}})
    folder = work / "stacked-sets"
    _write_sets(folder, (8, 256), count, "input")
    results: dict[str, Any] = {"sets": count, "rows_per_set": 8}
    for size in (1, 16):
        rounds = []
        for attempt in range(3):
            started = time.perf_counter()
            batch = run_batch(BatchRequest(bundle=bundle, inputs=folder, out_dir=work / f"stacked-{size}-{attempt}", batch_size=size))
            rounds.append(count / (time.perf_counter() - started))
            assert batch.exit_code == 0
        results[f"batch_size_{size}_sets_per_s"] = _median(rounds)
    results["stacked_over_single"] = results["batch_size_16_sets_per_s"]["median"] / results["batch_size_1_sets_per_s"]["median"]
    return results


class _Utilisation:
    """GPU utilisation samples from nvidia-smi every 100 ms, while running."""

    def __enter__(self) -> _Utilisation:
        import subprocess

        self.samples: list[int] = []
        try:
            self._process: Any = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0", "-lms", "100"],
                                                  stdout=subprocess.PIPE, text=True)
        except OSError:
            self._process = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is None:
            return
        self._process.terminate()
        output, _ = self._process.communicate()
        self.samples = [int(line) for line in output.split() if line.strip().isdigit()]

    def summary(self) -> dict[str, Any]:
        busy = self.samples[2:-2] or self.samples  # leave out the ramp up and down
        return {"samples": len(self.samples), "median_percent": statistics.median(busy) if busy else None}


def compute_heavy(torch: Any, work: Path, count: int) -> dict[str, Any]:
    import cupy

    # Half a MiB in and out per set, about 140 GFLOP of float32 matmuls between.
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 4096)] + [torch.nn.Linear(4096, 4096) for _ in range(8)] + [torch.nn.Linear(4096, 256)]
    module = torch.nn.Sequential(*[part for layer in layers for part in (layer, torch.nn.GELU())]).eval()
    x = torch.randn(512, 256)
    bundle = bench_compare.compile_bundle(torch, "compute", module, (x,), "cuda", work)
    folder = work / "compute-sets"
    _write_sets(folder, (512, 256), count, "input")
    results: dict[str, Any] = {"sets": count, "set_bytes": 512 * 256 * 4}
    with cuda_runner.load(bundle) as model:
        method = model.method()
        resident = {"input": cupy.asarray(x.numpy())}
        for _ in range(5):
            method.run_device(resident)
        method.stream.synchronize()
        started = time.perf_counter()
        for _ in range(count):
            method.run_device(resident)
        method.stream.synchronize()
        results["pure_compute_sets_per_s"] = count / (time.perf_counter() - started)
    run_batch(BatchRequest(bundle=bundle, inputs=folder, out_dir=work / "compute-warm"))  # page cache and kernels warm
    with _Utilisation() as utilisation:
        started = time.perf_counter()
        batch = run_batch(BatchRequest(bundle=bundle, inputs=folder, out_dir=work / "compute-batch"))
        results["batch_sets_per_s"] = count / (time.perf_counter() - started)
    results["batch_failed"] = batch.count("error") + batch.count("failed")
    results["gpu_utilisation_during_batch"] = utilisation.summary()
    results["batch_over_pure_compute"] = results["batch_sets_per_s"] / results["pure_compute_sets_per_s"]
    return results


def multi_gpu(torch: Any, work: Path, count: int) -> dict[str, Any]:
    """Both models: 8 MiB in and out per set (8 x Linear 4096), and half a MiB
    (Linear 256->4096, 8 x Linear 4096, Linear 4096->256), about the same compute."""
    from cuda_runner.runtime.devices import cuda_device_count

    gpus = cuda_device_count()
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s)"}
    torch.manual_seed(0)
    wide = [torch.nn.Linear(4096, 4096) for _ in range(8)]
    narrow_io = [torch.nn.Linear(256, 4096), *[torch.nn.Linear(4096, 4096) for _ in range(8)], torch.nn.Linear(4096, 256)]
    results: dict[str, Any] = {"gpus": gpus}
    for label, layers, columns in (("io_8mib", wide, 4096), ("io_half_mib", narrow_io, 256)):
        module = torch.nn.Sequential(*[part for layer in layers for part in (layer, torch.nn.GELU())]).eval()
        results[label] = _pool_speedup(torch, work, label, module, torch.randn(512, columns), count)
    return results


def _pool_speedup(torch: Any, work: Path, label: str, module: Any, x: Any, count: int) -> dict[str, Any]:
    bundle = bench_compare.compile_bundle(torch, label, module, (x,), "cuda", work)
    cases = [{"input": x.numpy()} for _ in range(count)]
    results: dict[str, Any] = {"sets": count}
    with cuda_runner.load_pool(bundle, "0", lanes=2) as one:
        list(one.map(cases[:20]))
        started = time.perf_counter()
        list(one.map(cases))
        results["one_gpu_sets_per_s"] = count / (time.perf_counter() - started)
    with cuda_runner.load_pool(bundle, "all", lanes=2) as every:
        list(every.map(cases[:20]))
        started = time.perf_counter()
        list(every.map(cases))
        results["all_gpus_sets_per_s"] = count / (time.perf_counter() - started)
    results["speedup"] = results["all_gpus_sets_per_s"] / results["one_gpu_sets_per_s"]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", type=int, default=1000)
    parser.add_argument("--copy-heavy-sets", type=int, default=300)
    parser.add_argument("--multi-gpu", action="store_true", help="only the several-GPU comparison")
    parser.add_argument("--parts", help="only these comma-separated parts: stacked, compute")
    parser.add_argument("--output", type=Path)
    options = parser.parse_args()
    import torch

    work = Path(tempfile.mkdtemp(prefix="cuda-runner-throughput-"))
    report: dict[str, Any] = {"machine": bench_compare.machine_info(torch, "cuda")}
    if options.parts:
        parts = set(options.parts.split(","))
        if "stacked" in parts:
            report["stacked"] = stacked_sets(torch, work, options.sets)
            bench_compare.write_report(report, options.output)
        if "compute" in parts:
            report["compute_heavy"] = compute_heavy(torch, work, 200)
    elif options.multi_gpu:
        report["multi_gpu"] = multi_gpu(torch, work, options.sets)
    else:
        report["copies"] = copies(torch, work)
        bench_compare.write_report(report, options.output)  # kept if a later part fails
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).eval()
        report["small_mlp"] = many_sets(torch, work, "mlp", mlp, torch.randn(8, 256), options.sets)

        class Scale(torch.nn.Module):
            def forward(self, x):
                return x * 2.0 + 1.0

        report["copy_heavy"] = many_sets(torch, work, "scale", Scale().eval(), torch.randn(1024, 1024), options.copy_heavy_sets)
    bench_compare.write_report(report, options.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
