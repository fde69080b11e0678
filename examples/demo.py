"""Compile the example model for the device this machine has, then run it
through the command line, as a user would. Used by scripts/demo.sh."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def example_model():
    """A small model with a dynamic batch and named (nested dict) outputs."""
    import torch

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.nn.Linear(16, 32)
            self.head = torch.nn.Linear(32, 8)

        def forward(self, x: torch.Tensor, bias: torch.Tensor):
            hidden = torch.relu(self.encoder(x))
            return {"logits": self.head(hidden) + bias, "aux": {"loss": hidden.mean(), "hidden": hidden}}

    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=64)
    return Classifier().eval(), (torch.randn(4, 16), torch.randn(8)), {"x": {0: batch}, "bias": None}


def main() -> int:
    import torch

    import cuda_runner
    from cuda_runner.runtime.devices import cuda_device_count

    device = "cuda" if cuda_device_count() > 0 and torch.cuda.is_available() else "cpu"
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "demo-out")
    work.mkdir(parents=True, exist_ok=True)
    bundle = work / f"dict_mlp-{device}.bundle"
    module, args, dynamic_shapes = example_model()
    print(f"compiling the example model for {device} into {bundle} ...", flush=True)
    started = time.perf_counter()
    cuda_runner.compile_module(module, args, bundle, device=device, dynamic_shapes=dynamic_shapes, metadata={"example": "dict_mlp"})
    print(f"compiled in {time.perf_counter() - started:.1f} s", flush=True)
    np.save(work / "x.npy", np.random.default_rng(0).standard_normal((4, 16), dtype=np.float32))
    np.save(work / "bias.npy", np.zeros(8, np.float32))
    cli = [sys.executable, "-m", "cuda_runner"]
    subprocess.run([*cli, "inspect", str(bundle)], check=True)
    command = [*cli, "run", str(bundle), "--inputs", str(work / "x.npy"), "--inputs", f"bias={work / 'bias.npy'}", "--out-dir", str(work / "outputs"), "--print"]
    print("$ cuda-runner " + " ".join(command[3:]), flush=True)
    started = time.perf_counter()
    result = subprocess.run(command)
    print(f"cold `cuda-runner run` on {device}: {time.perf_counter() - started:.3f} s wall (a fresh process)")
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())
