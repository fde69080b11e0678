"""--provider and the torch-free path, through the real command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import cli, run_cli

from cuda_runner.format.bundle import read_manifest
from cuda_runner.runtime.providers import own_shim_path

pytestmark = pytest.mark.skipif(own_shim_path() is None, reason="the shim is built by pip install (scripts/test.sh)")

# In this process `import torch` fails, and find_spec("torch") says it is not installed.
NO_TORCH = "import sys\nsys.modules['torch'] = None\n"


@pytest.fixture
def no_torch_env(tmp_path):
    folder = tmp_path / "no-torch"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(NO_TORCH)
    return {"PYTHONPATH": os.pathsep.join([str(folder), *sys.path])}


@pytest.mark.heavy
@pytest.mark.parametrize("provider", ["shim", None])  # None: auto, which has only the shim when torch is missing
def test_a_cpu_bundle_runs_and_verifies_in_a_process_without_torch(dict_mlp_bundle, tmp_path, no_torch_env, provider):
    reference = tmp_path / "ref"
    first = run_cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--out-dir", str(reference))
    assert first.returncode == 0, first.stderr
    extra = ["--provider", provider] if provider else []
    result = run_cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--expected", str(reference), *extra, env=no_torch_env)
    assert result.returncode == 0, result.stderr
    assert "VERDICT: PASSED" in result.stdout


def test_no_libtorch_is_mapped_when_a_bundle_runs_on_the_shim(dict_mlp_bundle, no_torch_env):
    code = (
        "import numpy as np, cuda_runner\n"
        f"m = cuda_runner.load({str(dict_mlp_bundle.path)!r})\n"
        "m.run({'x': np.ones((4, 16), np.float32), 'bias': np.zeros(8, np.float32)})\n"
        "print(m.method().provider, 'libtorch' in open('/proc/self/maps').read())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, **no_torch_env), timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cuda-runner", "shim", "False"]


def test_an_unknown_provider_is_a_usage_error(dict_mlp_bundle):
    result = cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--provider", "tensorrt")
    assert result.returncode == 2
    assert result.error_lines == ["error: unknown provider 'tensorrt'; choose one of: auto, shim, libtorch"]


def test_bench_and_inspect_say_which_provider_runs_the_library(dict_mlp_bundle):
    bench = cli("bench", str(dict_mlp_bundle.path), "--iterations", "3", "--warmup", "1", "--provider", "shim", "--json")
    assert bench.returncode == 0, bench.stderr
    assert json.loads(bench.stdout)["provider"] == "cuda-runner shim"
    inspected = cli("inspect", str(dict_mlp_bundle.path), "--json")
    method = json.loads(inspected.stdout)["methods"]["forward"]
    assert method["needs_libtorch"] is False and method["provider_note"] == "cuda-runner's shim (no torch needed)"


@pytest.mark.heavy
def test_compile_standalone_for_cpu_writes_a_bundle_that_runs_without_torch(tmp_path, no_torch_env):
    import torch

    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).eval()
    program = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(module, (torch.randn(2, 8),)), program)
    bundle = tmp_path / "m.bundle"
    # Inductor's kernels as programmatic dependents asked for too: a CPU build cannot take them, and says so.
    compiled = run_cli("compile", str(program), "--standalone", "--quick", "-o", str(bundle), "--option",
                       "cuda_runner.programmatic_inductor_kernels=true")
    assert compiled.returncode == 0, compiled.stderr
    assert "Inductor's kernels as programmatic dependents were asked for and not taken (it needs a standalone CUDA build" in compiled.stderr
    result = run_cli("run", str(bundle), "--random-inputs", "--provider", "shim", "--json", env=no_torch_env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["outputs"]
    # --quick's preset is what the library was built with, and the manifest says so.
    options = read_manifest(bundle).methods["forward"].compile_options
    assert options["test_configs.max_mm_configs"] == 1 and options["standalone"] is True
    assert options["cuda_runner.programmatic_inductor_kernels"] is True and "programmatic_inductor_kernels" not in options
    assert options["programmatic_inductor_kernels_unavailable"].startswith("it needs a standalone CUDA build")


def test_quick_and_autotune_are_refused_together(tmp_path):
    result = cli("compile", str(tmp_path / "m.pt2"), "--quick", "--autotune", "-o", str(tmp_path / "m.bundle"))
    assert result.returncode == 2 and "--quick and --autotune" in result.stderr


VERSIONED = """
extern int aoti_torch_get_dim(void *, long *);
int model_run(void *handle, long *dim) { return aoti_torch_get_dim(handle, dim); }
"""


def _library_with_a_versioned_import(folder) -> bytes:
    """A library whose aoti_torch_ import asks for a symbol version (linked against a provider that defines one)."""
    import shutil

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    (folder / "provider.c").write_text("int aoti_torch_get_dim(void *h, long *d) { *d = 0; return 0; }\n")
    (folder / "provider.map").write_text("TORCH_2 { global: aoti_torch_get_dim; local: *; };\n")
    (folder / "model.c").write_text(VERSIONED)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "libprovider.so"), str(folder / "provider.c"),
                    f"-Wl,--version-script={folder / 'provider.map'}"], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "model.so"), str(folder / "model.c"), f"-L{folder}", "-lprovider"], check=True)
    return (folder / "model.so").read_bytes()


def test_inspect_and_run_use_one_rule_for_a_library_the_shim_cannot_bind(tmp_path, no_torch_env):
    """A versioned aoti_torch_ import: inspect said "runs on: cuda-runner's shim" while run --provider shim refused it."""
    from forge import forge, method

    library = _library_with_a_versioned_import(tmp_path)
    bundle = tmp_path / "versioned.bundle"
    bundle.write_bytes(forge({"format": "cuda-runner-bundle", "methods": {"forward": method(weights=None)}}, {"m_so": library}))
    reason = "its imports cannot be bound to cuda-runner's shim (its import 'aoti_torch_get_dim' asks for a symbol version"
    shown = cli("inspect", str(bundle))
    assert shown.returncode == 0, shown.stderr
    assert f"runs on: libtorch ({reason}" in shown.stdout
    document = json.loads(cli("inspect", str(bundle), "--json").stdout)
    assert document["methods"]["forward"]["needs_libtorch"] is True
    refused = cli("run", str(bundle), "--random-inputs", "--shape", "x=2x4", "--provider", "shim")
    assert refused.returncode == 4
    assert refused.error_lines[0].startswith(f"error: {reason}")
    without_torch = run_cli("run", str(bundle), "--random-inputs", "--shape", "x=2x4", env=no_torch_env)
    assert without_torch.returncode == 4
    assert f"needs libtorch ({reason}" in without_torch.stderr


@pytest.mark.heavy
@pytest.mark.parametrize("fixture", ["tiny_vit", "tiny_resnet", "bf16_mlp"])
def test_convolutions_attention_and_half_precision_run_without_torch(compiled, tmp_path, no_torch_env, fixture):
    """ViT-B/16's and ResNet-50's code at tiny sizes compiled --standalone (convolutions,
    attention from its math form, LayerNorm, GELU, batch norm), and a bfloat16 MLP: each runs in a
    process where torch cannot be imported, on the shim, and matches eager through the CLI."""
    import numpy as np
    import torch
    from helpers import to_tensor

    model = compiled(fixture, "cpu")
    inputs = [arg.float().numpy() if arg.dtype != torch.bfloat16 else arg.view(torch.int16).numpy().view(__import__("ml_dtypes").bfloat16)
              for arg in model.args]
    with torch.no_grad():
        expected = model.module(*[to_tensor(torch, array) for array in inputs])
    reference = expected.view(torch.int16).numpy().view(__import__("ml_dtypes").bfloat16) if expected.dtype == torch.bfloat16 else expected.numpy()
    np.savez(tmp_path / "in.npz", **{name: array for name, array in zip(_input_names(model.path), inputs)})
    np.savez(tmp_path / "ref.npz", output_0=reference)
    result = run_cli("run", str(model.path), "--inputs", str(tmp_path / "in.npz"), "--expected", str(tmp_path / "ref.npz"), "--json", env=no_torch_env)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["verdict"] == "PASSED" and document["provider"] == "cuda-runner shim"


def _input_names(path):
    import cuda_runner

    return [tensor.name for tensor in cuda_runner.read_manifest(path).methods["forward"].inputs]


BROKEN_TORCH = "raise ImportError('this torch install is broken')\n"


@pytest.fixture
def broken_torch_env(tmp_path):
    """A `torch` package that is found first and neither imports nor has libtorch."""
    package = tmp_path / "broken" / "torch"
    (package / "lib").mkdir(parents=True)
    (package / "__init__.py").write_text(BROKEN_TORCH)
    return {"PYTHONPATH": os.pathsep.join([str(package.parent), *sys.path])}


def test_auto_runs_a_gemm_library_on_the_shim_with_torch_installed(dict_mlp_bundle):
    """The shim's GEMMs (OpenBLAS) are as fast as libtorch's on CPU (docs/standalone.md), so auto keeps torch out."""
    inspected = cli("inspect", str(dict_mlp_bundle.path))
    assert "runs on: cuda-runner's shim (no torch needed)" in inspected.stdout
    result = cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["provider"] == "cuda-runner shim"


@pytest.mark.heavy
def test_auto_runs_convolutions_on_libtorch_and_on_the_shim_when_torch_is_broken(compiled, broken_torch_env):
    """libtorch's convolution is measurably faster, so auto takes it where torch works; a torch
    install that is found but broken must not stop a library the shim can run."""
    model = compiled("tiny_resnet", "cpu")
    inspected = cli("inspect", str(model.path))
    assert "runs on: libtorch where it is installed, for its aoti_torch_cpu_convolution (faster there)" in inspected.stdout
    with_torch = cli("run", str(model.path), "--random-inputs", "--json")
    assert with_torch.returncode == 0, with_torch.stderr
    assert json.loads(with_torch.stdout)["provider"] == "libtorch"
    broken = run_cli("run", str(model.path), "--random-inputs", "--json", env=broken_torch_env)
    assert broken.returncode == 0, broken.stderr
    assert json.loads(broken.stdout)["provider"] == "cuda-runner shim"
