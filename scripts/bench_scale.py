#!/usr/bin/env python3
"""Models at the sizes users ship, on one GPU (docs/benchmarks.md, "NVIDIA H200").

Stages (each writes WORK/<stage>.json and prints it; later stages reuse what
earlier ones left in WORK, so a second call on a warm machine can continue):

  compile  the 1B Llama-shaped decoder of scripts/scale_models.py (bf16,
           random weights made on the GPU from a fixed seed, never carried),
           prefill and decode sharing weights and cache, compiled twice in
           parallel processes: the default (standalone) and --libtorch; the
           compile time of each.
  check    each bundle against eager: a prefill of 32 tokens, 128 decode steps
           fed eager's greedy tokens, logits compared at every step; then
           reset_state and a second prompt. Load time and rate of the weights,
           GPU memory at its peak against weights + KV cache.
  decode   per decode step, in one process: cuda-runner (default and
           --libtorch bundles, with and without --cuda-graph, Method.run on
           host arrays as `bench --steps` drives it), eager PyTorch,
           torch.compile(mode="reduce-overhead"), torch's aoti_load_package of
           the same decode program, and the HBM floor (weight bytes / 4.8 TB/s);
           a CUPTI kernel profile of the fastest cuda-runner path; and
           `cuda-runner bench --steps` through the CLI.
  big      ViT-B/16 (224x224), ResNet-50 and a Whisper-base-shaped encoder-decoder
           (30 s of log-mel, decoder steps with its cache): compiled, run
           through the CLI with --expected against eager, and timed against
           eager and torch.compile; the CLI's copies and checks as a share of a call.

    python3 scripts/bench_scale.py --stages compile,check,decode --work /tmp/scale --out $OUT
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import scale_models  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200
PROMPT, STEPS = 32, 128


def log(message: str) -> None:
    print(f"[bench-scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda fraction: ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]  # noqa: E731
    return {"median_ms": round(statistics.median(ordered) * 1e3, 4), "p10_ms": round(pick(0.1) * 1e3, 4), "p90_ms": round(pick(0.9) * 1e3, 4),
            "p99_ms": round(pick(0.99) * 1e3, 4), "n": len(ordered)}


def build_llama(config=scale_models.LLAMA_1B):
    import torch

    torch.manual_seed(0)
    with torch.device("cuda"):
        module = scale_models.LlamaDecoder(config).eval()
    return module


# ---------------------------------------------------------------------------
# compile

COMPILE_ONE = """
import sys, time, json
sys.path.insert(0, {scripts!r}); sys.path.insert(0, {root!r})
import bench_scale, scale_models, cuda_runner
module = bench_scale.build_llama()
notes = []
started = time.perf_counter()
cuda_runner.compile_methods(module, scale_models.llama_examples(module.config, bench_scale.PROMPT, "cuda"), {path!r}, device="cuda",
                            dynamic_shapes=scale_models.llama_dynamic_shapes(module.config), runtime={runtime!r}, warn=notes.append,
                            progress=lambda m: print(m, file=sys.stderr, flush=True))
print(json.dumps({{"seconds": round(time.perf_counter() - started, 1), "notes": notes}}))
"""


def stage_compile(work: Path) -> dict[str, Any]:
    jobs = {}
    for runtime in ("auto", "libtorch"):
        path = work / f"llama1b-{runtime}.bundle"
        code = COMPILE_ONE.format(scripts=str(ROOT / "scripts"), root=str(ROOT), path=str(path), runtime=runtime)
        log_file = open(work / f"compile-{runtime}.log", "w")  # noqa: SIM115  (closed when the process is waited for)
        jobs[runtime] = (subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log_file, text=True), log_file, time.perf_counter())
    results = {}
    for runtime, (process, log_file, started) in jobs.items():
        out, _ = process.communicate()
        log_file.close()
        wall = round(time.perf_counter() - started, 1)
        if process.returncode == 0:
            results[runtime] = {**json.loads(out.strip().splitlines()[-1]), "wall_s": wall}
        else:
            tail = (work / f"compile-{runtime}.log").read_text().strip().splitlines()[-3:]
            results[runtime] = {"error": " | ".join(tail), "wall_s": wall}
        log(f"compile {runtime}: {results[runtime]}")
    return results


# ---------------------------------------------------------------------------
# check

def eager_generation(module, prompt: np.ndarray, steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Eager logits of a prefill and `steps` greedy decodes, and the tokens it chose."""
    import torch

    eager = copy.deepcopy(module)
    logits, tokens = [], []
    with torch.no_grad():
        out = eager.prefill(torch.from_numpy(prompt).cuda(), torch.arange(prompt.shape[1], device="cuda"))
        for step in range(steps + 1):
            logits.append(out.float().cpu().numpy())
            token = int(out.argmax())
            tokens.append(token)
            if step == steps:
                break
            out = eager.decode(torch.tensor([[token]], device="cuda"), torch.tensor([prompt.shape[1] + step], device="cuda"))
    del eager
    torch.cuda.empty_cache()
    return logits, tokens


def free_bytes() -> int:
    import cupy

    return int(cupy.cuda.runtime.memGetInfo()[0])


def check_bundle(path: Path, module, prompts: list[np.ndarray], references) -> dict[str, Any]:
    import cuda_runner

    free_before = free_bytes()
    started = time.perf_counter()
    with cuda_runner.load(path) as model:
        load_s = time.perf_counter() - started
        timings = {name: model.load_timings(name) for name in model.methods}
        lowest = free_bytes()
        report: dict[str, Any] = {"load_s": round(load_s, 3), "load_timings": timings, "provider": model.method("decode").provider}
        worst = []
        for index, (prompt, (logits, tokens)) in enumerate(zip(prompts, references)):
            if index:
                model.reset_state()
            got = model.run({"tokens": prompt, "input_pos": np.arange(prompt.shape[1])}, "prefill")["output_0"]
            errors = [float(np.abs(got.astype(np.float32) - logits[0]).max())]
            for step in range(len(tokens) - 1):
                out = model.run({"tokens": np.array([[tokens[step]]]), "input_pos": np.array([prompt.shape[1] + step])}, "decode")["output_0"]
                errors.append(float(np.abs(out.astype(np.float32) - logits[step + 1]).max()))
                lowest = min(lowest, free_bytes())
            scale = float(max(np.abs(value).max() for value in logits))
            worst.append({"prompt": index, "max_abs_error": max(errors), "logit_scale": scale, "steps": len(errors) - 1,
                          "relative": round(max(errors) / scale, 5)})
        report["generations"] = worst
    weights, cache = module.parameter_bytes(), module.cache_bytes()
    peak = free_before - lowest
    report.update({"weight_bytes": weights, "cache_bytes": cache, "peak_gpu_bytes": peak, "peak_over_weights_and_cache": round(peak / (weights + cache), 3)})
    shared = sum(timings.get("decode", {}).values()) if timings else 0
    load_weights = sum(phase.get("load_weights", 0.0) for phase in timings.values())
    report["weights_gb_per_s"] = round(weights / load_weights / 1e9, 2) if load_weights else None
    report["decode_load_s"] = round(shared, 3)
    return report


def stage_check(work: Path) -> dict[str, Any]:
    import torch

    module = build_llama()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, module.config.vocab, (1, PROMPT), dtype=np.int64) for _ in range(2)]
    started = time.perf_counter()
    references = [eager_generation(module, prompt, STEPS if index == 0 else 16) for index, prompt in enumerate(prompts)]
    results: dict[str, Any] = {"eager_reference_s": round(time.perf_counter() - started, 1)}
    del module
    torch.cuda.empty_cache()
    module = build_llama()  # the same weights again, for the byte counts (the eager copies are gone)
    for runtime in ("auto", "libtorch"):
        path = work / f"llama1b-{runtime}.bundle"
        if path.exists():
            try:
                results[runtime] = check_bundle(path, module, prompts, references)
            except Exception as error:  # reported, and the next bundle is still checked
                results[runtime] = {"error": f"{type(error).__name__}: {error}"}
            log(f"check {runtime}: {json.dumps(results[runtime])[:600]}")
    page_cache = subprocess.run(["sh", "-c", f"cat {work / 'llama1b-auto.bundle'} > /dev/null"], capture_output=True)
    results["page_cache_warm"] = page_cache.returncode == 0
    return results


# ---------------------------------------------------------------------------
# decode

def time_steps(step, count: int, warmup: int = 10) -> list[float]:
    import torch

    for index in range(warmup):
        step(index)
    torch.cuda.synchronize()
    samples = []
    for index in range(count):
        started = time.perf_counter()
        step(warmup + index)
        samples.append(time.perf_counter() - started)
    return samples


def stage_decode(work: Path, steps: int) -> dict[str, Any]:
    import torch

    import cuda_runner

    results: dict[str, Any] = {}
    module = build_llama()
    weights = module.parameter_bytes()
    results["hbm_floor_ms"] = round(weights / HBM_BYTES_PER_S * 1e3, 4)
    token = np.array([[1]], np.int64)

    def runner_step(model, graph: bool):
        def step(index):
            model.run({"tokens": token, "input_pos": np.array([PROMPT + index % 400], np.int64)}, "decode")
        return step

    for runtime in ("auto", "libtorch"):
        path = work / f"llama1b-{runtime}.bundle"
        if not path.exists():
            continue
        for graph in (False, True):
            label = f"cuda-runner {'default (standalone)' if runtime == 'auto' else '--libtorch'} bundle{', CUDA graph' if graph else ''}"
            try:
                with cuda_runner.load(path, cuda_graph=graph) as model:
                    results[label] = summary(time_steps(runner_step(model, graph), steps))
            except Exception as error:
                results[label] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            log(f"{label}: {results[label]}")
    # Peers: eager, torch.compile(reduce-overhead), torch's own AOTI package of the decode program.
    position = torch.tensor([PROMPT], device="cuda")
    tok = torch.tensor([[1]], device="cuda")
    with torch.no_grad():
        results["eager PyTorch"] = summary(time_steps(lambda i: (module.decode(tok, position), torch.cuda.synchronize()), steps))
        log(f"eager: {results['eager PyTorch']}")
        try:
            started = time.perf_counter()
            compiled = torch.compile(module.decode, mode="reduce-overhead", fullgraph=True)
            for _ in range(3):
                compiled(tok, position)
            results["torch.compile reduce-overhead compile_s"] = round(time.perf_counter() - started, 1)

            def compiled_step(index):
                torch.compiler.cudagraph_mark_step_begin()
                compiled(tok, position).clone()
                torch.cuda.synchronize()
            results["torch.compile(mode=reduce-overhead)"] = summary(time_steps(compiled_step, steps))
        except Exception as error:
            results["torch.compile(mode=reduce-overhead)"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        log(f"torch.compile: {results['torch.compile(mode=reduce-overhead)']}")
    try:
        from torch._inductor import aoti_compile_and_package, aoti_load_package

        started = time.perf_counter()

        class Decode(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, tokens, input_pos):
                return self.inner.decode(tokens, input_pos)

        program = torch.export.export(Decode(module), (tok, position))
        package = aoti_compile_and_package(program, package_path=str(work / "decode.pt2"))
        loaded = aoti_load_package(package)
        results["aoti_load_package compile_s"] = round(time.perf_counter() - started, 1)
        results["torch aoti_load_package"] = summary(time_steps(lambda i: (loaded(tok, position), torch.cuda.synchronize()), steps))
    except Exception as error:
        results["torch aoti_load_package"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    log(f"aoti package: {results['torch aoti_load_package']}")
    results["profile"] = profile_steps(work)
    return results


def profile_steps(work: Path) -> dict[str, Any]:
    """Where a decode step of the default bundle goes: CUPTI kernel times (torch.profiler sees every kernel in the process)."""
    import torch

    import cuda_runner

    path = work / "llama1b-auto.bundle"
    if not path.exists():
        return {}
    token = np.array([[1]], np.int64)
    with cuda_runner.load(path) as model:
        step = lambda index: model.run({"tokens": token, "input_pos": np.array([PROMPT + index], np.int64)}, "decode")  # noqa: E731
        for index in range(10):
            step(index)
        count = 20
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as profiler:
            started = time.perf_counter()
            for index in range(count):
                step(10 + index)
            wall = (time.perf_counter() - started) / count
    kernels: dict[str, list[float]] = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time_total * 1e-6 if hasattr(event, "device_time_total") else event.cuda_time_total * 1e-6)
    total = sum(sum(values) for values in kernels.values()) / count
    top = sorted(((sum(values) / count, name, len(values) // count) for name, values in kernels.items()), reverse=True)[:12]
    return {"wall_per_step_ms": round(wall * 1e3, 4), "kernel_time_per_step_ms": round(total * 1e3, 4),
            "kernels_per_step": sum(len(values) for values in kernels.values()) // count,
            "top": [{"kernel": name[:120], "ms_per_step": round(seconds * 1e3, 4), "launches_per_step": launches} for seconds, name, launches in top]}


def cli_bench(work: Path) -> dict[str, Any]:
    path = work / "llama1b-auto.bundle"
    done = subprocess.run([sys.executable, "-m", "cuda_runner", "bench", str(path), "--method", "decode", "--prefill", "prefill",
                           "--prompt-length", str(PROMPT), "--steps", "200", "--warmup", "20", "--range", "tokens=0:32000", "--json"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-500:]}
    return json.loads(done.stdout)["decode"]


# ---------------------------------------------------------------------------
# big models

def big_models():
    import torch

    torch.manual_seed(0)
    vit = scale_models.VisionTransformer(scale_models.VIT_B16).eval()
    resnet = scale_models.randomize_batch_norms(scale_models.resnet50()).eval()
    whisper = scale_models.Whisper(scale_models.WHISPER_BASE).eval()
    return {
        "vit_b16": (vit, {"forward": (torch.randn(1, 3, 224, 224),)}),
        "resnet50": (resnet, {"forward": (torch.randn(1, 3, 224, 224),)}),
        "whisper_base": (whisper, scale_models.whisper_examples(scale_models.WHISPER_BASE)),
    }


def stage_big(work: Path, steps: int) -> dict[str, Any]:
    import torch

    results: dict[str, Any] = {}
    for name, (module, methods) in big_models().items():
        results[name] = big_model(work, name, module.cuda(), methods, steps)
        log(f"{name}: {results[name]}")
        del module
        torch.cuda.empty_cache()
    return results


def big_model(work: Path, name: str, module: Any, methods: dict[str, tuple], steps: int) -> dict[str, Any]:
    """One model: compiled (the default), run through the CLI with --expected against eager, timed beside eager and torch.compile."""
    import torch

    import cuda_runner

    examples = {method: tuple(arg.cuda() for arg in args) for method, args in methods.items()}
    entry: dict[str, Any] = {"parameters": sum(p.numel() for p in module.parameters())}
    notes: list[str] = []
    path = work / f"{name}.bundle"
    first = next(iter(methods))
    inputs = examples[first]
    try:
        started = time.perf_counter()
        if not path.exists():
            cuda_runner.compile_methods(copy.deepcopy(module), examples, path, device="cuda", warn=notes.append)
        entry["compile_s"], entry["notes"] = round(time.perf_counter() - started, 1), notes
        with torch.no_grad():
            eager_out = getattr(copy.deepcopy(module), first)(*inputs)
        specs = cuda_runner.read_manifest(path).methods[first].inputs
        np.savez(work / f"{name}-in.npz", **{spec.name: arg.cpu().numpy() for spec, arg in zip(specs, inputs)})
        np.savez(work / f"{name}-ref.npz", output_0=eager_out.float().cpu().numpy())
        done = subprocess.run([sys.executable, "-m", "cuda_runner", "run", str(path), "--method", first, "--inputs", str(work / f"{name}-in.npz"),
                               "--expected", str(work / f"{name}-ref.npz"), "--atol", "output_0=2e-3", "--rtol", "output_0=2e-3"],
                              capture_output=True, text=True, timeout=600)
        entry["cli_exit"] = done.returncode
        entry["cli_report"] = [line for line in done.stdout.splitlines() if "output_0" in line or line.startswith("VERDICT")][-3:] or done.stderr[-300:]
        bench = subprocess.run([sys.executable, "-m", "cuda_runner", "bench", str(path), "--method", first, "--inputs", str(work / f"{name}-in.npz"),
                                "--iterations", str(steps), "--json"], capture_output=True, text=True, timeout=600)
        if bench.returncode == 0:
            document = json.loads(bench.stdout)
            host, device = document["steady_s"]["median"], (document["device_resident_s"] or {}).get("median")
            entry["cuda-runner host to host ms"] = round(host * 1e3, 4)
            entry["cuda-runner device arrays ms"] = round(device * 1e3, 4) if device else None
            entry["copies and checks share"] = round(1 - device / host, 3) if device else None
        call = getattr(module, first)
        with torch.no_grad():
            entry["eager ms"] = summary(time_steps(lambda i: (call(*inputs), torch.cuda.synchronize()), steps))["median_ms"]
            try:
                started = time.perf_counter()
                compiled = torch.compile(call)
                compiled(*inputs)
                entry["torch.compile compile_s"] = round(time.perf_counter() - started, 1)
                entry["torch.compile ms"] = summary(time_steps(lambda i: (compiled(*inputs), torch.cuda.synchronize()), steps))["median_ms"]
            except Exception as error:
                entry["torch.compile"] = f"{type(error).__name__}: {str(error)[:200]}"
    except Exception as error:
        entry["error"] = f"{type(error).__name__}: {str(error)[:400]}"
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="compile,check,decode,big")
    parser.add_argument("--work", type=Path, default=Path("/tmp/cuda-runner-scale"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=200)
    options = parser.parse_args()
    options.work.mkdir(parents=True, exist_ok=True)
    out = options.out or options.work
    out.mkdir(parents=True, exist_ok=True)
    import torch

    machine = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    for stage in options.stages.split(","):
        log(f"stage {stage}")
        started = time.perf_counter()
        if stage == "compile":
            result = stage_compile(options.work)
        elif stage == "check":
            result = stage_check(options.work)
        elif stage == "decode":
            result = stage_decode(options.work, options.steps)
            result["cli bench --steps"] = cli_bench(options.work)
        elif stage == "big":
            result = stage_big(options.work, options.steps)
        else:
            parser.error(f"unknown stage {stage!r}")
        result = {"machine": machine, "stage_s": round(time.perf_counter() - started, 1), **result}
        text = json.dumps(result, indent=1, default=str)
        (out / f"scale-{stage}.json").write_text(text)
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
