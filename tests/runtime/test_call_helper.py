"""The call helper: a bundle's native one-call path, and the ctypes path it replaces."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import cli

import cuda_runner
from cuda_runner.compile import helper as helper_build
from cuda_runner.compile import with_call_helper
from cuda_runner.errors import BundleError
from cuda_runner.format import write_bundle
from cuda_runner.format.bundle import open_bundle
from cuda_runner.format.manifest import CALL_HELPER


def _inputs(builder: str, batch: int) -> dict[str, np.ndarray]:
    generator = np.random.default_rng(batch)
    if builder == "dict_mlp":
        return {"x": generator.standard_normal((batch, 16), np.float32), "bias": generator.standard_normal(8, np.float32)}
    if builder == "embedder":
        return {"ids": generator.integers(0, 50, (3, 6)), "scale": np.array(0.25, np.float32)}
    return {"x": generator.standard_normal((2, 32)).astype(ml_dtypes.bfloat16)}


@pytest.mark.parametrize("builder", ["dict_mlp", "embedder", "bf16_mlp"])
def test_the_helper_and_ctypes_give_the_same_outputs(compiled, builder):
    """Several inputs and outputs, a non-contiguous output (embedder), bfloat16,
    and a batch that changes between calls (the frame's sizes are rewritten)."""
    path = compiled(builder, "cpu").path
    with cuda_runner.load(path) as fast, cuda_runner.load(path, call_helper=False) as plain:
        assert fast.method().call_path == "call helper"
        assert plain.method().call_path == "ctypes: the call helper is turned off"
        for batch in (4, 1, 7, 4):
            inputs = _inputs(builder, batch)
            with_helper, without = fast.run(inputs), plain.run(inputs)
            assert list(with_helper) == list(without)
            for name in without:
                assert with_helper[name].dtype == without[name].dtype
                np.testing.assert_array_equal(with_helper[name], without[name])


def test_compiled_bundles_carry_the_helper_as_a_digested_segment(dict_mlp_bundle):
    with open_bundle(dict_mlp_bundle.path) as reader:
        spec = reader.manifest.methods["forward"]
        assert spec.call_helper_segment == helper_build.SEGMENT_NAME
        assert CALL_HELPER in reader.manifest.optional_features
        assert reader.read_verified(spec.call_helper_segment)[:4] == b"\x7fELF"
    with cuda_runner.load(dict_mlp_bundle.path) as model:
        assert "load_call_helper" in model.load_timings()


def _segment_span(path: Path, name: str) -> tuple[int, int]:
    with open_bundle(path) as reader:
        entry = reader.manifest.segment(name)
        assert entry is not None
        return entry.offset, entry.size


def test_a_damaged_helper_is_refused_before_it_loads(dict_mlp_bundle, tmp_path):
    damaged = tmp_path / "damaged.bundle"
    shutil.copy(dict_mlp_bundle.path, damaged)
    offset, size = _segment_span(damaged, helper_build.SEGMENT_NAME)
    with open(damaged, "r+b") as handle:
        handle.seek(offset + size // 2)
        byte = handle.read(1)
        handle.seek(offset + size // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(BundleError, match=helper_build.SEGMENT_NAME):
        cuda_runner.load(damaged)
    with cuda_runner.load(damaged, call_helper=False) as model:  # never read, so never refused
        model.run(_inputs("dict_mlp", 2))


def _with_helper_bytes(source: Path, destination: Path, library: bytes) -> None:
    with open_bundle(source) as reader:
        segments = {entry.name: bytes(reader.segment(entry.name)) for entry in reader.manifest.segments}
        segments[helper_build.SEGMENT_NAME] = library
        write_bundle(destination, reader.manifest, segments)


def _c_compiler() -> str | None:
    """A C compiler for building test helpers: $CC, or cc/gcc/clang on PATH (as compile looks for one)."""
    return next((found for name in (os.environ.get("CC"), "cc", "gcc", "clang") if name and (found := shutil.which(name))), None)


def _build_helper(tmp_path: Path, *defines: str) -> bytes:
    compiler = _c_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    output = tmp_path / "helper.so"
    subprocess.run([compiler, "-O2", "-fPIC", "-shared", "-fvisibility=hidden", *defines, "-o", str(output), str(helper_build.SOURCE)], check=True)
    return output.read_bytes()


def test_a_helper_of_another_abi_falls_back_to_ctypes(dict_mlp_bundle, tmp_path):
    newer = tmp_path / "newer.bundle"
    _with_helper_bytes(dict_mlp_bundle.path, newer, _build_helper(tmp_path, "-DCALL_HELPER_ABI=99"))
    inputs = _inputs("dict_mlp", 3)
    with cuda_runner.load(newer) as model, cuda_runner.load(dict_mlp_bundle.path) as reference:
        assert model.method().call_path == "ctypes: the call helper speaks ABI 99, this runtime 1"
        for name, array in reference.run(inputs).items():
            np.testing.assert_array_equal(model.run(inputs)[name], array)


def test_a_segment_that_is_not_a_helper_is_refused(dict_mlp_bundle, tmp_path):
    with open_bundle(dict_mlp_bundle.path) as reader:
        library = bytes(reader.segment(reader.manifest.methods["forward"].library_segment))
    wrong = tmp_path / "wrong.bundle"
    _with_helper_bytes(dict_mlp_bundle.path, wrong, library)  # a model library where the helper should be
    with pytest.raises(BundleError, match="not a cuda-runner call helper"):
        cuda_runner.load(wrong)
    garbage = tmp_path / "garbage.bundle"
    _with_helper_bytes(dict_mlp_bundle.path, garbage, b"not an ELF file at all")
    with pytest.raises(BundleError, match="not a shared library"):
        cuda_runner.load(garbage)


def test_a_newer_helper_with_other_entry_points_falls_back(dict_mlp_bundle, tmp_path):
    newer = tmp_path / "newer.bundle"
    library = _build_helper(tmp_path, "-DCALL_HELPER_ABI=2", "-Dcuda_runner_call=cuda_runner_call_v2", "-Dcuda_runner_call_layout=cuda_runner_layout_v2")
    _with_helper_bytes(dict_mlp_bundle.path, newer, library)
    with cuda_runner.load(newer) as model:
        assert model.method().call_path == "ctypes: the call helper speaks ABI 2, this runtime 1"
        model.run(_inputs("dict_mlp", 2))


def test_a_helper_this_machine_cannot_load_falls_back(dict_mlp_bundle, tmp_path):
    """As a helper built against a newer libtorch would: it needs a function this one lacks."""
    compiler = _c_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    source = tmp_path / "needs.c"
    source.write_text("extern int aoti_torch_function_from_the_future(void);\nint cuda_runner_call_abi(void) { return aoti_torch_function_from_the_future(); }\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "needs.so"), str(source)], check=True)
    unloadable = tmp_path / "unloadable.bundle"
    _with_helper_bytes(dict_mlp_bundle.path, unloadable, (tmp_path / "needs.so").read_bytes())
    with cuda_runner.load(unloadable) as model:
        assert model.method().call_path.startswith("ctypes: the call helper cannot be loaded here")
        model.run(_inputs("dict_mlp", 2))


def test_why_a_method_runs_without_the_helper(dict_mlp_bundle, tmp_path):
    """Method.call_path says why calls go through ctypes: the helper turned off,
    or a bundle without one (CUDA graphs: tests/gpu)."""
    with cuda_runner.load(dict_mlp_bundle.path) as model:
        assert model.method().call_path == "call helper"
    with cuda_runner.load(dict_mlp_bundle.path, call_helper=False) as model:
        assert model.method().call_path == "ctypes: the call helper is turned off"
    with open_bundle(dict_mlp_bundle.path) as reader:
        manifest = reader.manifest
        segments = {entry.name: bytes(reader.segment(entry.name)) for entry in manifest.segments if entry.name != helper_build.SEGMENT_NAME}
    spec = dataclasses.replace(manifest.methods["forward"], call_helper_segment=None)
    features = type(manifest.optional_features)(feature for feature in manifest.optional_features if feature != CALL_HELPER)
    without = tmp_path / "without.bundle"
    write_bundle(without, dataclasses.replace(manifest, methods={"forward": spec}, optional_features=features), segments)
    inputs = _inputs("dict_mlp", 3)
    with cuda_runner.load(without) as model, cuda_runner.load(dict_mlp_bundle.path) as reference:
        assert model.method().call_path == "ctypes: the bundle has no call helper"
        np.testing.assert_array_equal(model.run(inputs)["logits"], reference.run(inputs)["logits"])


def test_without_a_c_compiler_bundles_are_written_without_the_helper(monkeypatch, dict_mlp_bundle, tmp_path):
    """No CC and a PATH with no compiler on it: what a machine without one looks like to compile."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(helper_build, "build_call_helper", helper_build.build_call_helper.__wrapped__)  # not the process's cached build
    with open_bundle(dict_mlp_bundle.path) as reader:
        methods = dict(reader.manifest.methods)
    notes: list[str] = []
    segments: dict[str, bytes] = {}
    updated, note = with_call_helper(methods, segments, notes.append)
    assert note is not None and "no C compiler" in note and notes == [note]
    assert segments == {} and updated == methods


def test_a_failed_run_through_the_helper_is_reported(dict_mlp_bundle, tmp_path):
    """The library's own checks refuse what the manifest allowed: a bundle whose
    manifest says the batch goes up to 128 where the library was compiled for 64.
    The helper returns Run's failure, and the runner names the manifest as the cause."""
    with open_bundle(dict_mlp_bundle.path) as reader:
        manifest = reader.manifest
        segments = {entry.name: bytes(reader.segment(entry.name)) for entry in manifest.segments}
    spec = manifest.methods["forward"]
    assert spec.dims["batch"].max == 64
    dims = {**spec.dims, "batch": dataclasses.replace(spec.dims["batch"], max=128)}
    lying = tmp_path / "lying.bundle"
    write_bundle(lying, dataclasses.replace(manifest, methods={**manifest.methods, "forward": dataclasses.replace(spec, dims=dims)}), segments)
    with cuda_runner.load(lying, check_inputs=True) as model:
        method = model.method()
        assert method.call_path == "call helper"
        with pytest.raises(BundleError, match=r"does not match the library.*too large"):
            method.run({"x": np.zeros((100, 16), np.float32), "bias": np.zeros(8, np.float32)})
        inputs = _inputs("dict_mlp", 2)
        with cuda_runner.load(dict_mlp_bundle.path) as reference:
            np.testing.assert_array_equal(method.run(inputs)["logits"], reference.run(inputs)["logits"])  # and the method still runs


@pytest.mark.parametrize(("flag", "expected"), [((), True), (("--no-call-helper",), False), (("--call-helper",), True)])
def test_compile_passes_the_call_helper_choice_on(monkeypatch, tmp_path, flag, expected):
    import zipfile

    import cuda_runner.compile as compile_package
    import cuda_runner.compile.isolated as isolated
    from cuda_runner.format import Manifest

    seen = {}

    def record(programs, output, **options):
        seen.update(options)
        return Manifest(methods={})

    monkeypatch.setattr(compile_package, "compile_programs", record)
    # The compile's own process, here in this one, so that it sees the stand-in above.
    monkeypatch.setattr(isolated, "run_in_process_group", lambda function, kwargs, report: function(report, **kwargs))
    with zipfile.ZipFile(tmp_path / "p.pt2", "w") as archive:  # passes the checks made before the compile starts
        archive.writestr("p/version", "1")
    result = cli("compile", str(tmp_path / "p.pt2"), "-o", str(tmp_path / "m.bundle"), *flag)
    assert result.returncode == 0, result.stderr
    assert seen["call_helper"] is expected


def test_the_helper_source_builds_without_warnings(tmp_path):
    assert _build_helper(tmp_path, "-std=c11", "-Wall", "-Wextra", "-Werror")[:4] == b"\x7fELF"
