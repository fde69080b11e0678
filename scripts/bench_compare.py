"""Side-by-side benchmark, in one run on one machine (docs/benchmarks.md).

The same models run through:
  - cuda-runner's CLI, cold, as a whole process;
  - cuda-runner's in-process API (host arrays; and device arrays on a GPU);
  - eager PyTorch;
  - torch's own AOTI package loader (torch._inductor.aoti_load_package), where it runs;
  - a C program calling the container's Run directly on the same library (the floor).
On a GPU it also measures copy bandwidth against plain pinned copies, weight
loading from the bundle mapping (registered as pinned vs passed directly, page
cache warm and cold), and on both machines the digest cost against SHA-256.

    python scripts/bench_compare.py --device cpu --output bench-cpu.json --markdown bench-cpu.md
    python scripts/bench_compare.py --device cuda --output bench-gpu.json --weights-gib 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

import numpy as np  # noqa: E402

import cuda_runner  # noqa: E402
from cuda_runner.commands.bench import BenchRequest, LatencyStats, benchmark  # noqa: E402
from cuda_runner.format import open_bundle  # noqa: E402
from cuda_runner.io.inputs import ArrayFile, GivenInputs  # noqa: E402
from cuda_runner.runtime.options import LoadOptions  # noqa: E402


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def write_report(report: dict[str, Any], output: Path | None) -> None:
    """Print a benchmark's JSON report, and keep it in `output` if given."""
    print(json.dumps(report, indent=2))
    if output:
        output.write_text(json.dumps(report, indent=2) + "\n")


def spread(samples: list[float]) -> dict[str, float]:
    stats = LatencyStats.of(samples)
    return {"n": stats.count, "median": stats.median, "min": stats.min, "max": stats.max, "cv": stats.cv}


# ---------------------------------------------------------------------------
# Models


def build_models(torch: Any) -> dict[str, tuple[Any, tuple]]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).eval()

    class BigIO(torch.nn.Module):
        """64 MiB in, 64 MiB out, trivial compute: measures the copies."""

        def forward(self, x):
            return x * 2.0 + 1.0

    return {
        "mlp": (mlp, (torch.randn(8, 256),)),
        "big_io": (BigIO().eval(), (torch.randn(4096, 4096),)),
    }


def compile_bundle(torch: Any, name: str, module: Any, args: tuple, device: str, work: Path) -> Path:
    path = work / f"{name}-{device}.bundle"
    started = time.perf_counter()
    cuda_runner.compile_module(module, args, path, device=device)
    log(f"compiled {name} for {device} in {time.perf_counter() - started:.1f} s")
    return path


# ---------------------------------------------------------------------------
# Contenders


def cli_cold(bundle: Path, input_file: Path, repeats: int, full_exit: bool = False) -> dict[str, Any]:
    """Wall time of whole `cuda-runner run` processes; `full_exit` makes the CLI tear the
    interpreter down as Python normally does instead of leaving at once (the old way)."""
    env = dict(os.environ, **({"CUDA_RUNNER_FULL_EXIT": "1"} if full_exit else {}))
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "cuda_runner", "run", str(bundle), "-i", str(input_file), "-q"], env=env, capture_output=True, text=True)
        samples.append(time.perf_counter() - started)
        if result.returncode != 0:
            return {"error": result.stderr.strip()[-500:]}
    return spread(samples)


def api(bundle: Path, input_file: Path, device: str, iterations: int, cuda_graph: bool = False) -> dict[str, Any]:
    plan = GivenInputs((ArrayFile(input_file),))
    request = BenchRequest(bundle=bundle, inputs=plan, device=device, load=LoadOptions(cuda_graph=cuda_graph), warmup_runs=20, iterations=iterations)
    return benchmark(request).to_json()


def eager(torch: Any, module: Any, array: np.ndarray, device: str, iterations: int) -> dict[str, Any]:
    module = module.to(device)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    host = torch.from_numpy(array)
    resident = host.to(device)

    def host_to_host():
        with torch.no_grad():
            return module(host.to(device)).cpu()

    def on_device():
        with torch.no_grad():
            module(resident)
        synchronize()

    results = {}
    for label, call in (("host_to_host", host_to_host), ("device_resident", on_device)):
        for _ in range(20):
            call()
        samples = []
        for _ in range(iterations):
            started = time.perf_counter()
            call()
            samples.append(time.perf_counter() - started)
        results[label] = spread(samples)
    return results


_AOTI_SCRIPT = """
import sys, time
started = time.perf_counter()
import torch
runner = torch._inductor.aoti_load_package(sys.argv[1])
x = torch.load(sys.argv[2])
if sys.argv[3] == "cuda":
    x = x.cuda()
out = runner(x)
if sys.argv[3] == "cuda":
    torch.cuda.synchronize()
print(time.perf_counter() - started)
"""


def torch_loader(torch: Any, module: Any, args: tuple, device: str, work: Path, repeats: int) -> dict[str, Any]:
    """torch's own AOTI package path, default options, each run a fresh process."""
    module = module.to(device)
    args = tuple(arg.to(device) for arg in args)
    package = work / f"torch-package-{device}.pt2"
    started = time.perf_counter()
    program = torch.export.export(module, args)
    torch._inductor.aoti_compile_and_package(program, package_path=str(package))
    log(f"compiled the torch AOTI package in {time.perf_counter() - started:.1f} s")
    torch.save(args[0].cpu(), work / "loader-input.pt")
    script = work / "aoti_loader.py"
    script.write_text(_AOTI_SCRIPT)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = subprocess.run([sys.executable, str(script), str(package), str(work / "loader-input.pt"), device], capture_output=True, text=True, timeout=300)
        samples.append(time.perf_counter() - started)
        if result.returncode != 0:
            reason = f"signal {-result.returncode}" if result.returncode < 0 else f"exit {result.returncode}"
            return {"error": f"crashed ({reason}): {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ''}"}
    return {"cold_process": spread(samples)}


def c_floor(bundle: Path, device: str, array: np.ndarray, work: Path, iterations: int) -> dict[str, Any]:
    from cuda_runner.runtime.shim import torch_library_dir

    binary = work / "bench_floor"
    if not binary.exists():
        build = subprocess.run(["cc", "-O2", "-o", str(binary), str(REPO / "scripts" / "bench_floor.c"), "-ldl"], capture_output=True, text=True)
        if build.returncode != 0:
            return {"error": build.stderr[-500:]}
    with open_bundle(bundle) as reader:
        spec = reader.manifest.methods["forward"]
        (work / "floor.so").write_bytes(bytes(reader.segment(spec.library_segment)))
        (work / "floor.blob").write_bytes(bytes(reader.segment(spec.weights_segment)))
    shape = "x".join(str(size) for size in array.shape)
    samples = []
    for _ in range(3):
        result = subprocess.run(
            [str(binary), str(torch_library_dir()), str(work / "floor.so"), str(work / "floor.blob"), device, str(iterations), f"6:{shape}"],
            capture_output=True, text=True, timeout=300,
        )
        if result.returncode != 0:
            return {"error": f"exit {result.returncode}: {result.stderr[-300:]}"}
        samples.append(float(result.stdout.strip()) * 1e-6)
    return {"per_call": spread(samples), "note": "mean per call over the iterations; spread over 3 processes"}


# ---------------------------------------------------------------------------
# GPU-only measurements


def pinned_bandwidth(nbytes: int) -> dict[str, float]:
    """Plain pinned<->device copies of `nbytes` with CuPy, the reference for our copies."""
    import cupy

    host = np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
    device = cupy.empty(nbytes, cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    results = {}
    for label, (destination, source, kind) in {
        "host_to_device": (device.data.ptr, host.ctypes.data, 1),
        "device_to_host": (host.ctypes.data, device.data.ptr, 2),
    }.items():
        times = []
        for _ in range(12):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            cupy.cuda.runtime.memcpyAsync(destination, source, nbytes, kind, stream.ptr)
            end.record(stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
        results[label] = nbytes / statistics.median(times[2:]) / 1e9
    return results


def staging_costs(nbytes: int) -> dict[str, Any]:
    """Host-side cost of getting a pageable array to the DMA engine: a copy into
    pinned staging (what the runtime does) against registering the array itself."""
    import cupy

    array = np.ones(nbytes, np.uint8)
    staging = np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
    copies, registrations = [], []
    for _ in range(8):
        started = time.perf_counter()
        np.copyto(staging, array)
        copies.append(time.perf_counter() - started)
        started = time.perf_counter()
        cupy.cuda.runtime.hostRegister(array.ctypes.data, nbytes, 0)
        cupy.cuda.runtime.hostUnregister(array.ctypes.data)
        registrations.append(time.perf_counter() - started)
    return {"copy_into_pinned_s": spread(copies[2:]), "register_and_unregister_s": spread(registrations[2:])}


def pinned_input_copies(bundle: Path, array: np.ndarray, runs: int = 20) -> dict[str, Any]:
    """The same run with the input already in the method's pinned buffer (Method.pinned_input)."""
    with cuda_runner.load(bundle) as model:
        method = model.method()
        name = method.spec.inputs[0].name
        pinned = method.pinned_input(name, array.shape)
        pinned[...] = array
        collected: dict[str, list[float]] = {}
        for index in range(runs + 3):
            phases: dict[str, float] = {}
            method.run({name: pinned}, phases=phases)
            if index >= 3:
                for key, value in phases.items():
                    collected.setdefault(key, []).append(value)
    return {key: spread(values) for key, values in collected.items()}


def copy_efficiency(api_result: dict[str, Any], pinned_split: dict[str, Any]) -> dict[str, Any]:
    pinned = pinned_bandwidth(api_result["input_bytes"])
    split = api_result["split_s"]
    ours = {
        "host_to_device": api_result["input_bytes"] / split["copy_in"]["median"] / 1e9,
        "device_to_host": api_result["output_bytes"] / split["copy_out"]["median"] / 1e9,
    }
    return {
        "bytes": api_result["input_bytes"],
        "pinned_gb_s": pinned,
        "cuda_runner_gb_s": ours,
        "fraction_of_pinned": {key: ours[key] / pinned[key] for key in ours},
        "end_to_end_gb_s": (api_result["input_bytes"] + api_result["output_bytes"]) / api_result["steady_s"]["median"] / 1e9,
        "pinned_input_host_to_device_gb_s": api_result["input_bytes"] / pinned_split["copy_in"]["median"] / 1e9,
        "staging": staging_costs(api_result["input_bytes"]),
    }


def weights_loading(torch: Any, work: Path, gib: float) -> dict[str, Any]:
    """Load a GiB-scale weights segment: registered as pinned (the runtime's path) vs the mapped blob passed directly."""
    width = int((gib * (1 << 30) / 4) ** 0.5) // 256 * 256
    module = torch.nn.Linear(width, width, bias=False).eval()
    bundle = compile_bundle(torch, "weights", module, (torch.randn(2, width),), "cuda", work)
    size = width * width * 4

    def drop_cache() -> None:
        fd = os.open(bundle, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def load_seconds(cold: bool) -> float:
        if cold:
            drop_cache()
        with cuda_runner.load(bundle, verify_weights=False) as model:
            return model.method().load_timings["load_weights"]

    import cuda_runner.runtime.method as method_module

    def load_unpinned(device: Any, container: Any, weights: memoryview) -> None:
        """The alternative: pass the pageable mapping to the library as it is."""
        import numpy as np
        from cupy_backends.cuda.api import runtime

        address = int(np.frombuffer(weights, np.uint8).ctypes.data) if weights.nbytes else 0
        container.load_weights(address, weights.nbytes)
        runtime.deviceSynchronize()

    results: dict[str, Any] = {"bytes": size}
    pinned_loader = method_module._load_weights
    for label, loader in (("registered_pinned", pinned_loader), ("mapped_direct", load_unpinned)):
        method_module._load_weights = loader  # measured side by side in this run
        try:
            load_seconds(cold=False)  # warm the page cache and the CUDA context
            for cache in ("warm", "cold"):
                samples = [load_seconds(cold=cache == "cold") for _ in range(3)]
                results[f"{label}_{cache}"] = {"seconds": spread(samples), "gb_s": size / statistics.median(samples) / 1e9}
        finally:
            method_module._load_weights = pinned_loader
    with open_bundle(bundle) as reader:
        spec = reader.manifest.methods["forward"]
        view = reader.segment(spec.weights_segment, verify=False)
        results["verify_weights_digest_s"] = spread([_timed_digest(view) for _ in range(3)])
        view.release()
    verified = [_load_total(bundle, True) for _ in range(3)]
    skipped = [_load_total(bundle, False) for _ in range(3)]
    results["load_total_verified_s"] = spread(verified)
    results["load_total_skip_weights_digest_s"] = spread(skipped)
    bundle.unlink()
    return results


def _load_total(bundle: Path, verify: bool) -> float:
    started = time.perf_counter()
    with cuda_runner.load(bundle, verify_weights=verify):
        pass
    return time.perf_counter() - started


def _timed_digest(view: memoryview) -> float:
    """The bundle's segment digest, on all cores, as the reader computes it."""
    from cuda_runner.format.digest import segment_digest

    started = time.perf_counter()
    segment_digest(view)
    return time.perf_counter() - started


def digest_speed(gib: float) -> dict[str, Any]:
    """Seconds to hash `gib` GiB in memory: plain XXH3-128 and SHA-256 on one core, and the
    bundle's chunked digest on all cores (and BLAKE3 on one core, if installed)."""
    import xxhash

    from cuda_runner.format.digest import segment_digest

    data = np.random.default_rng(0).integers(0, 255, int(gib * (1 << 30)), dtype=np.uint8).tobytes()
    hashers = {
        "xxh3-128 (1 core)": lambda: xxhash.xxh3_128_hexdigest(data),
        "sha256 (1 core)": lambda: hashlib.sha256(data).hexdigest(),
        f"bundle digest xxh3-128-tree16m ({os.cpu_count()} cores)": lambda: segment_digest(data),
    }
    try:
        import blake3

        hashers["blake3 (1 thread)"] = lambda: blake3.blake3(data).hexdigest()
    except ImportError:
        pass
    results = {}
    for name, function in hashers.items():
        samples = []
        for _ in range(3):
            started = time.perf_counter()
            function()
            samples.append(time.perf_counter() - started)
        results[name] = {"seconds": spread(samples), "gb_s": len(data) / statistics.median(samples) / 1e9}
    return {"bytes": len(data), "hashes": results}


# ---------------------------------------------------------------------------


def machine_info(torch: Any, device: str) -> dict[str, Any]:
    info = {
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "cpu": _cpu_model(), "torch": torch.__version__, "numpy": np.__version__, "cuda_runner": cuda_runner.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    if device == "cuda":
        import cupy

        info["gpu"] = torch.cuda.get_device_name(0)
        info["cupy"] = cupy.__version__
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--output", type=Path, required=True, help="JSON results")
    parser.add_argument("--markdown", type=Path, help="write the markdown tables here too")
    parser.add_argument("--weights-gib", type=float, default=1.0, help="GPU: size of the weights-loading model (0 to skip)")
    parser.add_argument("--digest-gib", type=float, default=1.0)
    parser.add_argument("--cold-repeats", type=int, default=5)
    parser.add_argument("--skip-torch-loader", action="store_true")
    options = parser.parse_args()

    import torch

    device = options.device
    work = Path(tempfile.mkdtemp(prefix="cuda-runner-bench-"))
    report: dict[str, Any] = {"machine": machine_info(torch, device), "device": device, "models": {}}
    try:
        for name, (module, args) in build_models(torch).items():
            bundle = compile_bundle(torch, name, module, args, device, work)
            array = args[0].numpy()
            np.save(work / f"{name}-x.npy", array)
            iterations = 2000 if name == "mlp" else 30
            entry: dict[str, Any] = {"input_shape": list(array.shape)}
            log(f"{name}: cold CLI")
            entry["cli_cold_s"] = cli_cold(bundle, work / f"{name}-x.npy", options.cold_repeats)
            entry["cli_cold_full_exit_s"] = cli_cold(bundle, work / f"{name}-x.npy", options.cold_repeats, full_exit=True)
            log(f"{name}: in-process API")
            entry["api"] = api(bundle, work / f"{name}-x.npy", device, iterations)
            log(f"{name}: eager")
            entry["eager_s"] = eager(torch, module, array, device, iterations)
            if name == "mlp" and device == "cuda":
                log(f"{name}: in-process API with a CUDA graph")
                entry["api_cuda_graph"] = api(bundle, work / f"{name}-x.npy", device, iterations, cuda_graph=True)
            if name == "mlp":
                log(f"{name}: C floor")
                entry["c_floor_s"] = c_floor(bundle, device, array, work, 5000)
                if not options.skip_torch_loader:
                    log(f"{name}: torch AOTI loader")
                    entry["torch_loader"] = torch_loader(torch, module, args, device, work, options.cold_repeats)
            if name == "big_io" and device == "cuda":
                entry["copies"] = copy_efficiency(entry["api"], pinned_input_copies(bundle, array))
            report["models"][name] = entry
        if device == "cuda" and options.weights_gib > 0:
            log("weights loading")
            report["weights"] = weights_loading(torch, work, options.weights_gib)
        if options.digest_gib > 0:
            log("digest speed")
            report["digest"] = digest_speed(options.digest_gib)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    options.output.write_text(json.dumps(report, indent=2) + "\n")
    markdown = render_markdown(report)
    if options.markdown:
        options.markdown.write_text(markdown)
    print(markdown)
    return 0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _spread_ms(stats: dict[str, Any]) -> str:
    """Median (min-max) in milliseconds, from a LatencyStats JSON."""
    return f"{_ms(stats['median'])} ({_ms(stats['min'])}-{_ms(stats['max'])})"


def _cell(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "n/a"
    if "error" in stats:
        return stats["error"].replace("|", "/")[:80]
    return f"{_ms(stats['median'])} ({_ms(stats['min'])}-{_ms(stats['max'])})"


def render_markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [
        f"Machine: {machine.get('gpu', machine['cpu'])}, {machine['cpus']} CPUs; python {machine['python']}, "
        f"torch {machine['torch']}, numpy {machine['numpy']}" + (f", cupy {machine['cupy']}" if "cupy" in machine else "")
        + f"; cuda-runner {machine['cuda_runner']}; {machine['date']}.",
        "",
        "Times in ms: median (min-max) over the runs stated.",
        "",
    ]
    for name, entry in report["models"].items():
        api_result = entry["api"]
        loader = entry.get("torch_loader", {})
        lines += [
            f"### {name} (input {'x'.join(map(str, entry['input_shape']))}, {report['device']})",
            "",
            "| contender | what is timed | ms |",
            "| --- | --- | --- |",
            f"| cuda-runner CLI, cold process | `cuda-runner run` wall, {entry['cli_cold_s'].get('n', 0)} processes | {_cell(entry['cli_cold_s'])} |",
        ]
        if "cli_cold_full_exit_s" in entry:
            lines.append(f"| cuda-runner CLI, cold, full interpreter teardown | as above with CUDA_RUNNER_FULL_EXIT=1 | {_cell(entry['cli_cold_full_exit_s'])} |")
        if loader:
            loader_cell = _cell(loader.get("cold_process")) if "cold_process" in loader else loader.get("error", "n/a")
            lines.append(f"| torch `aoti_load_package` script, cold process | import torch, load package, run once | {loader_cell} |")
        steady = api_result["steady_s"]
        lines.append(f"| cuda-runner API, host arrays | one run, copies included, {steady['count']} runs | {_spread_ms(steady)} |")
        if entry.get("api_cuda_graph"):
            graph = entry["api_cuda_graph"]["steady_s"]
            lines.append(f"| cuda-runner API, host arrays, `--cuda-graph` | one replay, copies included, {graph['count']} runs | {_spread_ms(graph)} |")
        if api_result.get("device_resident_s"):
            resident = api_result["device_resident_s"]
            lines.append(f"| cuda-runner API, device arrays | run_device + synchronize, {resident['count']} runs | {_spread_ms(resident)} |")
        lines.append(f"| eager PyTorch, host tensors | to(device), forward, to cpu | {_cell(entry['eager_s']['host_to_host'])} |")
        if report["device"] == "cuda":
            lines.append(f"| eager PyTorch, device tensors | forward + synchronize | {_cell(entry['eager_s']['device_resident'])} |")
        if "c_floor_s" in entry:
            lines.append(f"| C program calling Run | wrap inputs, Run, free outputs; mean per call | {_cell(entry['c_floor_s'].get('per_call', entry['c_floor_s']))} |")
        split = api_result["split_s"]
        lines += ["", "Split of the API run (" + ("CUDA events" if report["device"] == "cuda" else "host timers") + "): "
                  + ", ".join(f"{key} {_ms(stats['median'])} ms" for key, stats in split.items())
                  + "; load: " + ", ".join(f"{key} {_ms(value)} ms" for key, value in api_result["load_s"].items())
                  + f"; first run {_ms(api_result['first_run_s'])} ms (with and without the load's warm-up in fresh processes: "
                  + "scripts/profile_cold_start.py).", ""]
        if "copies" in entry:
            copies = entry["copies"]
            lines += [
                f"Copies of {copies['bytes'] / (1 << 20):.0f} MiB: host to device {copies['cuda_runner_gb_s']['host_to_device']:.1f} GB/s "
                f"against {copies['pinned_gb_s']['host_to_device']:.1f} GB/s for a plain pinned copy "
                f"({copies['fraction_of_pinned']['host_to_device']:.0%}); device to host {copies['cuda_runner_gb_s']['device_to_host']:.1f} GB/s "
                f"against {copies['pinned_gb_s']['device_to_host']:.1f} GB/s ({copies['fraction_of_pinned']['device_to_host']:.0%}). "
                f"With the input already in the method's pinned buffer (`Method.pinned_input`), host to device runs at "
                f"{copies['pinned_input_host_to_device_gb_s']:.1f} GB/s ({copies['pinned_input_host_to_device_gb_s'] / copies['pinned_gb_s']['host_to_device']:.0%} of pinned). "
                f"End to end (host array in, host array out, both directions counted): {copies['end_to_end_gb_s']:.1f} GB/s. "
                f"Host-side staging of one input: copy into pinned {_cell(copies['staging']['copy_into_pinned_s'])} ms, "
                f"register + unregister the array instead {_cell(copies['staging']['register_and_unregister_s'])} ms.",
                "",
            ]
    if "weights" in report:
        weights = report["weights"]
        lines += [f"### Weights loading ({weights['bytes'] / (1 << 30):.2f} GiB segment)", "", "| source | page cache | GB/s | seconds |", "| --- | --- | --- | --- |"]
        for key, label in (("registered_pinned", "mapping registered as pinned (cuda-runner)"), ("mapped_direct", "mapping passed directly")):
            for cache in ("warm", "cold"):
                result = weights[f"{key}_{cache}"]
                lines.append(f"| {label} | {cache} | {result['gb_s']:.1f} | {_cell(result['seconds'])} |")
        lines += ["", f"Whole load (open, digests, library, container, weights): {_cell(weights['load_total_verified_s'])} ms with the weights digest, "
                  f"{_cell(weights['load_total_skip_weights_digest_s'])} ms with `--skip-weights-digest`; "
                  f"the segment digest alone, on all cores, {_cell(weights['verify_weights_digest_s'])} ms.", ""]
    if "digest" in report:
        digest = report["digest"]
        lines += [f"### Digest of {digest['bytes'] / (1 << 30):.0f} GiB in memory", "", "| hash | GB/s | seconds |", "| --- | --- | --- |"]
        for name, result in digest["hashes"].items():
            lines.append(f"| {name} | {result['gb_s']:.2f} | {_cell(result['seconds'])} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
