#!/usr/bin/env python3
"""Models at the sizes users ship, on one GPU (docs/benchmarks.md, "NVIDIA H200").

Stages (each writes OUT/scale-<stage>.json as soon as it ends and prints it,
and what it has so far to OUT/scale-<stage>.partial.json after each compile
and big model; later stages use what earlier ones left in WORK):

  compile  the 1B Llama-shaped decoder of scripts/scale_models.py (bf16,
           random weights made on the GPU from a fixed seed, never carried),
           `prefill` and `decode` sharing weights and KV cache, compiled in
           parallel processes three ways: the default, --libtorch and --quick;
           beside them torch's own AOTI package of the decode program and,
           where the executorch package is installed, the same two methods
           exported with ExecuTorch's CUDA backend (.pte + .ptd). The compile
           time of each (they share the machine's 16 cores: side by side).
  check    each build against eager: a prefill of 32 tokens, 128 decode steps
           fed eager's greedy tokens, logits compared at every step; then
           reset_state and a second prompt; on a GPU the first build again with
           --cuda-graph. Peak GPU memory against weights + KV cache.
  load     the first build's load, warm page cache and cold (the file's
           pages dropped with posix_fadvise), against a plain read of the file;
           the load_weights phase broken into its parts (LOAD_PARTS).
  weights  the load stage on a bundle of the decoder's parameters and buffers
           read by two trivial methods (compiled in 71 s on the H200).
  decode   per decode step, in one process: every build and the ExecuTorch
           program (host arrays, with and without --cuda-graph; device arrays,
           with and without --cuda-graph), eager PyTorch,
           torch.compile(mode="reduce-overhead"), torch's aoti_load_package of
           the decode program; a loop that picks each token on the GPU from the
           last logits and waits only at its end, on the first build's graph
           with device arrays and on torch.compile's and torch's package's
           step; and the HBM floor (bytes a
           step must read / the card's HBM bandwidth: 4.8 TB/s on an H200,
           3.35 on an H100); a CUPTI kernel profile; and
           `cuda-runner bench --steps` through the CLI, with --cuda-graph
           also with the shim's programmatic launches off and on, alternately.
  breakdown  where a graphed decode call of the first build goes: model.run,
           the graph executor's part, its pieces (the inputs' bytes staged,
           the launch, the wait, the copy into NumPy), and the GPU's time for
           the replay alone (CUDA events).
  arena    the first build's graphed decode step with the capture's memory
           from the graph's arena and as memory nodes of the graph, A B B A
           twice in one process: model.run, the replay alone, the graph's nodes.
  whisper  Whisper-base's decoder alone, built three ways (the default, --libtorch,
           no coordinate descent), each stepped against eager on eager's
           encoding of the same audio: the error of every step.
  big      ViT-B/16 (224x224), ResNet-50 and a Whisper-base-shaped
           encoder-decoder (30 s of log-mel, decoder steps with its cache):
           compiled side by side (ResNet-50 also --quick: resnet50-quick in --big), run through the CLI
           with --expected against eager, Whisper's decoder stepped against
           eager, and timed against eager and torch.compile; the CLI's copies
           and checks as a share of a call. `big-compile` only compiles
           them; a later `big` measures what is there, compiling the rest.

    python3 scripts/bench_scale.py --stages compile,check,load,decode --work /tmp/scale --out $OUT
    python3 scripts/bench_scale.py --size tiny --device cpu --stages compile,check,load,decode   # a quick dry run
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import scale_models  # noqa: E402

# The HBM's peak bandwidth by card: the floor is quoted for the card the run has (the lent machines give H200s or H100s).
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def hbm_bytes_per_s() -> float:
    """The peak HBM bandwidth of GPU 0 (an H200's where the card is neither)."""
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return next((rate for card, rate in HBM_BYTES_PER_S.items() if card in name), HBM_BYTES_PER_S["H200"])


# What the run sets (--size, --device); the compile subprocesses get them as arguments.
SIZES = {"1b": scale_models.LLAMA_1B, "tiny": scale_models.LLAMA_TINY,
         # The 1B decoder's layers at full width, 4 of them: a build compiles and is measured sooner, per layer alike.
         "1b-4layers": replace(scale_models.LLAMA_1B, layers=4)}
BIG = ("vit_b16", "resnet50", "resnet50-quick", "whisper_base")  # the big models (big_model; -quick: compiled with --quick)
SETTINGS: dict[str, Any] = {"size": "1b", "device": "cuda", "prompt": 32, "steps": 128, "builds": ["default", "libtorch", "quick", "executorch"],
                            "peers": True, "big": list(BIG)}
# The builds of the decoder: compile_methods keywords beyond the common ones.
# options: a Python expression (aot is cuda_runner.compile.aot); switches: cuda-runner's kernel
# switches set in the compiling process (module -> {name: value}), read when the kernels are built.
BUILDS: dict[str, dict[str, Any]] = {
    "default": {"runtime": "auto", "options": "None"},
    "libtorch": {"runtime": "libtorch", "options": "None"},
    "quick": {"runtime": "auto", "options": "aot.QUICK_OPTIONS"},
    "unfused": {"runtime": "auto", "options": "{'cuda_runner.fuse_decode_attention': False}"},
    "no-matvec": {"runtime": "auto", "options": "{'cuda_runner.matvec': False}"},
    "no-combo": {"runtime": "auto", "options": "{'combo_kernels': False}"},
    "no-update": {"runtime": "auto", "options": "{'cuda_runner.fuse_cache_update': False}"},
    "pdl-inductor": {"runtime": "auto", "options": "{'cuda_runner.programmatic_inductor_kernels': True}"},
    "late-go-ahead": {"runtime": "auto", "options": "None",
                      "switches": {"cuda_runner.compile.attention_kernel": {"ATTENTION_GO_AHEAD_FIRST": False, "MERGE_GO_AHEAD_FIRST": False}}},
}
LABELS = {"default": "default bundle", "libtorch": "--libtorch bundle", "quick": "--quick bundle", "executorch": "ExecuTorch 1.5 program",
          "unfused": "default bundle without the fused decode attention (cuda_runner.fuse_decode_attention=false)",
          "no-matvec": "default bundle without the matrix-vector kernel (cuda_runner.matvec=false)",
          "no-combo": "default bundle without Inductor's combo kernels (combo_kernels=false)",
          "no-update": "default bundle with the cache writes and rotations left to Inductor (cuda_runner.fuse_cache_update=false)",
          "pdl-inductor": "default bundle with Inductor's kernels as programmatic dependents (cuda_runner.programmatic_inductor_kernels=true)",
          "late-go-ahead": "default bundle whose attention and merge let the next launch start only after they wait "
                           "(ATTENTION_GO_AHEAD_FIRST=False, MERGE_GO_AHEAD_FIRST=False)"}
COMPILE_TIMEOUT_S = float(os.environ.get("BENCH_SCALE_COMPILE_TIMEOUT", "480"))  # each side-by-side batch of compiles


def log(message: str) -> None:
    print(f"[bench-scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# Where the running stage's results so far go (not in SETTINGS: the compile jobs get SETTINGS as Python source).
PARTIAL: list[Path | None] = [None]


def save_partial(results: dict[str, Any]) -> None:
    """What the running stage has so far, in OUT/scale-<stage>.partial.json: a call cut
    short by its time limit (a GPU machine's) still brings back the compiles and models done."""
    if PARTIAL[0] is not None:
        PARTIAL[0].write_text(json.dumps(results, indent=1, default=str))


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda fraction: ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]  # noqa: E731
    return {"median_ms": round(statistics.median(ordered) * 1e3, 4), "p10_ms": round(pick(0.1) * 1e3, 4), "p90_ms": round(pick(0.9) * 1e3, 4),
            "p99_ms": round(pick(0.99) * 1e3, 4), "n": len(ordered)}


def config() -> scale_models.LlamaConfig:
    return SIZES[SETTINGS["size"]]


def cuda() -> bool:
    return SETTINGS["device"] == "cuda"


def synchronize() -> None:
    if cuda():
        import torch

        torch.cuda.synchronize()


def build_llama():
    import torch

    torch.manual_seed(0)
    with torch.device(SETTINGS["device"]):
        module = scale_models.LlamaDecoder(config()).eval()
    return module


def artifact(work: Path, build: str) -> Path:
    """Where a build lives: a bundle, or the ExecuTorch program's .pte (its .ptd beside it)."""
    return work / "et" / "model.pte" if build == "executorch" else work / f"llama-{build}.bundle"


# ---------------------------------------------------------------------------
# compile: every build in a process of its own, side by side

COMPILE_BUNDLE = """
import sys, time, json
sys.path.insert(0, {scripts!r}); sys.path.insert(0, {root!r})
import bench_scale, scale_models, cuda_runner
from cuda_runner.compile import aot
bench_scale.SETTINGS.update({settings!r})
module = bench_scale.build_llama()
options = {options}
bench_scale.set_switches({switches!r})
notes = []
started = time.perf_counter()
manifest = cuda_runner.compile_methods(module, scale_models.llama_examples(module.config, bench_scale.SETTINGS["prompt"], {device!r}), {path!r},
                                       device={device!r}, dynamic_shapes=scale_models.llama_dynamic_shapes(module.config), runtime={runtime!r},
                                       options=options, warn=notes.append, progress=lambda m: print(m, file=sys.stderr, flush=True))
print(json.dumps({{"seconds": round(time.perf_counter() - started, 1), "notes": notes, "methods": bench_scale.how_built(manifest)}}))
"""

COMPILE_TORCH_PACKAGE = """
import sys, time, json
sys.path.insert(0, {scripts!r}); sys.path.insert(0, {root!r})
import torch, bench_scale
from torch._inductor import aoti_compile_and_package
bench_scale.SETTINGS.update({settings!r})
module = bench_scale.build_llama()
started = time.perf_counter()
program = torch.export.export(bench_scale.method_of(module, "decode"), *bench_scale.decode_example())
aoti_compile_and_package(program, package_path={path!r})
print(json.dumps({{"seconds": round(time.perf_counter() - started, 1)}}))
"""

COMPILE_EXECUTORCH = """
import sys, time, json
sys.path.insert(0, {scripts!r}); sys.path.insert(0, {root!r})
import bench_scale
bench_scale.SETTINGS.update({settings!r})
print(json.dumps(bench_scale.export_executorch({folder!r})))
"""


def how_built(manifest) -> dict[str, dict[str, Any]]:
    """What each method's library was built as, from its manifest's compile options."""
    return {name: {key: spec.compile_options.get(key) for key in
                   ("standalone", "libtorch_because", "coordinate_descent_tuning", "coordinate_descent_disagreed",
                    "fused_decode_attention", "fused_decode_attention_position_limits", "fused_decode_attention_disagreed",
                    "fused_decode_attention_failed", "fused_cache_updates", "fused_rotations", "fused_cache_updates_failed",
                    "fused_cache_updates_disagreed", "combo_kernels", "combo_kernels_failed", "matvec_products", "matvec_launches", "matvec_disagreed",
                    "matvec_failed")}
            for name, spec in manifest.methods.items()}


def method_of(module, name: str):
    """One method of the decoder as a module's forward (what torch.export and ExecuTorch export)."""
    import torch

    class Method(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = module  # the same FQNs in every method: ExecuTorch shares weights and cache by FQN

        def forward(self, tokens, input_pos):
            return getattr(self.model, name)(tokens, input_pos)

    return Method()


def decode_example() -> tuple[tuple[Any, ...]]:
    import torch

    device = SETTINGS["device"]
    return ((torch.tensor([[1]], device=device), torch.tensor([SETTINGS["prompt"]], device=device)),)


def export_executorch(folder: str) -> dict[str, Any]:
    """prefill and decode exported with ExecuTorch's CUDA backend into one program (.pte + .ptd)."""
    import torch
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    # Made on the GPU (the same random weights as every other build), exported
    # from the CPU as ExecuTorch's exports are: its backend moves the program to the GPU.
    module = build_llama().cpu()
    examples = scale_models.llama_examples(module.config, SETTINGS["prompt"], "cpu")
    shapes = scale_models.llama_dynamic_shapes(module.config)
    started = time.perf_counter()
    programs = {name: torch.export.export(method_of(module, name), examples[name], dynamic_shapes=shapes[name]) for name in ("prefill", "decode")}
    exported = time.perf_counter() - started
    edge = to_edge_transform_and_lower(
        programs,
        partitioner={name: [CudaPartitioner([CudaBackend.generate_method_name_compile_spec(name)])] for name in programs},
        compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
    )
    manager = edge.to_executorch()
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.pte"), "wb") as handle:
        manager.write_to_file(handle)
    manager.write_tensor_data_to_file(folder)
    from importlib.metadata import version

    files = {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}
    return {"seconds": round(time.perf_counter() - started, 1), "export_s": round(exported, 1), "executorch": version("executorch"), "files": files}


def set_switches(switches: dict[str, dict[str, Any]]) -> None:
    """Set kernel switches (module -> {name: value}) in this process, each checked to exist."""
    import importlib

    for module_name, values in switches.items():
        module = importlib.import_module(module_name)
        for name, value in values.items():
            if not hasattr(module, name):
                raise AttributeError(f"{module_name} has no switch {name}")
            setattr(module, name, value)


def _has_executorch() -> bool:
    import importlib.util

    return importlib.util.find_spec("executorch") is not None


def stage_compile(work: Path) -> dict[str, Any]:
    common = {"scripts": str(ROOT / "scripts"), "root": str(ROOT), "settings": dict(SETTINGS)}
    jobs: dict[str, str] = {}
    for build, keywords in BUILDS.items():
        if build not in SETTINGS["builds"]:
            continue
        path = artifact(work, build)
        path.unlink(missing_ok=True)
        jobs[build] = COMPILE_BUNDLE.format(**common, path=str(path), device=SETTINGS["device"], runtime=keywords["runtime"],
                                            options=keywords["options"], switches=keywords.get("switches", {}))
    if cuda() and SETTINGS["peers"]:
        jobs["torch package"] = COMPILE_TORCH_PACKAGE.format(**common, path=str(work / "decode.pt2"))
    if cuda() and "executorch" in SETTINGS["builds"] and _has_executorch():
        jobs["executorch"] = COMPILE_EXECUTORCH.format(**common, folder=str(work / "et"))
    return run_side_by_side(work, jobs, COMPILE_TIMEOUT_S)


def run_side_by_side(work: Path, jobs: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run each job's Python code in its own process, all at once; each one's last JSON line, or its error."""
    running = {}
    for name, code in jobs.items():
        log_file = open(work / f"compile-{''.join(c if c.isalnum() else '-' for c in name)}.log", "w")  # noqa: SIM115  (closed when the process is waited for)
        running[name] = (subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log_file, text=True), log_file, time.perf_counter())
    results: dict[str, Any] = {"side_by_side": list(jobs)}
    deadline = time.perf_counter() + timeout
    for name, (process, log_file, started) in running.items():
        try:
            out, _ = process.communicate(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
            results[name] = {"error": f"not done in {timeout:.0f} s (killed)"}
            log_file.close()
            continue
        log_file.close()
        wall = round(time.perf_counter() - started, 1)
        if process.returncode == 0 and out.strip():
            results[name] = {**json.loads(out.strip().splitlines()[-1]), "wall_s": wall}
        else:
            tail = Path(log_file.name).read_text().strip().splitlines()[-4:]
            results[name] = {"error": " | ".join(tail)[-800:], "wall_s": wall}
        log(f"{name}: {json.dumps(results[name])[:400]}")
        save_partial({"side by side so far": results})
    return results


# ---------------------------------------------------------------------------
# check

def eager_generation(module, prompt: np.ndarray, steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Eager logits of a prefill and `steps` greedy decodes, and the tokens it chose."""
    import torch

    device = SETTINGS["device"]
    eager = copy.deepcopy(module)
    logits, tokens = [], []
    with torch.no_grad():
        out = eager.prefill(torch.from_numpy(prompt).to(device), torch.arange(prompt.shape[1], device=device))
        for step in range(steps + 1):
            logits.append(out.float().cpu().numpy())
            token = int(out.argmax())
            tokens.append(token)
            if step == steps:
                break
            out = eager.decode(torch.tensor([[token]], device=device), torch.tensor([prompt.shape[1] + step], device=device))
    del eager
    if cuda():
        torch.cuda.empty_cache()
    return logits, tokens


def free_bytes() -> int:
    if not cuda():
        return 0
    import cupy

    return int(cupy.cuda.runtime.memGetInfo()[0])


def named(model, method: str, tokens: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
    """The inputs by the names the method gives them (a bundle's tokens/input_pos, a program's input_0/input_1)."""
    names = [spec.name for spec in model.method(method).spec.inputs]
    return dict(zip(names, (tokens, positions)))


def first_output(outputs: dict[str, np.ndarray]) -> np.ndarray:
    return next(iter(outputs.values()))


def check_build(path: Path, module, prompts: list[np.ndarray], references, cuda_graph: bool = False) -> dict[str, Any]:
    import cuda_runner

    free_before = free_bytes()
    started = time.perf_counter()
    with cuda_runner.load(path, SETTINGS["device"], cuda_graph=cuda_graph) as model:
        load_s = time.perf_counter() - started
        timings = {name: model.load_timings(name) for name in model.methods}
        lowest = free_bytes()
        report: dict[str, Any] = {"load_s": round(load_s, 3), "load_timings": timings, "provider": model.method("decode").provider,
                                  "constant_storages": model.constant_storages}
        worst = []
        for index, (prompt, (logits, tokens)) in enumerate(zip(prompts, references)):
            if index:
                model.reset_state()
            got = first_output(model.run(named(model, "prefill", prompt, np.arange(prompt.shape[1])), "prefill"))
            errors = [float(np.abs(got.astype(np.float32) - logits[0]).max())]
            agree = 0
            for step in range(len(tokens) - 1):
                out = first_output(model.run(named(model, "decode", np.array([[tokens[step]]]), np.array([prompt.shape[1] + step])), "decode"))
                errors.append(float(np.abs(out.astype(np.float32) - logits[step + 1]).max()))
                agree += int(np.argmax(out.astype(np.float32))) == tokens[step + 1]
                lowest = min(lowest, free_bytes())
            scale = float(max(np.abs(value).max() for value in logits))
            worst.append({"prompt": index, "max_abs_error": max(errors), "logit_scale": scale, "steps": len(errors) - 1,
                          "relative": round(max(errors) / scale, 5), "greedy_token_agreement": f"{agree}/{len(tokens) - 1}"})
        report["generations"] = worst
    weights, cache = module.parameter_bytes(), module.cache_bytes()
    peak = free_before - lowest
    report.update({"weight_bytes": weights, "cache_bytes": cache, "peak_gpu_bytes": peak, "peak_over_weights_and_cache": round(peak / (weights + cache), 3)})
    return report


def stage_check(work: Path) -> dict[str, Any]:
    module = build_llama()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, module.config.vocab, (1, SETTINGS["prompt"]), dtype=np.int64) for _ in range(2)]
    started = time.perf_counter()
    references = [eager_generation(module, prompt, SETTINGS["steps"] if index == 0 else 16) for index, prompt in enumerate(prompts)]
    results: dict[str, Any] = {"eager_reference_s": round(time.perf_counter() - started, 1)}
    for build in SETTINGS["builds"]:
        path = artifact(work, build)
        if path.exists():
            try:
                results[build] = check_build(path, module, prompts, references)
            except Exception as error:  # reported, and the next build is still checked
                results[build] = {"error": f"{type(error).__name__}: {error}"}
            log(f"check {build}: {json.dumps(results[build])[:600]}")
    first = artifact(work, SETTINGS["builds"][0])
    if cuda() and first.exists():  # the same generations replayed from CUDA graphs (their memory from the graphs' arenas)
        label = f"{SETTINGS['builds'][0]}, CUDA graph"
        try:
            results[label] = check_build(first, module, prompts, references, cuda_graph=True)
        except Exception as error:
            results[label] = {"error": f"{type(error).__name__}: {error}"}
        log(f"check {label}: {json.dumps(results[label])[:600]}")
    return results


# ---------------------------------------------------------------------------
# load: warm and cold

def drop_from_page_cache(path: Path) -> None:
    """Evict a file's (clean) pages, so that the next read comes from the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def read_file_s(path: Path) -> float:
    """Seconds to read the whole file once, 64 MB at a time into one buffer whose
    pages are mapped before the clock starts (a fresh 1 GiB buffer had every read
    fault its pages in: 1.9 GB/s from the page cache)."""
    buffer = bytearray(b"\1" * (64 << 20))
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass
    return time.perf_counter() - started


def weight_bytes(path: Path) -> int:
    """The bytes of a bundle's weights and state: its constant storages and blobs, each once."""
    import cuda_runner

    manifest = cuda_runner.read_manifest(path)
    segments = {constant.segment for spec in manifest.methods.values() for constant in spec.constants}
    segments |= {spec.weights_segment for spec in manifest.methods.values() if spec.weights_segment}
    return sum(manifest.segment(name).size for name in segments)


# Where the load_weights phase goes: the functions it calls, timed from outside (module, attribute, label).
LOAD_PARTS = (("cuda_runner.runtime.constants", "_internal_names", "match_names_s"),
              ("cuda_runner.runtime.constants", "_copy_storages", "allocate_and_upload_s"),
              ("cuda_runner.runtime.upload", "upload_all", "upload_s"),
              ("cuda_runner.runtime.container", "Container.bind_constants", "bind_s"))


@contextlib.contextmanager
def load_parts_timed(totals: dict[str, float]):
    """Wrap each of LOAD_PARTS so that its seconds add up in `totals`; unwrapped on exit."""
    import importlib

    undo = []
    for module_name, attribute, label in LOAD_PARTS:
        owner: Any = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)

        def timed(*args, _original=original, _label=label, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_label] = totals.get(_label, 0.0) + time.perf_counter() - started
        setattr(owner, name, timed)
        undo.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in undo:
            setattr(owner, name, original)


def timed_load(path: Path, **options: Any) -> dict[str, float]:
    import cuda_runner
    from cuda_runner.runtime import upload

    parts: dict[str, float] = {}
    started = time.perf_counter()
    with load_parts_timed(parts), cuda_runner.load(path, SETTINGS["device"], warm_up=False, **options) as model:
        total = time.perf_counter() - started
        weights = sum(model.load_timings(name).get("load_weights", 0.0) for name in model.methods)
        # The mapping's registrations, let go on a thread after the load returned (runtime/upload.py): when that ended.
        upload.wait_for_releases()
        parts["released_after_s"] = time.perf_counter() - started - total
    parts = {label: round(seconds, 4) for label, seconds in parts.items()}
    # What _copy_storages does besides the upload: the one device allocation and the views of the file.
    parts["allocate_s"] = round(parts.get("allocate_and_upload_s", 0.0) - parts.get("upload_s", 0.0), 4)
    return {"load_s": round(total, 4), "load_weights_s": round(weights, 4), **parts}


def stage_load(work: Path, rounds: int = 5) -> dict[str, Any]:
    path = artifact(work, SETTINGS["builds"][0])
    if not path.exists():
        return {"error": f"{path} is missing"}
    return load_results(path, rounds)


def stage_weights(work: Path, rounds: int = 5) -> dict[str, Any]:
    """The load stage on a bundle of the decoder's own parameters and buffers (its
    storages, their sizes and dtypes) read by two trivial methods: it compiles
    in about a minute where the decoder takes four or five, and loads as the decoder's does."""
    import cuda_runner

    path = work / "llama-weights.bundle"
    results: dict[str, Any] = {}
    if not path.exists():
        import torch

        torch.manual_seed(0)
        with torch.device(SETTINGS["device"]):
            module = TouchingDecoder(config()).eval()
        started = time.perf_counter()
        example = (torch.zeros(1, device=SETTINGS["device"]),)
        cuda_runner.compile_methods(module, {"touch": example, "touch_twice": example}, path, device=SETTINGS["device"])
        results["compile_s"] = round(time.perf_counter() - started, 1)
        del module
    return {**results, **load_results(path, rounds)}


class TouchingDecoder(scale_models.LlamaDecoder):
    """The decoder whose methods read one element of each parameter and buffer."""

    def touch(self, x):
        total = x
        for tensor in [*self.parameters(), *self.buffers()]:
            total = total + tensor.reshape(-1)[:1].float()
        return total

    def touch_twice(self, x):
        return self.touch(x) * 2


def load_results(path: Path, rounds: int) -> dict[str, Any]:
    size = weight_bytes(path)
    results: dict[str, Any] = {"weight_bytes": size, "bundle_bytes": path.stat().st_size}
    timed_load(path)  # the CUDA context, libraries and page cache
    results["variants, warm"] = load_variants(path, size, rounds)  # before the cold loads, which leave the cache as they found it only in part
    for label, cold in (("warm", False), ("cold", True)):
        samples = []
        for _ in range(rounds):
            if cold:
                drop_from_page_cache(path)
            samples.append(timed_load(path))
        best = min(samples, key=lambda sample: sample["load_weights_s"])
        median_weights = statistics.median(sample["load_weights_s"] for sample in samples)
        results[label] = {"samples": samples, "weights_gb_per_s_median": round(size / median_weights / 1e9, 2),
                          "weights_gb_per_s_best": round(size / best["load_weights_s"] / 1e9, 2)}
        log(f"load {label}: {results[label]}")
    drop_from_page_cache(path)
    results["plain_read_cold_gb_per_s"] = round(path.stat().st_size / read_file_s(path) / 1e9, 2)
    results["plain_read_warm_gb_per_s"] = round(path.stat().st_size / read_file_s(path) / 1e9, 2)
    return results


# What the warm load of the weights does with one thing changed
# (runtime/upload.py): the digest check that runs beside the upload left out,
# more upload threads, the registrations let go inline (as loads did before).
LOAD_VARIANTS: dict[str, dict[str, Any]] = {
    "as shipped": {},
    "registrations let go inline": {"upload": {"RELEASE_LATER_BYTES": 0}},
    "no digest check beside it": {"load": {"verify_weights": False}},
    "8 upload threads": {"upload": {"MAX_THREADS": 8}},
    "16 upload threads": {"upload": {"MAX_THREADS": 16}},
}


def load_variants(path: Path, size: int, rounds: int) -> dict[str, Any]:
    from cuda_runner.runtime import upload

    results: dict[str, Any] = {}
    for label, change in LOAD_VARIANTS.items():
        saved = {name: getattr(upload, name) for name in change.get("upload", {})}
        try:
            for name, value in change.get("upload", {}).items():
                setattr(upload, name, value)
            samples = [timed_load(path, **change.get("load", {})) for _ in range(rounds)]
        finally:
            for name, value in saved.items():
                setattr(upload, name, value)
        median_weights = statistics.median(sample["load_weights_s"] for sample in samples)
        results[label] = {"weights_gb_per_s_median": round(size / median_weights / 1e9, 2),
                          "upload_s": [sample.get("upload_s") for sample in samples],
                          "released_after_s": [sample.get("released_after_s") for sample in samples],
                          "load_weights_s": [sample["load_weights_s"] for sample in samples]}
        log(f"load variant {label}: {results[label]}")
    return results


# ---------------------------------------------------------------------------
# decode

def time_steps(step, count: int, warmup: int = 10) -> list[float]:
    for index in range(warmup):
        step(index)
    synchronize()
    samples = []
    for index in range(count):
        started = time.perf_counter()
        step(warmup + index)
        samples.append(time.perf_counter() - started)
    return samples


def position(index: int) -> int:
    """A position after the prompt for step `index`, cycling below the cache's end."""
    return SETTINGS["prompt"] + index % (config().max_seq - SETTINGS["prompt"] - 1)


def runner_paths(work: Path, count: int) -> dict[str, Any]:
    """Each build's decode step through cuda-runner: host arrays with and without a CUDA graph; device arrays."""
    import cuda_runner

    results: dict[str, Any] = {}
    token = np.array([[1]], np.int64)
    for build in SETTINGS["builds"]:
        path = artifact(work, build)
        if not path.exists():
            continue
        for graph in (False, True) if cuda() else (False,):
            label = f"cuda-runner {LABELS[build]}{', CUDA graph' if graph else ''}"
            try:
                with cuda_runner.load(path, SETTINGS["device"], cuda_graph=graph) as model:
                    step = lambda index: model.run(named(model, "decode", token, np.array([position(index)], np.int64)), "decode")  # noqa: E731
                    results[label] = summary(time_steps(step, count))
                    if cuda() and build == SETTINGS["builds"][0]:
                        results[f"{label}, device arrays"] = summary(time_steps(device_step(model), count))
                    if cuda() and graph and build == SETTINGS["builds"][0]:
                        results[f"{label}, device arrays, loop on the GPU"] = loop_on_gpu(runner_loop_step(model), count)
            except Exception as error:
                results[label] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            log(f"{label}: {results[label]}")
    return results


def graph_breakdown(work: Path, count: int) -> dict[str, Any]:
    """Where a graphed decode call's time goes, in the first build: the whole
    model.run, the graph executor's part of it, and that part's pieces (the
    inputs' bytes written where the graph copies them from, the launch, the
    wait, the copy into NumPy), beside the GPU's time for the replay alone
    (CUDA events around the graph launch). Reaches into the runtime's graph executor."""
    import cuda_runner
    from cuda_runner.runtime.tensors import gather

    path = artifact(work, SETTINGS["builds"][0])
    token = np.array([[1]], np.int64)
    results: dict[str, Any] = {}
    with cuda_runner.load(path, "cuda", cuda_graph=True) as model:
        step = lambda index: model.run(named(model, "decode", token, np.array([position(index)], np.int64)), "decode")  # noqa: E731
        results["model.run"] = summary(time_steps(step, count))
        executor = model.method("decode")._lanes.first  # the graph executor, its graph captured by the calls above
        captured = next(iter(executor._graphs.values()))
        inner = executor._executor
        arrays = [token, np.array([position(0)], np.int64)]
        order = [spec.name for spec in model.method("decode").spec.inputs]
        if order != ["tokens", "input_pos"]:
            arrays = arrays[::-1]
        results["graph executor run"] = summary(time_steps(lambda index: executor.run(arrays), count))
        parts: dict[str, list[float]] = {name: [] for name in ("inputs staged", "launch", "wait", "into NumPy")}
        for _ in range(count):
            marks = [time.perf_counter()]
            executor.stage_inputs(captured, arrays)
            marks.append(time.perf_counter())
            captured.graph.replay()
            marks.append(time.perf_counter())
            staged = executor.queue_downloads(captured)
            inner.stream.synchronize()
            marks.append(time.perf_counter())
            [gather(buffer, view) for buffer, view in zip(staged, captured.views)]
            marks.append(time.perf_counter())
            for name, (before, after) in zip(parts, itertools.pairwise(marks)):
                parts[name].append(after - before)
        results.update({name: summary(samples) for name, samples in parts.items()})
        results["GPU replay alone"] = summary(replays_timed(captured, inner.stream.ptr, count))
        if hasattr(captured.graph, "node_kinds"):  # a driver capture (cuda-runner's shim): what each launch walks
            results["graph nodes"] = captured.graph.node_kinds()
    log(f"graph breakdown: {json.dumps(results)}")
    return results


def replays_timed(captured, stream_pointer: int, count: int) -> list[float]:
    """The GPU's time for each of `count` replays of a captured graph, alone (CUDA
    events around each launch, synchronized after each). The replay holds the
    graph's copies in and out, since the graph does them (runtime/graphs.py)."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    stream = cupy.cuda.ExternalStream(stream_pointer)
    samples = []
    for _ in range(count):
        start.record(stream)
        captured.graph.replay()
        end.record(stream)
        end.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return samples


def graph_arena_pairs(work: Path, count: int, rounds: int = 2) -> dict[str, Any]:
    """The first build's graphed decode step with the capture's memory from the
    graph's arena and as the graph's own memory nodes (CUDA_RUNNER_GRAPH_ARENA=0),
    in one process, A B B A `rounds` times: model.run a step, the GPU's replay
    alone, and the graph's nodes."""
    import cuda_runner
    from cuda_runner.runtime import graphs

    path = artifact(work, SETTINGS["builds"][0])
    token = np.array([[1]], np.int64)
    results: dict[str, Any] = {}
    setting = graphs.GRAPH_ARENA
    for arena in [True, False, False, True] * rounds:
        graphs.GRAPH_ARENA = arena
        label = "arena" if arena else "memory nodes"
        with cuda_runner.load(path, "cuda", cuda_graph=True) as model:
            step = lambda index: model.run(named(model, "decode", token, np.array([position(index)], np.int64)), "decode")  # noqa: E731
            run = summary(time_steps(step, count))
            executor = model.method("decode")._lanes.first
            captured = next(iter(executor._graphs.values()))
            replay = summary(replays_timed(captured, executor._executor.stream.ptr, count))
            entry = results.setdefault(label, {"model.run": [], "GPU replay alone": []})
            entry["model.run"].append(run)
            entry["GPU replay alone"].append(replay)
            entry["graph nodes"] = captured.graph.node_kinds()
            entry["arena bytes"] = executor.arena_bytes
        log(f"{label}: model.run {run['median_ms']} ms, replay alone {replay['median_ms']} ms")
    graphs.GRAPH_ARENA = setting
    return results


def loop_on_gpu(step, count: int, warmup: int = 10, rounds: int = 3) -> dict[str, Any]:
    """A decode loop whose every token is picked on the GPU from the step before's
    logits (`step(index, token) -> next token`, a device array), waiting only at
    its end, as a loop that samples on the GPU runs: the time a step (the
    loop's wall time over its steps), where the host's work for a step overlaps
    the GPU's for the steps queued before it; `rounds` loops, their median and each."""
    try:
        token = step.first_token
        for index in range(warmup):
            token = step(index, token)
        synchronize()
        runs = []
        for _ in range(rounds):
            started = time.perf_counter()
            for index in range(count):
                token = step(warmup + index, token)
            synchronize()
            runs.append(round((time.perf_counter() - started) / count * 1e3, 4))
    except Exception as error:  # its own entry: the figures measured before it stand
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    return {"ms_per_step": statistics.median(runs), "runs_ms_per_step": runs, "steps": count, "warmup": warmup}


def runner_loop_step(model):
    """loop_on_gpu's step through run_device: the argmax of the bfloat16 logits' bits, on the method's stream."""
    import cupy

    method = model.method("decode")
    with method.stream.as_cupy():  # ready on the stream run_device copies them on
        positions = [cupy.asarray(np.array([position(index)], np.int64)) for index in range(64)]
        first_token = cupy.asarray(np.array([[1]], np.int64))

    def step(index: int, token):
        with method.stream.as_cupy():
            logits = first_output(method.run_device(named(model, "decode", token, positions[index % 64])))
            as_float = (logits.reshape(-1).astype(cupy.uint32) << 16).view(cupy.float32)
            return cupy.argmax(as_float).reshape(1, 1).astype(cupy.int64)

    step.first_token = first_token  # type: ignore[attr-defined]
    return step


def torch_loop_step(decode, mark_step: bool = False):
    """loop_on_gpu's step for a torch callable of (tokens, input_pos) returning the logits."""
    import torch

    positions = [torch.tensor([position(index)], device="cuda") for index in range(64)]

    def step(index: int, token):
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        logits = decode(token, positions[index % 64])
        logits = logits[0] if isinstance(logits, (list, tuple)) else logits
        return logits.reshape(-1).argmax().view(1, 1)

    step.first_token = torch.tensor([[1]], device="cuda")  # type: ignore[attr-defined]
    return step


def device_step(model):
    """A decode step on CuPy arrays (the token and position already on the GPU), synchronized."""
    import cupy

    token = cupy.asarray(np.array([[1]], np.int64))
    positions = [cupy.asarray(np.array([position(index)], np.int64)) for index in range(64)]

    def step(index: int) -> None:
        model.run_device(named(model, "decode", token, positions[index % 64]), "decode")
        cupy.cuda.runtime.deviceSynchronize()

    return step


def peers(work: Path, module, count: int) -> dict[str, Any]:
    """Eager, torch.compile(reduce-overhead) and torch's own AOTI package, on the same decode step."""
    import torch

    results: dict[str, Any] = {}
    device = SETTINGS["device"]
    tok = torch.tensor([[1]], device=device)
    positions = [torch.tensor([position(index)], device=device) for index in range(64)]
    with torch.no_grad():
        results["eager PyTorch"] = summary(time_steps(lambda i: (module.decode(tok, positions[i % 64]), synchronize()), count))
        log(f"eager: {results['eager PyTorch']}")
        if not cuda():
            return results
        try:
            started = time.perf_counter()
            compiled = torch.compile(module.decode, mode="reduce-overhead", fullgraph=True)
            for index in range(3):
                compiled(tok, positions[index])
            results["torch.compile reduce-overhead compile_s"] = round(time.perf_counter() - started, 1)

            def compiled_step(index):
                torch.compiler.cudagraph_mark_step_begin()
                compiled(tok, positions[index % 64]).clone()
                torch.cuda.synchronize()
            results["torch.compile(mode=reduce-overhead)"] = summary(time_steps(compiled_step, count))
            results["torch.compile(mode=reduce-overhead), loop on the GPU"] = loop_on_gpu(torch_loop_step(compiled, mark_step=True), count)
        except Exception as error:
            results["torch.compile(mode=reduce-overhead)"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        log(f"torch.compile: {results['torch.compile(mode=reduce-overhead)']}")
    package = work / "decode.pt2"
    try:
        from torch._inductor import aoti_load_package

        loaded = aoti_load_package(str(package))
        results["torch aoti_load_package"] = summary(time_steps(lambda i: (loaded(tok, positions[i % 64]), torch.cuda.synchronize()), count))
        with torch.no_grad():
            results["torch aoti_load_package, loop on the GPU"] = loop_on_gpu(torch_loop_step(loaded), count)
    except Exception as error:
        results["torch aoti_load_package"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    log(f"aoti package: {results['torch aoti_load_package']}")
    return results


def stage_decode(work: Path, count: int) -> dict[str, Any]:
    module = build_llama()
    # What one decode step must read at least: every weight but the embedding table (one row of it), and the KV cache.
    embedding = module.embedding.weight.numel() * module.embedding.weight.element_size()
    floor_bytes = module.parameter_bytes() - embedding + module.cache_bytes()
    rate = hbm_bytes_per_s()
    results: dict[str, Any] = {"hbm_bytes_per_s": rate, "hbm_floor_ms": round(module.parameter_bytes() / rate * 1e3, 4),
                               "hbm_floor_step_bytes_ms": round(floor_bytes / rate * 1e3, 4)}
    results.update(runner_paths(work, count))
    if SETTINGS["peers"]:
        results.update(peers(work, module, count))
    del module
    if cuda():
        results["profile"] = profile_steps(work, SETTINGS["builds"][0])
        for build in SETTINGS["builds"][1:]:
            if build != "executorch":
                results[f"profile {build}"] = profile_steps(work, build)
    results["cli bench --steps"] = cli_bench(work, graph=False)
    if cuda():
        results["cli bench --steps --cuda-graph"] = cli_bench(work, graph=True)
        results["cli bench --steps --cuda-graph, programmatic launches off and on"] = programmatic_pairs(work)
    return results


def programmatic_pairs(work: Path, rounds: int = 3) -> dict[str, Any]:
    """`cuda-runner bench --cuda-graph` with the shim's programmatic launches off
    (CUDA_RUNNER_PDL=0) and on, alternately, `rounds` times: each run's median
    step in ms, and each setting's median of those."""
    runs: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for setting, name in (("0", "off"), ("1", "on")):
            bench = cli_bench(work, graph=True, environment={"CUDA_RUNNER_PDL": setting})
            runs[name].append(round(bench["step_s"]["median"] * 1e3, 4) if "step_s" in bench else float("nan"))
    return {"median_ms": {name: statistics.median(values) for name, values in runs.items()}, "runs_ms": runs}


def profile_steps(work: Path, build: str) -> dict[str, Any]:
    """Where a decode step of a bundle goes: CUPTI kernel times (torch.profiler sees every kernel in the process)."""
    import torch

    import cuda_runner

    path = artifact(work, build)
    if not path.exists():
        return {}
    token = np.array([[1]], np.int64)
    with cuda_runner.load(path) as model:
        step = lambda index: model.run({"tokens": token, "input_pos": np.array([position(index)], np.int64)}, "decode")  # noqa: E731
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
    top = sorted(((sum(values) / count, name, len(values) // count) for name, values in kernels.items()), reverse=True)[:40]
    return {"wall_per_step_ms": round(wall * 1e3, 4), "kernel_time_per_step_ms": round(total * 1e3, 4),
            "kernels_per_step": sum(len(values) for values in kernels.values()) // count,
            "top": [{"kernel": name[:120], "ms_per_step": round(seconds * 1e3, 4), "launches_per_step": launches} for seconds, name, launches in top]}


def cli_bench(work: Path, graph: bool, environment: dict[str, str] | None = None) -> dict[str, Any]:
    path = artifact(work, SETTINGS["builds"][0])
    warmup = 20
    steps = min(200, config().max_seq - SETTINGS["prompt"] - warmup - 1)  # every position inside the cache
    command = [sys.executable, "-m", "cuda_runner", "bench", str(path), "--method", "decode", "--prefill", "prefill",
               "--prompt-length", str(SETTINGS["prompt"]), "--steps", str(steps), "--warmup", str(warmup), "--range", f"tokens=0:{config().vocab}",
               "--json"]
    if graph:
        command.append("--cuda-graph")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, **(environment or {})})
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-500:]}
    return json.loads(done.stdout)["decode"]


# ---------------------------------------------------------------------------
# big models


COMPILE_BIG = """
import sys, time, json, copy, faulthandler
faulthandler.dump_traceback_later(60, repeat=True)  # where a slow compile spends its time, in its log
sys.path.insert(0, {scripts!r}); sys.path.insert(0, {root!r})
import bench_scale, cuda_runner
from cuda_runner.compile import aot
module, methods = bench_scale.big_model({name!r})
examples = {{method: tuple(arg.cuda() for arg in args) for method, args in methods.items()}}
notes = []
started = time.perf_counter()
manifest = cuda_runner.compile_methods(module.cuda(), examples, {path!r}, device="cuda", warn=notes.append,
                                       options=aot.QUICK_OPTIONS if {quick!r} else None)
print(json.dumps({{"seconds": round(time.perf_counter() - started, 1), "notes": notes, "methods": bench_scale.how_built(manifest)}}))
"""


def big_model(name: str):
    """The module (random weights, seeded) and its methods' example inputs, on the CPU."""
    import torch

    torch.manual_seed(0)
    if name == "vit_b16":
        return scale_models.VisionTransformer(scale_models.VIT_B16).eval(), {"forward": (torch.randn(1, 3, 224, 224),)}
    if name == "resnet50":
        return scale_models.randomize_batch_norms(scale_models.resnet50()).eval(), {"forward": (torch.randn(1, 3, 224, 224),)}
    return scale_models.Whisper(scale_models.WHISPER_BASE).eval(), scale_models.whisper_examples(scale_models.WHISPER_BASE)


def stage_big(work: Path, count: int, measure: bool = True) -> dict[str, Any]:
    """The big models compiled side by side (those not compiled by an earlier big-compile stage), then measured."""
    import torch

    common = {"scripts": str(ROOT / "scripts"), "root": str(ROOT)}
    paths = {name: work / f"{name}.bundle" for name in BIG if name in SETTINGS["big"]}
    jobs = {name: COMPILE_BIG.format(**common, name=name.removesuffix("-quick"), path=str(path), quick=name.endswith("-quick"))
            for name, path in paths.items() if not path.exists()}
    results: dict[str, Any] = {"compile": run_side_by_side(work, jobs, COMPILE_TIMEOUT_S) if jobs else "compiled before"}
    for name, path in paths.items() if measure else ():
        if not path.exists():
            continue
        module, methods = big_model(name.removesuffix("-quick"))
        results[name] = measure_big(work, name, path, module.cuda(), methods, count)
        log(f"{name}: {json.dumps(results[name])[:600]}")
        save_partial(results)
        del module
        torch.cuda.empty_cache()
    return results


def measure_big(work: Path, name: str, path: Path, module: Any, methods: dict[str, tuple], count: int) -> dict[str, Any]:
    """One model: its first method through the CLI with --expected against eager and timed by `bench`, beside eager and torch.compile."""
    import torch

    import cuda_runner

    examples = {method: tuple(arg.cuda() for arg in args) for method, args in methods.items()}
    entry: dict[str, Any] = {"parameters": sum(p.numel() for p in module.parameters())}
    first = next(iter(methods))
    inputs = examples[first]
    try:
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
                                "--iterations", str(count), "--json"], capture_output=True, text=True, timeout=600)
        if bench.returncode == 0:
            document = json.loads(bench.stdout)
            host, device = document["steady_s"]["median"], (document["device_resident_s"] or {}).get("median")
            entry["cuda-runner host to host ms"] = round(host * 1e3, 4)
            entry["cuda-runner device arrays ms"] = round(device * 1e3, 4) if device else None
            entry["copies and checks share"] = round(1 - device / host, 3) if device else None
        else:
            entry["bench_error"] = bench.stderr.strip()[-300:]
        if "decode" in methods:
            entry["decode"] = whisper_decode_check(path, module, examples)
        call = getattr(module, first)
        with torch.no_grad():
            entry["eager ms"] = summary(time_steps(lambda i: (call(*inputs), torch.cuda.synchronize()), count))["median_ms"]
            try:
                started = time.perf_counter()
                compiled = torch.compile(call)
                compiled(*inputs)
                entry["torch.compile compile_s"] = round(time.perf_counter() - started, 1)
                entry["torch.compile ms"] = summary(time_steps(lambda i: (compiled(*inputs), torch.cuda.synchronize()), count))["median_ms"]
            except Exception as error:
                entry["torch.compile"] = f"{type(error).__name__}: {str(error)[:200]}"
    except Exception as error:
        entry["error"] = f"{type(error).__name__}: {str(error)[:400]}"
    return entry


def whisper_decode_check(path: Path, module: Any, examples: dict[str, tuple]) -> dict[str, Any]:
    """16 greedy decoder steps with the cache against eager, both fed eager's encoding of the same audio (so
    that only the decoder is compared), the error of each step; and the step's time beside eager's."""
    import torch

    import cuda_runner

    eager = copy.deepcopy(module)
    steps = 16
    with torch.no_grad():
        audio = eager.encode(*examples["encode"])
        reference, tokens = [], [1]
        for step in range(steps):
            out = eager.decode(torch.tensor([[tokens[-1]]], device="cuda"), torch.tensor([step], device="cuda"), audio)
            reference.append(out.float().cpu().numpy())
            tokens.append(int(out.argmax()))
        again = copy.deepcopy(module)  # eager against itself: how far two eager runs differ
        repeat = 0.0
        for step in range(steps):
            out = again.decode(torch.tensor([[tokens[step]]], device="cuda"), torch.tensor([step], device="cuda"), audio)
            repeat = max(repeat, float(np.abs(out.float().cpu().numpy() - reference[step]).max()))
        eager_step = summary(time_steps(lambda i: (eager.decode(torch.tensor([[1]], device="cuda"), torch.tensor([i % 400], device="cuda"), audio),
                                                   torch.cuda.synchronize()), 100))["median_ms"]
    features = audio.cpu().numpy()
    with cuda_runner.load(path) as model:
        names = [spec.name for spec in model.method("decode").spec.inputs]
        errors = []
        for step in range(steps):
            out = first_output(model.run(dict(zip(names, (np.array([[tokens[step]]]), np.array([step]), features))), "decode"))
            errors.append(round(float(np.abs(out.astype(np.float32) - reference[step]).max()), 6))
        model.reset_state()
        step_s = summary(time_steps(lambda i: model.run(dict(zip(names, (np.array([[1]]), np.array([i % 400]), features))), "decode"), 100))
    return {"steps": steps, "max_abs_error_per_step": errors, "eager_vs_eager": repeat, "logit_scale": float(max(np.abs(value).max() for value in reference)),
            "cuda-runner step ms": step_s["median_ms"], "eager step ms": eager_step}


COMPILE_WHISPER_DECODE = """
import sys, time, json
sys.path.insert(0, {scripts!r}); sys.path.insert(0, {root!r})
import bench_scale, cuda_runner
module, methods = bench_scale.big_model("whisper_base")
examples = {{"decode": tuple(arg.cuda() for arg in methods["decode"])}}
notes = []
started = time.perf_counter()
manifest = cuda_runner.compile_methods(module.cuda(), examples, {path!r}, device="cuda", runtime={runtime!r}, options={options!r},
                                       warn=notes.append)
print(json.dumps({{"seconds": round(time.perf_counter() - started, 1), "notes": notes, "methods": bench_scale.how_built(manifest)}}))
"""

# (--libtorch was measured too: 2.3e-5 - 6.1e-5 per step, docs/benchmarks.md.)
WHISPER_VARIANTS = {"default": ("auto", None), "default, no coordinate descent": ("auto", {"coordinate_descent_tuning": False})}


def stage_whisper(work: Path) -> dict[str, Any]:
    """Whisper-base's decoder alone, built three ways, stepped against eager on eager's audio encoding."""
    import torch

    common = {"scripts": str(ROOT / "scripts"), "root": str(ROOT)}
    paths = {label: work / f"whisper-decode-{index}.bundle" for index, label in enumerate(WHISPER_VARIANTS)}
    jobs = {f"whisper decode {label}": COMPILE_WHISPER_DECODE.format(**common, path=str(paths[label]), runtime=runtime, options=options)
            for label, (runtime, options) in WHISPER_VARIANTS.items() if not paths[label].exists()}
    results: dict[str, Any] = {"compile": run_side_by_side(work, jobs, COMPILE_TIMEOUT_S) if jobs else "compiled before"}
    module, methods = big_model("whisper_base")
    module = module.cuda()
    examples = {method: tuple(arg.cuda() for arg in args) for method, args in methods.items()}
    for label, path in paths.items():
        if path.exists():
            try:
                results[label] = whisper_decode_check(path, module, examples)
            except Exception as error:
                results[label] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            log(f"whisper decode {label}: {results[label]}")
    del module
    torch.cuda.empty_cache()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="compile,check,load,decode,big")
    parser.add_argument("--work", type=Path, default=Path("/tmp/cuda-runner-scale"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=200, help="timed steps (calls) per path")
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the script (tiny size)")
    parser.add_argument("--builds", default=",".join(SETTINGS["builds"]),
                        help="the decoder's builds to compile, check and time (the first is the one load, profile and the CLI use)")
    parser.add_argument("--no-peers", action="store_true", help="leave out eager, torch.compile and torch's package")
    parser.add_argument("--big", default=",".join(BIG), help="the big models the big stages compile and measure")
    options = parser.parse_args()
    if unknown := set(options.big.split(",")) - set(BIG):
        parser.error(f"--big: unknown model(s) {', '.join(sorted(unknown))}; the big models are {', '.join(BIG)}")
    SETTINGS.update(size=options.size, device=options.device, builds=options.builds.split(","), peers=not options.no_peers,
                    big=options.big.split(","))
    if options.size == "tiny":
        SETTINGS.update(prompt=6, steps=8)
    options.work.mkdir(parents=True, exist_ok=True)
    out = options.out or options.work
    out.mkdir(parents=True, exist_ok=True)
    import torch

    machine = {"device": torch.cuda.get_device_name(0) if cuda() else "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "size": options.size}
    for stage in options.stages.split(","):
        log(f"stage {stage}")
        started = time.perf_counter()
        PARTIAL[0] = out / f"scale-{stage}.partial.json"
        if stage == "compile":
            result = stage_compile(options.work)
        elif stage == "check":
            result = stage_check(options.work)
        elif stage == "load":
            result = stage_load(options.work)
        elif stage == "weights":
            result = stage_weights(options.work)
        elif stage == "decode":
            result = stage_decode(options.work, options.steps)
        elif stage == "breakdown":
            result = graph_breakdown(options.work, options.steps)
        elif stage == "arena":
            result = graph_arena_pairs(options.work, options.steps)
        elif stage == "big":
            result = stage_big(options.work, options.steps)
        elif stage == "big-compile":
            result = stage_big(options.work, options.steps, measure=False)
        elif stage == "whisper":
            result = stage_whisper(options.work)
        else:
            parser.error(f"unknown stage {stage!r}")
        result = {"machine": machine, "stage_s": round(time.perf_counter() - started, 1), **result}
        text = json.dumps(result, indent=1, default=str)
        (out / f"scale-{stage}.json").write_text(text)
        PARTIAL[0].unlink(missing_ok=True)
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
