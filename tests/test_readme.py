"""Every example in README.md runs, and does what the README says it does."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, cli

from cuda_runner.runtime.devices import cuda_device_count

README = (ROOT / "README.md").read_text()
# Under xdist this file's tests run on one worker, handed out first
# (conftest.SAME_WORKER): the Python examples use the model.bundle that the
# commands compiled in the module's folder.
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
    # enc: the same graph as the README's Python example; dec: a batch with no upper bound.
    torch.manual_seed(0)
    encoder = torch.nn.Linear(16, 4).eval()
    torch.export.save(torch.export.export(encoder, (torch.randn(2, 16),), dynamic_shapes={"input": {0: torch.export.Dim("batch")}}), folder / "enc.pt2")
    torch.export.save(torch.export.export(torch.nn.Linear(4, 2).eval(), (torch.randn(2, 4),), dynamic_shapes={"input": {0: torch.export.Dim("n")}}),
                      folder / "dec.pt2")
    x = np.random.default_rng(0).standard_normal((4, 16), dtype=np.float32)
    np.save(folder / "x.npy", x)
    np.save(folder / "bias.npy", np.zeros(8, np.float32))
    np.savez(folder / "inputs.npz", x=x, bias=np.zeros(8, np.float32))
    (folder / "sets").mkdir()
    for index in range(3):
        np.savez(folder / "sets" / f"set{index}.npz", x=x[: index + 1], bias=np.zeros(8, np.float32))
    return folder, module


def test_readme_has_the_two_fresh_machine_commands():
    assert "./scripts/demo.sh" in README and "./scripts/test.sh" in README
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_every_readme_command_runs_and_does_what_it_says(workdir):
    folder, module = workdir
    commands = _commands()
    assert len(commands) >= 12
    documents = {}
    for command in commands:
        argv = shlex.split(command)[1:]
        result = cli(*argv, cwd=folder)
        if "--device" in argv and argv[argv.index("--device") + 1].startswith("cuda") and not HAS_GPU:
            assert result.returncode == 4 and "needs a CUDA GPU" in result.stderr, command
            continue
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
        if "--json" in argv:
            documents[command] = json.loads(result.stdout)
    _check_results(folder, module, documents)


def _check_results(folder: Path, module, documents: dict) -> None:
    import torch

    x = np.load(folder / "x.npy")
    with torch.no_grad():
        eager = module(torch.from_numpy(x), torch.zeros(8))
    np.testing.assert_allclose(np.load(folder / "out" / "logits.npy"), eager["logits"].numpy(), rtol=1e-5, atol=1e-5)
    with np.load(folder / "all.npz") as archive:
        assert sorted(archive.files) == ["aux.hidden", "aux.loss", "logits"]
        np.testing.assert_array_equal(archive["logits"], np.load(folder / "out" / "logits.npy"))
    with np.load(folder / "replay" / "inputs.npz") as replay:
        assert replay["x"].shape == (8, 16)
    np.testing.assert_allclose(np.load(folder / "batch-out" / "set2" / "logits.npy"), eager["logits"].numpy()[:3], rtol=1e-5, atol=1e-5)
    by_schema = {document["schema"].rsplit("/", 1)[0]: document for document in documents.values()}
    assert by_schema["cuda-runner/inspect"]["verified"] is True
    assert by_schema["cuda-runner/inspect"]["methods"]["forward"]["library_check"] == "passed"
    assert by_schema["cuda-runner/bench"]["verdict"] == "PASSED" and by_schema["cuda-runner/bench"]["gates"][0]["gate"] == "max_p99_ms"
    literal = next(doc for command, doc in documents.items() if "bias=8xf32=0.5" in command)
    assert [entry["source"] for entry in literal["inputs"]] == ["file", "literal"]
    two = json.loads(cli("inspect", str(folder / "two.bundle"), "--json").stdout)
    (dim,) = two["methods"]["decode"]["dims"].values()
    assert dim["max"] is None  # exported without a maximum: unbounded
    assert sorted(two["methods"]) == ["decode", "encode"]


def test_readme_python_examples_run(workdir):
    folder, _ = workdir
    if not (folder / "model.bundle").exists():
        assert cli("compile", "program.pt2", "-o", "model.bundle", cwd=folder).returncode == 0
    for block in _blocks("python"):
        if block.startswith("# needs a GPU") and not HAS_GPU:
            continue
        result = subprocess.run([sys.executable, "-c", block], cwd=folder, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{block}\n{result.stderr}"
    import cuda_runner

    with cuda_runner.load(folder / "linear.bundle") as model:
        (dim,) = model.method().spec.dims.values()
        assert dim.max is None
        assert model.run([np.ones((300, 16), np.float32)])["output_0"].shape == (300, 4)
