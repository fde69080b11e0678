"""cuda-runner's own shim against libtorch and eager PyTorch, on a GPU machine.

For five small models (MLP, conv+BN, fp32 attention, embedding+argmax, bf16 MLP),
and with `--hf` three tiny Hugging Face models (GPT-2, BERT, Llama; random weights):
1. compile each twice with the CLI, the default (standalone: Triton GEMMs and
   convolutions, no libtorch; the "-standalone" bundles) and `--libtorch` (the
   former default: libtorch's kernels; the "-default" bundles), in parallel,
   timing each compile;
2. run every standalone bundle in processes where `import torch` fails (a
   sitecustomize blocks it), through the CLI and the Python API, and compare
   with eager PyTorch; check that no libtorch library is mapped;
3. cold `run` of a standalone bundle beside the default bundle, eager torch and
   `python -c "import numpy"`;
4. per call, in one process: standalone (shim), default (libtorch) and eager,
   on host arrays and on device arrays + synchronize; beside them the floor,
   scripts/bench_floor.c calling the container's Run on the same libraries
   (standalone on cuda-runner's shim, default on libtorch);
5. CUDA graphs: standalone without torch beside the default bundle's torch graph;
6. a real ExecuTorch program (the G3 fixture) without torch.

    python3 scripts/bench_standalone.py --output standalone.json --markdown standalone.md

`--floor-only` compiles only the MLP (`--standalone`, for `--device`) and
prints cuda-runner's per call (host arrays on the CPU, device arrays +
synchronize on CUDA) beside the C program calling Run on the shim; it runs
on a CPU machine too:

    python3 scripts/bench_standalone.py --floor-only --device cpu
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BLOCK_TORCH = "import sys\nsys.modules['torch'] = None  # `import torch` fails in this process\n"


def models():
    import torch

    torch.manual_seed(0)

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.norm, self.b = torch.nn.Linear(16, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 8)

        def forward(self, x):
            return self.b(torch.nn.functional.gelu(self.norm(self.a(x))))

    class Conv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.bn, self.c2 = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.Conv2d(16, 16, 3, padding=1)

        def forward(self, x):
            return self.c2(torch.relu(self.bn(self.c1(x)))).mean(dim=(2, 3))

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64)

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return self.out(y.transpose(1, 2).reshape(x.shape))

    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.head = torch.nn.Embedding(100, 32), torch.nn.Linear(32, 10)

        def forward(self, ids):
            logits = self.head(self.table(ids).mean(dim=1))
            return logits, logits.argmax(dim=-1)

    bf16 = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).to(torch.bfloat16)
    return {
        "mlp": (Mlp(), (torch.randn(32, 16),)),
        "conv": (Conv(), (torch.randn(2, 3, 32, 32),)),
        "attention": (Attention(), (torch.randn(2, 64, 64),)),
        "embedding": (Embed(), (torch.randint(0, 100, (4, 12)),)),
        "bf16_mlp": (bf16, (torch.randn(8, 32).to(torch.bfloat16),)),
    }


def hf_models():
    """Tiny Hugging Face models from their configs (random weights; transformers is on the GPU machine), logits out."""
    import torch
    import transformers

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids).logits

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, 16))
    built = {}
    for name, config in (
        ("hf_gpt2", transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4)),
        ("hf_bert", transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)),
        ("hf_llama", transformers.LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              intermediate_size=128, max_position_embeddings=64)),
    ):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config) if name != "hf_bert" else transformers.BertForMaskedLM(config)
            built[name] = (Logits(model), (ids,))
        except Exception as error:  # a transformers version without the model: reported, not fatal
            print(f"skipping {name}: {type(error).__name__}: {error}", file=sys.stderr)
    return built


def to_numpy(tensor):
    import torch

    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.float().cpu().numpy().astype(ml_dtypes.bfloat16)
    return tensor.detach().cpu().numpy()


def prepare(work: Path, hf: bool = False) -> dict[str, dict]:
    import torch

    cases = {}
    for name, (module, args) in {**models(), **(hf_models() if hf else {})}.items():
        module = module.eval().cuda()
        args = tuple(arg.cuda() for arg in args)
        with torch.no_grad():
            eager = module(*args)
        eager = eager if isinstance(eager, tuple) else (eager,)
        try:
            program = torch.export.export(module, args)
        except Exception as error:  # an HF model torch.export cannot take here: reported, not fatal
            print(f"skipping {name}: export failed: {type(error).__name__}: {str(error).splitlines()[0]}", file=sys.stderr)
            continue
        torch.export.save(program, work / f"{name}.pt2")
        inputs = {name: to_numpy(arg) for name, arg in zip(program.graph_signature.user_inputs, args)}
        np.savez(work / f"{name}-in.npz", **inputs)
        np.savez(work / f"{name}-ref.npz", **{f"output_{i}": to_numpy(value) for i, value in enumerate(eager)})
        cases[name] = {"module": module, "args": args, "inputs": inputs}
    return cases


def cli(*arguments: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cuda_runner", *arguments], capture_output=True, text=True, env=env, timeout=timeout)


def compile_all(work: Path, names: list[str]) -> dict[str, dict]:
    jobs = {}

    def timed_cli(*arguments: str) -> tuple[subprocess.CompletedProcess, float]:
        started = time.perf_counter()  # in the worker: each compile's own time, though they run side by side
        return cli(*arguments), time.perf_counter() - started

    with concurrent.futures.ThreadPoolExecutor(max_workers=2 * len(names)) as pool:
        for name in names:
            # "standalone": what compile builds by default now; "default": the former default, --libtorch.
            for kind, extra in (("standalone", []), ("default", ["--libtorch"])):
                future = pool.submit(timed_cli, "compile", str(work / f"{name}.pt2"), "--device", "cuda", "-o", str(work / f"{name}-{kind}.bundle"), *extra)
                jobs[(name, kind)] = future
        results: dict[str, dict] = {name: {} for name in names}
        for (name, kind), future in jobs.items():
            done, seconds = future.result()
            results[name][kind] = {"ok": done.returncode == 0, "seconds": round(seconds, 1),
                                   "error": done.stderr.strip().splitlines()[-1] if done.returncode else None,
                                   "warnings": [line for line in done.stderr.splitlines() if line.startswith("warning:")]}
            if done.returncode == 0:
                import cuda_runner

                options = cuda_runner.read_manifest(work / f"{name}-{kind}.bundle").methods["forward"].compile_options
                results[name][kind]["runtime"] = "standalone" if options.get("standalone") else "libtorch"
    return results


def no_torch_env(work: Path) -> dict:
    blocker = work / "no-torch"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(BLOCK_TORCH)
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{blocker}:{ROOT}:{env.get('PYTHONPATH', '')}"
    return env


PROBE = r'''
import json, sys, numpy as np
import cuda_runner
path, inputs, graph = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
model = cuda_runner.load(path, provider="shim", cuda_graph=graph)
arrays = dict(np.load(inputs))
outputs = model.run(arrays)
import time
times = []
for _ in range(300):
    started = time.perf_counter(); model.run(arrays); times.append(time.perf_counter() - started)
maps = open("/proc/self/maps").read()
np.savez(sys.argv[4], **outputs)
print(json.dumps({"provider": model.method().provider, "libtorch_mapped": "libtorch" in maps, "torch_imported": sys.modules.get("torch") is not None,
                  "median_us": sorted(times)[150] * 1e6, "p10_us": sorted(times)[30] * 1e6, "p90_us": sorted(times)[270] * 1e6}))
'''


def check_without_torch(work: Path, names: list[str], env: dict) -> dict[str, dict]:
    from cuda_runner.io.npy import load_archive

    (work / "probe.py").write_text(PROBE)
    results = {}
    for name in names:
        bundle = work / f"{name}-standalone.bundle"
        if not bundle.exists():
            continue
        entry: dict = {}
        done = cli("run", str(bundle), "--inputs", str(work / f"{name}-in.npz"), "--expected", str(work / f"{name}-ref.npz"), "--provider", "shim", env=env)
        entry["cli_exit"] = done.returncode
        entry["cli_verdict"] = next((line for line in done.stdout.splitlines() if line.startswith("VERDICT")), done.stderr.strip()[-300:])
        for graph in ("0", "1"):
            probe = subprocess.run([sys.executable, str(work / "probe.py"), str(bundle), str(work / f"{name}-in.npz"), graph, str(work / f"{name}-out{graph}.npz")],
                                   capture_output=True, text=True, env=env, timeout=600)
            if probe.returncode != 0:
                entry[f"graph{graph}"] = {"error": probe.stderr.strip()[-600:]}
                continue
            report = json.loads(probe.stdout.strip().splitlines()[-1])
            # cuda-runner's reader: bfloat16 that np.savez wrote as bare 2-byte voids comes back as bfloat16.
            reference = load_archive(work / f"{name}-ref.npz")
            outputs = load_archive(work / f"{name}-out{graph}.npz")
            report["max_abs_diff"] = max(float(np.max(np.abs(outputs[key].astype(np.float64) - reference[key].astype(np.float64)))) for key in reference)
            entry[f"graph{graph}"] = report
        results[name] = entry
    return results


def build_floor(work: Path) -> Path:
    """scripts/bench_floor.c, compiled once into `work`."""
    binary = work / "bench_floor"
    if not binary.exists():
        subprocess.run(["cc", "-O2", "-o", str(binary), str(ROOT / "scripts" / "bench_floor.c"), "-ldl"], check=True, capture_output=True, text=True)
    return binary


def _floor_files(bundle: Path, work: Path, rename: bool) -> tuple[Path, Path]:
    """The forward method's library and weights, as files the C program loads;
    for the shim, the library copy with its imports renamed as cuda-runner renames them."""
    from cuda_runner.format import open_bundle
    from cuda_runner.format.elf import rename_imports
    from cuda_runner.runtime.providers import RENAMES

    with open_bundle(bundle) as reader:
        spec = reader.manifest.methods["forward"]
        library = reader.read_verified(spec.library_segment)
        weights = bytes(reader.segment(spec.weights_segment)) if spec.weights_segment else b""
    stem = f"{bundle.stem}-{'shim' if rename else 'libtorch'}"
    library_path, weights_path = work / f"{stem}.so", work / f"{stem}.blob"
    library_path.write_bytes(rename_imports(library, RENAMES) if rename else library)
    weights_path.write_bytes(weights)
    return library_path, weights_path


def c_floor(bundle: Path, device: str, inputs: dict[str, np.ndarray], work: Path, iterations: int,
            provider: str = "shim", processes: int = 3, sync_each_call: bool = True) -> dict:
    """scripts/bench_floor.c calling the container's Run on `bundle`'s library,
    on cuda-runner's shim (the renamed copy, the shim and the CUDA runtime made
    global first, as cuda-runner binds it) or on libtorch. `sync_each_call`
    waits for each call's stream, as cuda-runner's "device arrays + sync" rows
    do (no-op on the CPU). Its figures, over `processes` processes: the median
    of their median calls (min and max of them as the spread), and the median
    of their mean calls."""
    from cuda_runner.arrays import SCALAR_TYPE_CODES

    binary = build_floor(work)
    library, weights = _floor_files(bundle, work, rename=provider == "shim")
    lead = ["--median", *(["--sync-each-call"] if sync_each_call else [])]
    if provider == "shim":
        from cuda_runner.runtime.providers import cudart_candidates, own_shim_path

        shim = own_shim_path()
        if shim is None:
            return {"error": "cuda-runner's shim is not built (python setup.py build_ext --inplace)"}
        lead.append(f"--shim={shim}")
        cudart = next((path for path in cudart_candidates() if os.path.isabs(path) and os.path.exists(path)), None)
        if device == "cuda" and cudart:
            lead.append(f"--cudart={cudart}")
    else:
        from cuda_runner.runtime.shim import torch_library_dir

        lead.append(str(torch_library_dir()))
    specs = [f"{SCALAR_TYPE_CODES[str(array.dtype)]}:" + "x".join(str(size) for size in array.shape) for array in inputs.values()]
    means, medians = [], []
    for _ in range(processes):
        done = subprocess.run([str(binary), *lead, str(library), str(weights), device, str(iterations), *specs],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            reason = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
            return {"error": f"{reason}: {done.stderr.strip()[-400:]}"}
        mean, median = (float(value) for value in done.stdout.split())
        means.append(mean)
        medians.append(median)
    return {"median_us": round(statistics.median(medians), 2), "p10_us": round(min(medians), 2), "p90_us": round(max(medians), 2),
            "mean_us": round(statistics.median(means), 2),
            "note": f"{iterations} calls per process; median call (min-max over {processes} processes), and the median of their means"}


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6  # noqa: E731
    return {"median_us": round(statistics.median(ordered) * 1e6, 1), "p10_us": round(pick(0.1), 1), "p90_us": round(pick(0.9), 1)}


def cold_starts(work: Path, env: dict, rounds: int) -> dict:
    commands = {
        "python -c 'import numpy'": ([sys.executable, "-c", "import numpy"], None),
        "run standalone bundle (no torch)": ([sys.executable, "-m", "cuda_runner", "run", str(work / "mlp-standalone.bundle"), "-i", str(work / "mlp-in.npz"), "-q"], env),
        "run default bundle (libtorch)": ([sys.executable, "-m", "cuda_runner", "run", str(work / "mlp-default.bundle"), "-i", str(work / "mlp-in.npz"), "-q"], None),
        "eager torch (load .pt2, one call)": ([sys.executable, "-c", (
            f"import torch, numpy as np; m = torch.export.load({str(work / 'mlp.pt2')!r}).module(); "
            f"x = torch.from_numpy(np.load({str(work / 'mlp-in.npz')!r})['x']).cuda(); m(x).cpu()")], None),
    }
    results: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):  # interleaved, so that drift touches every command alike
        for name, (command, command_env) in commands.items():
            started = time.perf_counter()
            done = subprocess.run(command, capture_output=True, env=command_env, timeout=300)
            elapsed = time.perf_counter() - started
            if done.returncode == 0:
                results[name].append(elapsed)
    return {name: {"median_s": round(statistics.median(values), 3), "min_s": round(min(values), 3), "max_s": round(max(values), 3), "runs": len(values)}
            for name, values in results.items() if values}


def per_call(work: Path, cases: dict, iterations: int) -> dict:
    import cuda_runner

    results = {}
    for name in ("mlp", "attention"):
        standalone = cuda_runner.load(work / f"{name}-standalone.bundle", provider="shim")
        default = cuda_runner.load(work / f"{name}-default.bundle", provider="libtorch")
        try:
            results[name] = _per_call_case(standalone, default, cases[name], iterations)
        finally:
            standalone.close()
            default.close()
        # The floor, on the same libraries: wrap the resident inputs, Run, free the outputs.
        host = cases[name]["inputs"]
        standalone_bundle, default_bundle = work / f"{name}-standalone.bundle", work / f"{name}-default.bundle"
        results[name]["C program calling Run (shim)"] = c_floor(standalone_bundle, "cuda", host, work, 5 * iterations)
        results[name]["C program calling Run (shim), one sync at the end"] = c_floor(standalone_bundle, "cuda", host, work, 5 * iterations, sync_each_call=False)
        results[name]["C program calling Run (libtorch), default bundle"] = c_floor(default_bundle, "cuda", host, work, 5 * iterations, provider="libtorch")
    return results


def _per_call_case(standalone, default, case: dict, iterations: int) -> dict:
    import cupy
    import torch

    module, args, host = case["module"], case["args"], case["inputs"]
    device_inputs = {key: cupy.asarray(value) for key, value in host.items()}
    variants = {
        "standalone (shim), host arrays": lambda: standalone.run(host),
        "default (libtorch), host arrays": lambda: default.run(host),
        "eager torch, host arrays": lambda: [value.cpu() for value in _tuple(module(*[torch.from_numpy(v).cuda() for v in host.values()]))],
        "standalone (shim), device arrays + sync": lambda: (standalone.run_device(device_inputs), cupy.cuda.runtime.deviceSynchronize()),
        "default (libtorch), device arrays + sync": lambda: (default.run_device(device_inputs), cupy.cuda.runtime.deviceSynchronize()),
        "eager torch, device tensors + sync": lambda: (module(*args), torch.cuda.synchronize()),
    }
    times: dict[str, list[float]] = {key: [] for key in variants}
    with torch.no_grad():
        for call in variants.values():
            for _ in range(20):
                call()
        for _ in range(iterations):  # interleaved rounds
            for key, call in variants.items():
                started = time.perf_counter()
                call()
                times[key].append(time.perf_counter() - started)
    return {key: summary(values) for key, values in times.items()}


def _tuple(value):
    return value if isinstance(value, tuple) else (value,)


def graph_with_torch(work: Path, cases: dict, iterations: int) -> dict:
    import cuda_runner

    model = cuda_runner.load(work / "mlp-default.bundle", provider="libtorch", cuda_graph=True)
    host = cases["mlp"]["inputs"]
    for _ in range(20):
        model.run(host)
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        model.run(host)
        times.append(time.perf_counter() - started)
    model.close()
    return summary(times)


def executorch_without_torch(env: dict) -> dict:
    fixture = ROOT / "tests" / "data" / "executorch" / "g3_et151_torch211"
    code = (
        "import sys, json, numpy as np, cuda_runner\n"
        f"m = cuda_runner.load({str(fixture / 'model.pte')!r}, provider='shim')\n"
        f"io = np.load({str(fixture / 'io.npz')!r})\n"
        "y = m.run([io['x0']])['output_0']\n"
        "print(json.dumps({'max_abs_diff': float(np.abs(y - io['y0']).max()), 'provider': m.method().provider,"
        " 'libtorch_mapped': 'libtorch' in open('/proc/self/maps').read()}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-600:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(report: dict) -> str:
    header = "| model | compile (default: standalone) | compile --libtorch | no-torch CLI run | max abs diff vs eager | graph replay (no torch) |"
    lines = [f"machine: {report['machine']}", "", header, "|---|---|---|---|---|---|"]
    for name, compiled in report["compile"].items():
        check = report["no_torch"].get(name, {})
        plain, graph = check.get("graph0", {}), check.get("graph1", {})
        lines.append(f"| {name} | {'ok' if compiled['standalone']['ok'] else compiled['standalone']['error']} ({compiled['standalone']['seconds']} s, "
                     f"{compiled['standalone'].get('runtime', '-')}) | {compiled['default']['seconds']} s | "
                     f"{check.get('cli_verdict', '-')} | {plain.get('max_abs_diff', plain.get('error', '-'))} | "
                     f"{graph.get('median_us', graph.get('error', '-'))} µs |")
    lines += ["", "| cold start | median s | min-max s |", "|---|---|---|"]
    for name, row in report["cold_start"].items():
        lines.append(f"| {name} | {row['median_s']} | {row['min_s']}-{row['max_s']} |")
    for name, rows in report["per_call"].items():
        lines += ["", f"per call, {name} | median µs | p10-p90 µs", "|---|---|---|"]
        for key, row in rows.items():
            lines.append(_per_call_row(key, row))
    lines += ["", f"mlp, default bundle, torch CUDA graph replay, host arrays: {report['graph_with_torch']}",
              f"ExecuTorch G3 program without torch: {report['executorch_g3']}"]
    return "\n".join(lines)


def _per_call_row(key: str, row: dict) -> str:
    if "error" in row:
        return f"| {key} | {row['error']} | |"
    if key.startswith("C program"):
        return f"| {key} | {row['median_us']} (mean {row['mean_us']}) | {row['p10_us']}-{row['p90_us']} (min-max of the processes' medians) |"
    return f"| {key} | {row['median_us']} | {row['p10_us']}-{row['p90_us']} |"


def floor_only(device: str, iterations: int, profile_calls: int = 0, cold_rounds: int = 0) -> None:
    """Compile the MLP with --standalone for `device`; cuda-runner's per call on
    the shim beside the C program calling Run on the shim, on one library."""
    import torch

    import cuda_runner

    work = Path(tempfile.mkdtemp(prefix="cuda-runner-floor-"))
    module, args = models()["mlp"]
    module = module.eval().to(device)
    args = tuple(arg.to(device) for arg in args)
    bundle = work / "mlp-standalone.bundle"
    started = time.perf_counter()
    cuda_runner.compile_module(module, args, bundle, device=device, standalone=True)
    print(f"compiled mlp --standalone for {device} in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    host = {"x": to_numpy(args[0])}
    with torch.no_grad():
        eager = to_numpy(module(*args))
    rows: dict[str, dict] = {}
    with cuda_runner.load(bundle, provider="shim") as model:
        got = model.run(host)["output_0"]
        max_diff = float(np.max(np.abs(got.astype(np.float64) - eager.astype(np.float64))))
        if device == "cuda":
            import cupy

            device_inputs = {key: cupy.asarray(value) for key, value in host.items()}
            method = model.method()
            stream = method.stream
            calls = {
                "cuda-runner (shim), device arrays + sync": lambda: (model.run_device(device_inputs), cupy.cuda.runtime.deviceSynchronize()),
                # The C program synchronizes its stream: the same here, through Method.run_device directly.
                "cuda-runner (shim), Method.run_device + stream sync": lambda: (method.run_device(device_inputs), stream.synchronize()),
                **_layers_below(method, device_inputs, stream),
            }
        else:
            calls = {"cuda-runner (shim), host arrays": lambda: model.run(host)}
        rows.update(_interleaved(calls, iterations))
        if profile_calls:
            _profile(list(calls.values())[-1], profile_calls)
    rows["C program calling Run (shim)"] = c_floor(bundle, device, host, work, 5 * iterations)
    if cold_rounds:
        np.savez(work / "mlp-in.npz", **host)
        _cold_breakdown(bundle, work, cold_rounds)
    if device == "cuda":
        rows["C program calling Run (shim), one sync at the end"] = c_floor(bundle, device, host, work, 5 * iterations, sync_each_call=False)
    print(json.dumps({"device": device, "max_abs_diff_vs_eager": max_diff, "per_call": rows}, indent=2))
    print("\n".join(["", f"per call, mlp --standalone on {device} | median µs | p10-p90 µs", "|---|---|---|",
                     *(_per_call_row(key, row) for key, row in rows.items())]))


# The steps of Method.load's "shim" phase on CUDA, timed one by one in a cold
# process that starts the context first, as the CLI does.
LOAD_STEPS = r"""
import sys, time
clock = time.perf_counter
marks = [("start", clock())]
def mark(name):
    marks.append((name, clock()))
from cuda_runner.runtime.context import start_context, wait_for_context
start_context(0); mark("start the context thread")
import numpy; mark("import numpy")
import cuda_runner; from cuda_runner.runtime import providers; from cuda_runner.format.elf import read_library_facts, rename_imports
mark("import cuda_runner's runtime")
from cuda_runner.format.source import open_model
reader = open_model(sys.argv[1]); spec = next(iter(reader.manifest.methods.values())); mark("open the bundle")
library = reader.read_verified(spec.library_segment); mark("read and check the library")
facts = read_library_facts(library); mark("read the library's ELF facts")
providers.own_exports(); mark("read the shim's exports (ELF)")
providers.load_cuda_runtime(); mark("load the CUDA runtime")
providers.load_own_provider("cuda"); mark("load the shim")
rename_imports(library, providers.RENAMES); mark("rename the library's imports")
wait_for_context(0); mark("wait for the context")
from cupy_backends.cuda.api import runtime; mark("import cupy_backends' runtime")
runtime.getDevice(); runtime.free(0); mark("first CUDA runtime calls")
model = cuda_runner.load(sys.argv[1]); mark("cuda_runner.load (the rest)")
for (_, before), (name, after) in zip(marks, marks[1:]):
    print(f"  {name:<34} {(after - before) * 1e3:8.1f}")
"""


def _layers_below(method: Any, device_inputs: dict, stream: Any) -> dict[str, Any]:
    """The same call with the layers above each level peeled off, to show where
    the time above the C program goes: the executor (no Method bookkeeping), then
    the invoker alone (no CuPy outputs: the handles are freed at once).
    These reach into the runtime's internals on purpose."""
    executor = method._lanes.first
    ordered = [device_inputs[spec.name] for spec in method.spec.inputs]
    layouts = [(array.data.ptr, array.shape, tuple(stride // array.itemsize for stride in array.strides)) for array in ordered]
    invoker = executor._invoker

    def invoke_only() -> None:
        owned, _ = invoker(layouts)
        stream.synchronize()
        owned.release()

    _ = executor.cupy  # makes the lane's C device call, as the first run_device would
    native = getattr(executor, "_device_call", None)

    def glue_in_python() -> None:
        executor._device_call = None  # the same call with its per-call glue in Python (cuda_runner/native/device_call.c's fallback)
        try:
            method.run_device(device_inputs)
        finally:
            executor._device_call = native
        stream.synchronize()

    return {
        **({"Method.run_device, glue in Python (no C device call) + stream sync": glue_in_python} if native is not None else {}),
        "executor.run_device + stream sync": lambda: (executor.run_device(ordered), stream.synchronize()),
        "invoker only (no CuPy outputs) + stream sync": invoke_only,
    }


def _interleaved(calls: dict[str, Any], iterations: int) -> dict[str, dict]:
    """Each variant timed one call at a time, in turn, so that drift (clocks,
    other load) touches every variant alike."""
    for call in calls.values():
        for _ in range(50):
            call()
    times: dict[str, list[float]] = {label: [] for label in calls}
    clock = time.perf_counter
    for _ in range(iterations):
        for label, call in calls.items():
            started = clock()
            call()
            times[label].append(clock() - started)
    return {label: summary(values) for label, values in times.items()}


def _cold_breakdown(bundle: Path, work: Path, rounds: int) -> None:
    """Where a cold no-torch CLI run of `bundle` goes (to stderr): wall time,
    the run's own --json phases, and the slowest imports of one more run."""
    env = no_torch_env(work)
    command = [sys.executable, "-m", "cuda_runner", "run", str(bundle), "-i", str(work / "mlp-in.npz"), "--json"]
    walls, phases, numpy_walls = [], [], []
    for _ in range(rounds):  # interleaved with `import numpy`, so that drift touches both alike
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        walls.append(time.perf_counter() - started)
        if done.returncode != 0:
            print(f"cold run failed: {done.stderr.strip()[-400:]}", file=sys.stderr)
            return
        report = json.loads(done.stdout)
        phases.append({**report.get("timings_s", {}), **{f"load.{key}": value for key, value in report.get("load_s", {}).items()}})
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import numpy"], check=True, env=env)
        numpy_walls.append(time.perf_counter() - started)
    print(f"cold CLI run (no torch): median {statistics.median(walls):.3f} s ({min(walls):.3f}-{max(walls):.3f}); "
          f"import numpy: median {statistics.median(numpy_walls):.3f} s", file=sys.stderr)
    for key in phases[0]:
        values = [row[key] for row in phases if isinstance(row.get(key), (int, float))]
        if values:
            print(f"  {key:<28} median {statistics.median(values) * 1e3:8.1f} ms", file=sys.stderr)
    steps = subprocess.run([sys.executable, "-c", LOAD_STEPS, str(bundle)], capture_output=True, text=True, env=env, timeout=120)
    print("the load of a cold process, step by step (ms):", file=sys.stderr)
    print(steps.stdout.rstrip() or steps.stderr.strip()[-600:], file=sys.stderr)
    done = subprocess.run([sys.executable, "-X", "importtime", *command[1:]], capture_output=True, text=True, env=env, timeout=120)
    rows = [line.split("|") for line in done.stderr.splitlines() if line.startswith("import time:") and "|" in line][1:]
    own = sorted(((int(row[0].split(":")[1]), row[2].rstrip()) for row in rows), reverse=True)[:20]
    cumulative = sorted(((int(row[1]), row[2].rstrip()) for row in rows), reverse=True)[:25]
    print("slowest imports, own time (µs):", file=sys.stderr)
    for micros, name in own:
        print(f"  {micros:>8} {name}", file=sys.stderr)
    print("slowest imports, cumulative (µs):", file=sys.stderr)
    for micros, name in cumulative:
        print(f"  {micros:>8} {name}", file=sys.stderr)


def _profile(call: Any, count: int) -> None:
    """Where the Python layer spends a call: cProfile's busiest functions (own time) over `count` calls."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(count):
        call()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue(), file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--floor-only", action="store_true", help="only the MLP: cuda-runner per call beside the C program on the shim")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="for --floor-only")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--cold-rounds", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="with --floor-only: also break down a cold no-torch CLI run (to stderr)")
    parser.add_argument("--compile-only", action="store_true", help="only compile both ways and time each compile")
    parser.add_argument("--hf", action="store_true", help="also three tiny Hugging Face models (GPT-2, BERT, Llama) from transformers")
    parser.add_argument("--profile", type=int, default=0, metavar="CALLS", help="with --floor-only: cProfile this many calls (to stderr)")
    options = parser.parse_args()
    if options.floor_only:
        floor_only(options.device, options.iterations, options.profile, options.cold_rounds if options.cold else 0)
        return
    if options.output is None:
        parser.error("--output is required (but with --floor-only)")
    import torch

    work = Path(tempfile.mkdtemp(prefix="cuda-runner-standalone-"))
    cases = prepare(work, options.hf)
    names = list(cases)
    report: dict = {"machine": f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"}
    report["compile"] = compile_all(work, names)
    print(json.dumps(report["compile"]), flush=True)
    if options.compile_only:
        options.output.write_text(json.dumps(report, indent=2))
        return
    env = no_torch_env(work)
    report["no_torch"] = check_without_torch(work, names, env)
    print(json.dumps(report["no_torch"]), flush=True)
    report["executorch_g3"] = executorch_without_torch(env)
    report["cold_start"] = cold_starts(work, env, options.cold_rounds) if (work / "mlp-standalone.bundle").exists() else {}
    report["per_call"] = per_call(work, cases, options.iterations) if (work / "mlp-standalone.bundle").exists() else {}
    report["graph_with_torch"] = graph_with_torch(work, cases, options.iterations)
    options.output.write_text(json.dumps(report, indent=2))
    text = markdown(report)
    if options.markdown:
        options.markdown.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
