"""CPU per call: cuda-runner bundles against torch's own `aoti_load_package`
of the same exported program, in one process (docs/benchmarks.md).

For each model the program is exported once and saved; it is compiled
  - by `cuda-runner compile --device cpu` (a fresh process, as a user runs it),
    once per `--cpu-target` asked for (portable, the default, and native), and
  - by `torch._inductor.aoti_compile_and_package` (default options),
then every build is loaded in this process (`cuda_runner.load` and
`torch._inductor.aoti_load_package`), its outputs checked against the others
and against eager PyTorch on the same inputs, warmed up, and timed call by
call in alternating rounds (the order rotates each round, so drift on the
machine hits every contender alike). Each cuda-runner call is `Model.run` on
NumPy arrays with NumPy outputs (the outputs are copied out of the library's
tensors); each torch call is the package's runner on tensors that share the
same NumPy memory, returning the library's tensors. The C++ run beneath that
runner (`loader.boxed_run`, without the runner's pytree handling) is timed
too, as a reference.

Each bundle runs on both providers (cuda-runner's shim: its BLAS, convolution
and vector math; and libtorch), and on the shim once more in a process where
`import torch` fails (timed after the interleaved rounds).

    python scripts/bench_cpu.py [--quick] [--models vector_math,decoder,resnet,tiny,mlp,mlp_wide,convnet] [--targets portable,native] [--threads N]
                                [--output cpu-per-call.json] [--markdown cpu-per-call.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
GOAL = 1.1  # cuda-runner's median per call at most 1.1x the torch package's
TORCH = "torch package"
BOXED = "torch package, boxed_run"


def log(message: str) -> None:
    print(f"[bench-cpu] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Models: (module, example args, what the input is)


def build_models(torch: Any) -> dict[str, tuple[Any, tuple, str]]:
    nn = torch.nn

    class NormMLP(nn.Module):
        """LayerNorm, Linear, GELU, Linear, softmax: GEMMs (library calls) and
        generated kernels (the norm, GELU and softmax) in one program."""

        def __init__(self, width: int, hidden: int):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, hidden)
            self.down = nn.Linear(hidden, width)

        def forward(self, x):
            return torch.softmax(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))), dim=-1)

    class ConvNet(nn.Module):
        """Two convolutions with batch norm (folded in eval), pooling and a linear head."""

        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            )
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            return self.head(torch.flatten(self.features(x), 1))

    class Tiny(nn.Module):
        """One small elementwise kernel: what each call costs beyond the model."""

        def forward(self, x):
            return x * 2.0 + 1.0

    class VectorMath(nn.Module):
        """LayerNorm, exact GELU (erf) and softmax (exp): generated vector code and its SLEEF calls, no GEMM."""

        def __init__(self, width: int):
            super().__init__()
            self.norm = nn.LayerNorm(width)

        def forward(self, x):
            return torch.softmax(torch.nn.functional.gelu(self.norm(x)), dim=-1)

    sys.path.insert(0, str(REPO / "scripts"))
    import scale_models

    class Decoder(nn.Module):
        """scripts/scale_models.py's Llama-shaped decoder in float32 at a small size, a 64-token prefill: GEMM-heavy."""

        def __init__(self):
            super().__init__()
            config = scale_models.LlamaConfig(vocab=2048, dim=512, layers=4, heads=8, kv_heads=4, ffn=1536, max_seq=128)
            self.inner = scale_models.LlamaDecoder(config, torch.float32)

        def forward(self, tokens, input_pos):
            return self.inner.prefill(tokens, input_pos)

    torch.manual_seed(0)
    return {
        "vector_math": (VectorMath(1024).eval(), (torch.randn(256, 1024),), "256x1024 float32; LayerNorm, GELU (erf), softmax: vector math, no GEMM"),
        "decoder": (Decoder().eval(), (torch.randint(0, 2048, (1, 64)), torch.arange(64)),
                    "a 64-token prefill of a 4-layer Llama-shaped decoder (dim 512, FFN 1536, GQA 8/4 heads, vocabulary 2048), float32"),
        "resnet": (scale_models.randomize_batch_norms(scale_models.ResNet(blocks=(1, 1, 1), width=16, classes=10)).eval(), (torch.randn(4, 3, 64, 64),),
                   "4x3x64x64 float32; ResNet-50's code with one bottleneck per stage, base width 16"),
        "tiny": (Tiny().eval(), (torch.randn(8, 16),), "8x16 float32; x * 2 + 1 (per-call overhead)"),
        "mlp": (NormMLP(256, 1024).eval(), (torch.randn(8, 256),), "8x256 float32; LayerNorm, Linear 256->1024, GELU, Linear 1024->256, softmax"),
        "mlp_wide": (NormMLP(4096, 1024).eval(), (torch.randn(256, 4096),), "256x4096 float32; the same at width 4096 (hidden 1024)"),
        "convnet": (ConvNet().eval(), (torch.randn(4, 3, 64, 64),), "4x3x64x64 float32; Conv 3->16, BN, ReLU, MaxPool, Conv 16->32, BN, ReLU, AvgPool, Linear 32->10"),
    }


# ---------------------------------------------------------------------------
# Builds


def compile_with_cli(program_file: Path, bundle: Path, target: str) -> float:
    """`cuda-runner compile --device cpu --cpu-target TARGET --standalone`, as a fresh process; seconds.
    --standalone: attention lowered from SDPA's math form, which the shim runs (it has no flash attention)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "cuda_runner", "compile", str(program_file), "-o", str(bundle), "--device", "cpu", "--cpu-target", target,
               "--standalone"]
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"cuda-runner compile failed (exit {result.returncode}):\n{result.stderr.strip()[-2000:]}")
    return time.perf_counter() - started


def compile_torch_package(torch: Any, program: Any, package: Path) -> float:
    started = time.perf_counter()
    torch._inductor.aoti_compile_and_package(program, package_path=str(package))
    return time.perf_counter() - started


# ---------------------------------------------------------------------------
# Timing


def timed_calls(call: Callable[[], Any], calls: int) -> list[float]:
    clock = time.perf_counter
    samples = []
    for _ in range(calls):
        started = clock()
        call()
        samples.append(clock() - started)
    return samples


def warm_up(call: Callable[[], Any], calls: int, seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    for done in range(max(calls, 1) * 100):
        call()
        if done + 1 >= calls and time.perf_counter() >= deadline:
            break


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(samples: list[float]) -> dict[str, float]:
    return {"n": len(samples), "median": statistics.median(samples), "p10": percentile(samples, 0.1), "p90": percentile(samples, 0.9),
            "min": min(samples), "mean": statistics.fmean(samples)}


def interleaved(contenders: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, Any]:
    """Every contender in every round, the order rotated each round; per-call
    samples pooled over the rounds, and each round's median kept."""
    labels = list(contenders)
    samples: dict[str, list[float]] = {label: [] for label in labels}
    round_medians: dict[str, list[float]] = {label: [] for label in labels}
    for index in range(rounds):
        shift = index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            taken = timed_calls(contenders[label], calls)
            samples[label].extend(taken)
            round_medians[label].append(statistics.median(taken))
    return {label: {**summary(samples[label]), "round_medians": round_medians[label]} for label in labels}


def calls_for(per_call: float, budget: float, low: int, high: int) -> int:
    """Calls per contender and round to fill about `budget` seconds."""
    return max(low, min(high, int(budget / max(per_call, 1e-6))))


# ---------------------------------------------------------------------------
# One model


def bench_model(torch: Any, name: str, module: Any, args: tuple, targets: list[str], work: Path, rounds: int, budget: float) -> dict[str, Any]:
    import cuda_runner

    program = torch.export.export(module, args)
    program_file = work / f"{name}.pt2"
    torch.export.save(program, str(program_file))
    # torch's package first, so that its vector-ISA probe runs (and is cached
    # for this process) before any other build has written to the cache.
    package = work / f"{name}-torch.pt2"
    compile_seconds = {TORCH: compile_torch_package(torch, program, package)}
    log(f"{name}: aoti_compile_and_package in {compile_seconds[TORCH]:.1f} s")
    bundles = {}
    for target in targets:
        bundles[target] = work / f"{name}-{target}.bundle"
        compile_seconds[f"cuda-runner {target}"] = compile_with_cli(program_file, bundles[target], target)
        log(f"{name}: cuda-runner compile --cpu-target {target} in {compile_seconds[f'cuda-runner {target}']:.1f} s")

    arrays = [arg.numpy() for arg in args]
    tensors = [torch.from_numpy(array) for array in arrays]  # the same memory as the NumPy inputs
    runner = torch._inductor.aoti_load_package(str(package))
    # Each bundle on both providers: cuda-runner's shim (its BLAS, convolution and vector math) and libtorch's.
    models = {f"{target} ({provider})": cuda_runner.load(bundles[target], device="cpu", provider=provider)
              for target in targets for provider in ("shim", "libtorch")}
    isa = {TORCH: runner.get_metadata().get("AOTI_CPU_ISA")}
    isa.update({f"cuda-runner {target}": model.method().spec.device.cpu_isa for target, model in models.items()})
    log(f"{name}: vector ISA of each build: {isa}")
    try:
        input_names = [spec.name for spec in next(iter(models.values())).method().spec.inputs]
        feeds = dict(zip(input_names, arrays))
        # The package's runner parses its pytree specs and flattens the inputs
        # on every call; `loader.boxed_run` is the C++ run beneath it (a fresh
        # list each call: it takes the tensors out of the one it is given).
        contenders: dict[str, Callable[[], Any]] = {TORCH: lambda: runner(*tensors), BOXED: lambda: runner.loader.boxed_run(list(tensors))}
        for target, model in models.items():
            contenders[f"cuda-runner {target}"] = lambda model=model: model.run(feeds)

        with torch.no_grad():
            reference = module(*tensors).numpy()
        theirs = contenders[TORCH]()
        theirs = (theirs[0] if isinstance(theirs, (list, tuple)) else theirs).numpy()
        errors = {TORCH: float(np.max(np.abs(theirs - reference)))}
        for target, model in models.items():
            ours = next(iter(model.run(feeds).values()))
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5, err_msg=f"{name}: cuda-runner {target} against the torch package")
            errors[f"cuda-runner {target}"] = float(np.max(np.abs(ours - reference)))

        for call in contenders.values():
            warm_up(call, 20, 0.5)
        probe = min(statistics.median(timed_calls(call, 5)) for call in contenders.values())
        calls = calls_for(probe, budget, 5, 10000)
        log(f"{name}: {rounds} rounds of {calls} calls per contender (about {probe * 1e3:.3f} ms per call)")
        results = interleaved(contenders, rounds, calls)
    finally:
        for model in models.values():
            model.close()
    for target in targets:  # the shim where torch is not installed at all: a process where `import torch` fails
        results[f"cuda-runner {target} (shim, no torch)"] = without_torch(bundles[target], feeds, work, rounds * calls)
    for stats in results.values():
        for key, against in (("ratio", TORCH), ("ratio_boxed", BOXED)):
            stats[key] = stats["median"] / results[against]["median"]
            stats[f"round_{key}s"] = [ours / theirs for ours, theirs in zip(stats["round_medians"], results[against]["round_medians"])]
    return {"calls_per_round": calls, "rounds": rounds, "compile_s": compile_seconds, "cpu_isa": isa, "max_abs_error_vs_eager": errors, "contenders": results}


NO_TORCH_TIMING = """
import sys
sys.modules["torch"] = None  # `import torch` fails: torch is absent as far as this process can tell
import json, statistics, time, numpy as np, cuda_runner
bundle, inputs, calls = sys.argv[1], dict(np.load(sys.argv[2])), int(sys.argv[3])
with cuda_runner.load(bundle, device="cpu") as model:
    assert model.method().provider == "cuda-runner shim"
    for _ in range(20):
        model.run(inputs)
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        model.run(inputs)
        samples.append(time.perf_counter() - started)
print(json.dumps(samples))
"""


def without_torch(bundle: Path, feeds: dict[str, np.ndarray], work: Path, calls: int) -> dict[str, Any]:
    """Per-call times of a bundle in a process without torch (measured after the interleaved rounds, not among them)."""
    np.savez(work / "no-torch-inputs.npz", **feeds)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", NO_TORCH_TIMING, str(bundle), str(work / "no-torch-inputs.npz"), str(calls)],
                          capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the no-torch timing failed:\n{done.stderr.strip()[-2000:]}")
    samples = json.loads(done.stdout.strip().splitlines()[-1])
    stats = summary(samples)
    size = max(1, len(samples) // 5)
    stats["round_medians"] = [statistics.median(samples[index:index + size]) for index in range(0, len(samples), size)][:5]
    return stats


# ---------------------------------------------------------------------------
# Machine and report


def machine_info(torch: Any) -> dict[str, Any]:
    import cuda_runner

    return {
        "cpu": _cpu_model(), "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "machine": platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__, "cuda_runner": cuda_runner.__version__,
        "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d"),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.2f}"


def render_markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [
        f"Machine: {machine['cpu']}, {machine['cpus']} CPUs ({machine['affinity']} usable), torch {machine['torch']} "
        f"({machine['torch_threads']} intra-op threads), python {machine['python']}, numpy {machine['numpy']}; "
        f"load average at the start {machine['load_average'][0]:.2f}; {machine['date']}.",
        "",
        "ms per call: median (p10-p90) over all rounds. Ratio: median / the torch package's median (its runner called "
        "as `runner(x)`), with the range of the per-round ratios; against boxed_run: / the median of the C++ run "
        "beneath that runner.",
        "",
        "| model | contender | ms per call | ratio (rounds) | against boxed_run | <= 1.1x? |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, result in report["models"].items():
        for label, stats in result["contenders"].items():
            spread = f"{_ms(stats['median'])} ({_ms(stats['p10'])}-{_ms(stats['p90'])})"
            rounds = stats["round_ratios"]
            ratio = f"{stats['ratio']:.2f} ({min(rounds):.2f}-{max(rounds):.2f})"
            verdict = "" if label in (TORCH, BOXED) else "yes" if stats["ratio"] <= GOAL else "no"
            lines.append(f"| {name} | {label} | {spread} | {ratio} | {stats['ratio_boxed']:.2f} | {verdict} |")
    lines.append("")
    lines.append("Models: " + "; ".join(f"`{name}` {result['model']}" for name, result in report["models"].items()) + ".")
    isas = {f"{label}: {isa}" for result in report["models"].values() for label, isa in result["cpu_isa"].items()}
    lines.append("Vector ISA of the builds: " + ", ".join(sorted(isas)) + ".")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="all but the wide MLP, portable only, 3 short rounds")
    parser.add_argument("--models", help="comma-separated: vector_math, decoder, resnet, tiny, mlp, mlp_wide, convnet (default: all; --quick: tiny,mlp,convnet)")
    parser.add_argument("--targets", help="comma-separated --cpu-target values (default: portable,native; --quick: portable)")
    parser.add_argument("--rounds", type=int, help="rounds per model (default 9; --quick 3)")
    parser.add_argument("--round-seconds", type=float, help="about how long each contender runs per round (default 1.0; --quick 0.3)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads(N) first: the OpenMP threads of the calling thread, "
                        "which both the package's and cuda-runner's calls run on (default: torch's own)")
    parser.add_argument("--output", type=Path, help="write the JSON report here")
    parser.add_argument("--markdown", type=Path, help="write the markdown table here")
    options = parser.parse_args()
    quick = options.quick
    names = (options.models or ("tiny,mlp,convnet" if quick else "vector_math,decoder,resnet,tiny,mlp,mlp_wide,convnet")).split(",")
    targets = (options.targets or ("portable" if quick else "portable,native")).split(",")
    rounds = options.rounds or (3 if quick else 9)
    budget = options.round_seconds or (0.3 if quick else 1.0)

    import torch

    if options.threads:
        torch.set_num_threads(options.threads)
    models = build_models(torch)
    unknown = [name for name in names if name not in models]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(models)}")
    report: dict[str, Any] = {"machine": machine_info(torch), "goal_ratio": GOAL, "models": {}}
    with tempfile.TemporaryDirectory(prefix="cuda-runner-bench-cpu-") as folder:
        # A fresh Inductor cache (the compile subprocesses inherit it): Inductor
        # keys its ISA probe library without the link flags, so a probe built
        # by a link_libtorch=False compile, left in a shared cache, fails to
        # load in torch's own compile, which then writes scalar code
        # (INVALID_VEC_ISA) without a word.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor-cache")
        for name in names:
            module, args, what = models[name]
            result = bench_model(torch, name, module, args, targets, Path(folder), rounds, budget)
            report["models"][name] = {"model": what, **result}
    markdown = render_markdown(report)
    if options.output:
        options.output.write_text(json.dumps(report, indent=2) + "\n")
    if options.markdown:
        options.markdown.write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
