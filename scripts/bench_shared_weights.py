"""Memory of a two-method bundle whose methods share their weights, with and
without sharing (docs/bundle-format.md, "Shared weights").

One module, `SharedStack`: a stack of square Linear layers (about `--mb` MB
of float32 weights) read by two methods, `prefill` (T rows, then a small head
only it has) and `decode` (one row). It is compiled twice with
`cuda_runner.compile_methods`:

  - shared: `share_weights=True` (the default): every layer's weight is one
    segment that both methods name;
  - separate: `share_weights=False`: each method keeps its own weights blob,
    as bundles did before.

Each bundle is then loaded with both methods in a fresh process (so that
nothing another load left behind is counted), and measured there:

  - on CUDA, device memory in use (cudaMemGetInfo through CuPy) after the
    CUDA context is made and before the load, against after the load and one
    call of each method (synchronised): the model's weights, its kernels and
    the memory its calls keep;
  - on CPU, the process's anonymous resident memory (RssAnon: the copies of
    the weights, not the pages of the mapped bundle file);

with the runtime's own counter (`Model.constant_storages`), the weight bytes
the bundle stores, and each method's largest error against eager PyTorch on
the same inputs (computed before compiling, on the same device).

    python scripts/bench_shared_weights.py --device cuda              # ~256 MB of weights (GPU machine)
    python scripts/bench_shared_weights.py --device cpu --mb 8        # the logic, on any machine
    [--mb MB] [--hidden N] [--work-dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
PREFILL_ROWS = 8
ATOL, RTOL = 1e-4, 1e-3  # fp32 against eager; GEMM reduction orders differ


def build_module(mb: float, hidden: int) -> Any:
    import torch

    class SharedStack(torch.nn.Module):
        """`prefill` and `decode` read every layer; the head is prefill's alone."""

        def __init__(self, layers: int, hidden: int):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
            self.head = torch.nn.Linear(hidden, 16)

        def forward(self, x: Any) -> Any:
            return self.prefill(x)

        def prefill(self, x: Any) -> Any:
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return self.head(x)

        def decode(self, x: Any) -> Any:
            for layer in self.layers:
                x = torch.relu(layer(x)) + x
            return x

    layer_mb = hidden * (hidden + 1) * 4 / 1e6
    layers = max(1, round(mb / layer_mb))
    torch.manual_seed(0)
    return SharedStack(layers, hidden).eval(), layers


def _anon_rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(bundle: str, device: str, io_path: str) -> dict[str, Any]:
    """In the child process: load both methods, run each once, say what it cost."""
    import cuda_runner

    arrays = dict(np.load(io_path))
    runtime = None
    if device.startswith("cuda"):
        from cupy_backends.cuda.api import runtime

        runtime.setDevice(int(device.partition(":")[2] or 0))
        runtime.free(0)  # the context, before the baseline: it is not the model's
        runtime.deviceSynchronize()
        before = runtime.memGetInfo()[0]
    else:
        before = _anon_rss()
    started = time.perf_counter()
    model = cuda_runner.load(bundle, device)
    load_s = time.perf_counter() - started
    errors, passed = {}, {}
    for method in ("prefill", "decode"):
        output = model.run({"x": arrays[f"{method}_x"]}, method=method)["output_0"]
        expected = arrays[f"{method}_expected"]
        errors[method] = float(np.max(np.abs(output - expected)))
        passed[method] = bool(np.allclose(output, expected, rtol=RTOL, atol=ATOL))
    if runtime is not None:
        runtime.deviceSynchronize()
        used = before - runtime.memGetInfo()[0]
    else:
        used = _anon_rss() - before
    storages = model.constant_storages
    model.close()
    return {"used_bytes": used, "constant_storages": storages, "load_s": load_s, "max_abs_error": errors, "matches_eager": passed}


def weight_bytes(bundle: Path) -> int:
    """Bytes of weights the bundle stores: its blobs and constant-table segments, each once."""
    from cuda_runner.format.bundle import read_manifest

    manifest = read_manifest(bundle)
    names = {spec.weights_segment for spec in manifest.methods.values() if spec.weights_segment}
    names |= {constant.segment for spec in manifest.methods.values() for constant in spec.constants}
    return sum(entry.size for entry in manifest.segments if entry.name in names)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--mb", type=float, default=None, help="MB of shared float32 weights (default 256 on CUDA, 8 on CPU)")
    parser.add_argument("--hidden", type=int, default=None, help="layer width (default 2048 on CUDA, 512 on CPU)")
    parser.add_argument("--work-dir", default=None, help="where the bundles go (default: a temporary folder, removed)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--measure", nargs=2, metavar=("BUNDLE", "IO.npz"), help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.device, args.measure[1])))
        return 0
    on_cuda = args.device.startswith("cuda")
    mb = args.mb if args.mb is not None else (256.0 if on_cuda else 8.0)
    hidden = args.hidden if args.hidden is not None else (2048 if on_cuda else 512)
    with tempfile.TemporaryDirectory(prefix="bench-shared-") as temporary:
        folder = Path(args.work_dir or temporary)
        folder.mkdir(parents=True, exist_ok=True)
        return _bench(args.device, mb, hidden, folder, args.json)


def _bench(device: str, mb: float, hidden: int, folder: Path, json_path: str | None) -> int:
    import torch

    import cuda_runner

    module, layers = build_module(mb, hidden)
    shared_mb = layers * hidden * (hidden + 1) * 4 / 1e6
    print(f"{layers} shared Linear({hidden}, {hidden}) layers, {shared_mb:.1f} MB of float32 shared by prefill and decode, on {device}", flush=True)
    generator = torch.Generator().manual_seed(1)
    inputs = {"prefill": torch.randn(PREFILL_ROWS, hidden, generator=generator), "decode": torch.randn(1, hidden, generator=generator)}
    with torch.no_grad():
        eager_module = module.to(device)
        expected = {name: getattr(eager_module, name)(value.to(device)).cpu().numpy() for name, value in inputs.items()}
    module = module.cpu()
    io_path = folder / "io.npz"
    np.savez(io_path, **{f"{name}_x": value.numpy() for name, value in inputs.items()}, **{f"{name}_expected": value for name, value in expected.items()})
    rows = []
    for variant, share in (("shared", True), ("separate", False)):
        bundle = folder / f"{variant}.bundle"
        started = time.perf_counter()
        cuda_runner.compile_methods(module, {name: (value,) for name, value in inputs.items()}, bundle, device=device, share_weights=share)
        compile_s = time.perf_counter() - started
        child = subprocess.run([sys.executable, __file__, "--device", device, "--measure", str(bundle), str(io_path)],
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
        if child.returncode != 0:
            print(child.stderr, file=sys.stderr)
            raise SystemExit(f"measuring {variant} failed (exit {child.returncode})")
        figures = json.loads(child.stdout.strip().splitlines()[-1])
        figures.update(variant=variant, compile_s=compile_s, bundle_bytes=bundle.stat().st_size, weight_bytes=weight_bytes(bundle))
        rows.append(figures)
    what = "GPU memory used" if device.startswith("cuda") else "anonymous RSS"
    header = f"{'variant':<9}  {'bundle MB':>9}  {'weights stored MB':>17}  {'storages':>8}  {what + ' MB':>20}  {'load s':>6}  max abs err prefill / decode"
    print(header)
    failed = False
    for row in rows:
        failed |= not all(row["matches_eager"].values())
        shown = " / ".join(f"{row['max_abs_error'][name]:.3g}{'' if row['matches_eager'][name] else ' FAIL'}" for name in ("prefill", "decode"))
        print(f"{row['variant']:<9}  {row['bundle_bytes'] / 1e6:9.1f}  {row['weight_bytes'] / 1e6:17.1f}  {row['constant_storages']:8d}  "
              f"{row['used_bytes'] / 1e6:20.1f}  {row['load_s']:6.2f}  {shown}")
    shared, separate = rows
    saved = separate["used_bytes"] - shared["used_bytes"]
    print(f"sharing saves {saved / 1e6:.1f} MB of {what} ({shared_mb:.1f} MB of weights are shared), "
          f"and {(separate['weight_bytes'] - shared['weight_bytes']) / 1e6:.1f} MB of bundle")
    if json_path:
        Path(json_path).write_text(json.dumps({"device": device, "layers": layers, "hidden": hidden, "shared_mb": shared_mb, "rows": rows}, indent=2))
    if failed:
        print("FAILED: an output differs from eager beyond the tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
