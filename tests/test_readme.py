"""Every example in README.md runs, so the documentation cannot drift."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cuda_runner.runtime.devices import cuda_device_count
from helpers import run_cli

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
HAS_GPU = cuda_device_count() > 0


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.DOTALL)


def _commands() -> list[str]:
    section = README.split("## Using it", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.startswith("cuda-runner")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    import models
    import torch

    folder = tmp_path_factory.mktemp("readme")
    module, args, dynamic_shapes = models.dict_mlp()
    torch.export.save(torch.export.export(module, args, dynamic_shapes=dynamic_shapes), folder / "program.pt2")
    torch.export.save(torch.export.export(torch.nn.Linear(16, 4).eval(), (torch.randn(2, 16),)), folder / "enc.pt2")
    torch.export.save(torch.export.export(torch.nn.Linear(4, 2).eval(), (torch.randn(2, 4),)), folder / "dec.pt2")
    x = np.random.default_rng(0).standard_normal((4, 16), dtype=np.float32)
    np.save(folder / "x.npy", x)
    np.save(folder / "bias.npy", np.zeros(8, np.float32))
    np.savez(folder / "inputs.npz", x=x, bias=np.zeros(8, np.float32))
    return folder


def test_readme_has_the_two_fresh_machine_commands():
    assert "./scripts/demo.sh" in README and "./scripts/test.sh" in README
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci


def test_every_readme_command_runs(workdir):
    commands = _commands()
    assert len(commands) >= 10
    for command in commands:
        argv = shlex.split(command)[1:]
        result = run_cli(*argv, cwd=workdir)
        if "--device" in argv and argv[argv.index("--device") + 1].startswith("cuda") and not HAS_GPU:
            assert result.returncode == 4 and "needs a CUDA GPU" in result.stderr, command
            continue
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    assert (workdir / "out" / "logits.npy").exists()
    assert (workdir / "replay" / "inputs.npz").exists()


def test_readme_python_examples_run(workdir):
    for block in _blocks("python"):
        if block.startswith("# needs a GPU") and not HAS_GPU:
            continue
        result = subprocess.run([sys.executable, "-c", block], cwd=workdir, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{block}\n{result.stderr}"
