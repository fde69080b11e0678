"""What must never crash, hang, leak or lie: threads, lying manifests, load cycles, unbounded dims."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import replace

import numpy as np
import pytest

import cuda_runner
from cuda_runner.errors import BundleError
from cuda_runner.format import open_bundle, write_bundle


def _inputs(batch: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 16), dtype=np.float32), "bias": rng.standard_normal(8, dtype=np.float32)}


@pytest.mark.parametrize("lanes", [1, 2])
def test_many_threads_on_one_model_give_single_threaded_results(compiled, device, lanes):
    cases = [_inputs(1 + index % 7, index) for index in range(24)]
    with cuda_runner.load(compiled("dict_mlp", device).path, lanes=lanes) as model:
        expected = [model.run(case) for case in cases]
        results: dict[int, dict[str, np.ndarray]] = {}
        errors: list[BaseException] = []

        def worker(offset: int) -> None:
            try:
                for repeat in range(5):
                    for index in range(offset, len(cases), 6):
                        results[index * 10 + repeat] = model.run(cases[index])
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(offset,)) for offset in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []
    assert len(results) == len(cases) * 5
    for key, outputs in results.items():
        for name, array in outputs.items():
            np.testing.assert_array_equal(array, expected[key // 10][name])


def _lying_copy(source, target, change):
    with open_bundle(source) as reader:
        manifest = reader.manifest
        segments = {entry.name: bytes(reader.segment(entry.name)) for entry in manifest.segments}
    method = manifest.methods["forward"]
    write_bundle(target, replace(manifest, methods={"forward": change(method)}), segments)
    return target


def _declare_bias(method, dtype="float32", shape=(8,)):
    bias = replace(method.inputs[1], dtype=dtype, shape=shape)
    return replace(method, inputs=(method.inputs[0], bias))


@pytest.mark.parametrize(("change", "bias"), [
    (lambda method: _declare_bias(method, shape=(4,)), np.zeros(4, np.float32)),  # smaller than the library reads
    (lambda method: _declare_bias(method, dtype="float64"), np.zeros(8, np.float64)),
])
def test_a_manifest_that_lies_about_the_library_is_refused_with_input_checks(compiled, device, tmp_path, change, bias):
    lying = _lying_copy(compiled("dict_mlp", device).path, tmp_path / "lying.bundle", change)
    with cuda_runner.load(lying, check_inputs=True) as model, pytest.raises(BundleError, match="manifest does not match the library"):
        model.run({"x": np.ones((2, 16), np.float32), "bias": bias})


def test_inspect_verify_runs_the_library_checks(dict_mlp_bundle, tmp_path):
    from cuda_runner.inspection import inspect_bundle

    honest = inspect_bundle(dict_mlp_bundle.path, verify=True)
    assert honest.verified and honest.methods["forward"].library_check == "passed"
    lying = _lying_copy(dict_mlp_bundle.path, tmp_path / "lying.bundle", lambda method: _declare_bias(method, shape=(4,)))
    result = inspect_bundle(lying, verify=True)
    assert result.verified is False and not result.runnable_here
    assert "manifest does not match the library" in (result.methods["forward"].library_check or "")


def test_load_run_close_cycles_do_not_grow_memory_or_fail(compiled, device):
    """500 cycles in a fresh process: RSS growth under 20 MB, no failure."""
    dict_mlp_bundle = compiled("dict_mlp", device)
    script = f"""
import numpy as np, cuda_runner, resource
inputs = {{"x": np.ones((2, 16), np.float32), "bias": np.zeros(8, np.float32)}}
def rss_mb():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
for _ in range(20):
    with cuda_runner.load({str(dict_mlp_bundle.path)!r}) as model:
        model.run(inputs)
before = rss_mb()
for _ in range(500):
    with cuda_runner.load({str(dict_mlp_bundle.path)!r}) as model:
        model.run(inputs)
print(rss_mb() - before)
"""
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.strip()) < 20


def test_compiled_libraries_have_no_gnu_unique_symbols(dict_mlp_bundle, tmp_path):
    """Without STB_GNU_UNIQUE a library can be unloaded once no live thread used it."""
    import shutil

    if shutil.which("readelf") is None:
        pytest.skip("readelf is not installed")
    with open_bundle(dict_mlp_bundle.path) as reader:
        library = bytes(reader.segment("forward_so_blob"))
    (tmp_path / "model.so").write_bytes(library)
    symbols = subprocess.run(["readelf", "-sW", str(tmp_path / "model.so")], capture_output=True, text=True, check=True).stdout
    assert " UNIQUE " not in symbols
