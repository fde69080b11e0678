"""ExecuTorch programs run end to end: programs written by tests/et_writer.py
around the dict_mlp library compiled in this session (two inputs, three
outputs, a dynamic batch), in all three payload layouts, run directly and
converted, and compared with the bundle the library came from."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest
from et_writer import MethodPlan, TensorValue, Weight, write_program
from helpers import cli

import cuda_runner
from cuda_runner.arrays import SCALAR_TYPE_CODES
from cuda_runner.errors import BundleError, ModelRuntimeError
from cuda_runner.format.bundle import open_bundle

FLOAT32 = SCALAR_TYPE_CODES["float32"]
BOUND = 1  # ExecuTorch's DYNAMIC_BOUND


def _library_constants(bundle: Path) -> set[str]:
    """The FQNs the library holds as constants: a bias the compiler folded into
    the code is not one (ExecuTorch lists exactly these in its manifest)."""
    with cuda_runner.load(bundle) as model:
        return {info.fqn for info in model.method().library_constants()}


def _weights(module, keep: set[str]) -> list[Weight]:
    weights = []
    for fqn, tensor in module.state_dict().items():
        if fqn not in keep:
            continue
        array = tensor.detach().contiguous().numpy()
        strides = tuple(stride // array.itemsize for stride in array.strides)
        weights.append(Weight(fqn, array.tobytes(), SCALAR_TYPE_CODES[str(array.dtype)], tuple(array.shape), strides))
    return weights


def _dict_mlp_plan(compiled, **fields) -> MethodPlan:
    """The `forward` of a program around the session's dict_mlp library: two
    inputs, three outputs, a batch bounded at 64 (MethodPlan fields to add)."""
    model = compiled("dict_mlp", "cpu")
    with open_bundle(model.path) as reader:
        library = bytes(reader.read_verified("forward_so_blob"))
        blob = bytes(reader.segment("forward_weights_blob"))
    inputs = [TensorValue(FLOAT32, (64, 16), BOUND), TensorValue(FLOAT32, (8,))]
    outputs = [TensorValue(FLOAT32, (64, 8), BOUND), TensorValue(FLOAT32, ()), TensorValue(FLOAT32, (64, 32), BOUND)]
    return MethodPlan("forward", library, inputs, outputs, weights_blob=blob, **fields)


def _write(folder: Path, method: MethodPlan, layout: str) -> Path:
    """model.pte, with its aoti_cuda_blob.ptd beside it, in `folder`."""
    pte, ptd = write_program([method], layout)
    (folder / "model.pte").write_bytes(pte)
    (folder / "aoti_cuda_blob.ptd").write_bytes(ptd)
    return folder / "model.pte"


@pytest.fixture(scope="module")
def programs(compiled, tmp_path_factory) -> dict[str, Path]:
    """layout -> model.pte, with its aoti_cuda_blob.ptd beside it."""
    model = compiled("dict_mlp", "cpu")
    weights = _weights(model.module, _library_constants(model.path))
    return {layout: _write(tmp_path_factory.mktemp(f"et_{layout}"), _dict_mlp_plan(compiled, weights=weights, copies=layout != "G1"), layout)
            for layout in ("G1", "G2", "G3")}


def _inputs(batch: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"input_0": rng.standard_normal((batch, 16), dtype=np.float32), "input_1": rng.standard_normal(8, dtype=np.float32)}


def _reference(compiled, arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    with cuda_runner.load(compiled("dict_mlp", "cpu").path) as bundle:
        outputs = bundle.run({"x": arrays["input_0"], "bias": arrays["input_1"]})
    return [outputs["logits"], outputs["aux.loss"], outputs["aux.hidden"]]


@pytest.mark.parametrize("layout", ["G1", "G2", "G3"])
def test_programs_run_exactly_like_their_bundle(programs, compiled, layout):
    arrays = _inputs()
    with cuda_runner.load(programs[layout]) as model:
        method = model.method()
        assert not method.check_inputs  # as in ExecuTorch: dtype, rank and bounds are checked, not strides
        outputs = model.run(arrays)
    for got, expected in zip([outputs["output_0"], outputs["output_1"], outputs["output_2"]], _reference(compiled, arrays)):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("layout", ["G1", "G3"])
def test_a_converted_program_runs_exactly_like_the_program(programs, tmp_path, layout):
    converted = tmp_path / "m.bundle"
    assert cli("convert", str(programs[layout]), "-o", str(converted)).returncode == 0
    arrays = _inputs(7)
    with cuda_runner.load(programs[layout]) as program, cuda_runner.load(converted) as bundle:
        # The same methods; the bundle adds the call helper, which a program cannot carry.
        assert {name: dataclasses.replace(spec, call_helper_segment=None) for name, spec in bundle.manifest.methods.items()} == program.manifest.methods
        assert bundle.method().call_path == "call helper" and program.method().call_path.startswith("ctypes")
        direct, through_bundle = program.run(arrays), bundle.run(arrays)
    for name in direct:
        np.testing.assert_array_equal(direct[name], through_bundle[name])


def test_a_size_the_library_was_not_built_for_is_refused_with_check_inputs(programs):
    """The program only bounds input_0's dims: with check_inputs the library's
    checks refuse 15 columns; without them (the default, as ExecuTorch runs) the
    run fails as a runtime error, not a crash."""
    arrays = _inputs()
    arrays["input_0"] = np.zeros((5, 15), np.float32)
    with cuda_runner.load(programs["G2"], check_inputs=True) as model, pytest.raises(BundleError, match="does not match the library"):
        model.run(arrays)
    with cuda_runner.load(programs["G2"]) as model, pytest.raises(ModelRuntimeError):
        model.run(arrays)


def test_run_cli_with_expected_and_data(programs, compiled, tmp_path):
    arrays = _inputs()
    np.savez(tmp_path / "in.npz", **arrays)
    reference = _reference(compiled, arrays)
    np.savez(tmp_path / "ref.npz", output_0=reference[0], output_1=reference[1], output_2=reference[2])
    folder = programs["G3"].parent
    result = cli("run", str(programs["G3"]), "--data", str(folder / "aoti_cuda_blob.ptd"), "--inputs", str(tmp_path / "in.npz"),
                 "--expected", str(tmp_path / "ref.npz"), "--out-dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "VERDICT: PASSED" in result.stdout
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["output_0.npy", "output_1.npy", "output_2.npy"]
    bench = cli("bench", str(programs["G3"]), "--iterations", "5", "--warmup", "1", "--json")
    assert bench.returncode == 0, bench.stderr


def test_weights_that_do_not_match_the_library_are_refused(compiled, tmp_path):
    model = compiled("dict_mlp", "cpu")
    with open_bundle(model.path) as reader:
        library = bytes(reader.read_verified("forward_so_blob"))
    weights = _weights(model.module, _library_constants(model.path))
    inputs = [TensorValue(FLOAT32, (64, 16), BOUND), TensorValue(FLOAT32, (8,))]
    outputs = [TensorValue(FLOAT32, (64, 8), BOUND), TensorValue(FLOAT32, ()), TensorValue(FLOAT32, (64, 32), BOUND)]
    cases = {
        "missing": (weights[1:], "do not supply"),
        "extra": ([*weights, Weight("stray.weight", b"\0" * 4, FLOAT32, (1,), (1,))], "does not have"),
        "dtype": ([Weight(weights[0].fqn, weights[0].storage, SCALAR_TYPE_CODES["int32"], weights[0].sizes, weights[0].strides), *weights[1:]], "dtype"),
    }
    for name, (given, message) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        pte, ptd = write_program([MethodPlan("forward", library, inputs, outputs, weights=given)], "G3")
        (folder / "model.pte").write_bytes(pte)
        (folder / "aoti_cuda_blob.ptd").write_bytes(ptd)
        with pytest.raises(BundleError, match=message):
            cuda_runner.load(folder / "model.pte")
        # The names are matched on a thread of their own beside the copies: it has ended with the load.
        assert not [thread for thread in threading.enumerate() if thread.name.startswith("cuda-runner-names")]
        assert cli("run", str(folder / "model.pte"), "--random-inputs").returncode == 3


def test_a_storage_smaller_than_the_library_reads_is_refused(compiled, tmp_path):
    """A view that fits its storage, but the library reads more than the storage holds."""
    model = compiled("dict_mlp", "cpu")
    with open_bundle(model.path) as reader:
        library = bytes(reader.read_verified("forward_so_blob"))
    weights = _weights(model.module, _library_constants(model.path))
    first = weights[0]
    half = len(first.storage) // 2
    short = Weight(first.fqn, first.storage[:half], first.dtype_code, (half // 4,), (1,))  # a 1-D view of half the bytes
    inputs = [TensorValue(FLOAT32, (64, 16), BOUND), TensorValue(FLOAT32, (8,))]
    outputs = [TensorValue(FLOAT32, (64, 8), BOUND), TensorValue(FLOAT32, ()), TensorValue(FLOAT32, (64, 32), BOUND)]
    pte, ptd = write_program([MethodPlan("forward", library, inputs, outputs, weights=[short, *weights[1:]])], "G3")
    (tmp_path / "model.pte").write_bytes(pte)
    (tmp_path / "aoti_cuda_blob.ptd").write_bytes(ptd)
    with pytest.raises(BundleError, match="reads"):
        cuda_runner.load(tmp_path / "model.pte")


def test_a_wired_method_runs_by_value(compiled, tmp_path):
    """A method whose library takes its inputs in another order, and whose
    outputs are library outputs out of order, one of them twice, and one of its
    inputs: written as a format 1.3 bundle around a real CPU library."""
    import dataclasses

    import numpy as np

    import cuda_runner
    from cuda_runner.format import write_bundle
    from cuda_runner.format.bundle import open_bundle
    from cuda_runner.format.manifest import WIRING, Manifest, OutputSource, TensorSpec, Wiring

    source = compiled("dict_mlp", "cpu").path
    with open_bundle(source) as reader:
        straight = reader.manifest.methods["forward"]
        segments = {entry.name: bytes(reader.segment(entry.name)) for entry in reader.manifest.segments}
        x, bias = straight.inputs
        library_outputs = straight.outputs
        method_outputs = (
            TensorSpec("second", library_outputs[1].dtype, library_outputs[1].shape),
            TensorSpec("first", library_outputs[0].dtype, library_outputs[0].shape),
            TensorSpec("first_again", library_outputs[0].dtype, library_outputs[0].shape),
            TensorSpec("bias_back", bias.dtype, bias.shape),
        )
        wired = dataclasses.replace(
            straight, inputs=(bias, x), outputs=method_outputs, sample_inputs_segment=None, sample_outputs_segment=None,
            wiring=Wiring((1, 0), library_outputs, (OutputSource(1), OutputSource(0), OutputSource(0), OutputSource(0, from_input=True))),
        )
        manifest = Manifest({"forward": wired}, build=reader.manifest.build, required_features=(WIRING,),
                            optional_features=tuple(name for name in reader.manifest.optional_features if name != "samples"))
    write_bundle(tmp_path / "wired.bundle", manifest, {name: data for name, data in segments.items() if "sample" not in name})
    rng = np.random.default_rng(3)
    arrays = {"x": rng.standard_normal((3, 16), dtype=np.float32), "bias": rng.standard_normal(8, dtype=np.float32)}
    with cuda_runner.load(source) as model:
        expected = model.run(arrays)
    names = [spec.name for spec in straight.outputs]
    with cuda_runner.load(tmp_path / "wired.bundle") as model:
        got = model.run([arrays["bias"], arrays["x"]])  # by position, in the method's order
    np.testing.assert_array_equal(got["second"], expected[names[1]])
    np.testing.assert_array_equal(got["first"], expected[names[0]])
    np.testing.assert_array_equal(got["first_again"], expected[names[0]])
    np.testing.assert_array_equal(got["bias_back"], arrays["bias"])
    assert got["bias_back"] is not arrays["bias"]  # a copy: the caller's array is not handed back
    shown = cli("inspect", str(tmp_path / "wired.bundle"))
    assert "wiring: the library takes (x, bias)" in shown.stdout, shown.stdout


def test_scalar_outputs_of_a_method_are_returned_and_survive_conversion(compiled, tmp_path):
    """A method may return Int, Double and Bool values beside its tensors (ExecuTorch stores them in the plan)."""
    _write(tmp_path, _dict_mlp_plan(compiled, constant_outputs=[7, 0.25, True]), "G2")
    arrays = _inputs()
    expected = _reference(compiled, arrays)
    converted = tmp_path / "converted.bundle"
    assert cli("convert", str(tmp_path / "model.pte"), "-o", str(converted)).returncode == 0
    for path in (tmp_path / "model.pte", converted):
        with cuda_runner.load(path) as loaded:
            got = loaded.run(arrays)
            specs = {spec.name: (spec.dtype, spec.shape) for spec in loaded.method().spec.outputs}
        for index, array in enumerate(expected):
            np.testing.assert_array_equal(got[f"output_{index}"], array)
        assert (got["output_3"].dtype, got["output_3"].shape, got["output_3"].item()) == (np.int64, (), 7)
        assert (got["output_4"].dtype, got["output_4"].item()) == (np.float64, 0.25)
        assert (got["output_5"].dtype, got["output_5"].item()) == (np.bool_, True)
        assert specs["output_3"] == ("int64", ()) and specs["output_5"] == ("bool", ())
    assert "constant-outputs" in cuda_runner.read_manifest(converted).required_features
    written = tmp_path / "out"
    result = cli("run", str(converted), "--random-inputs", "--out-dir", str(written))
    assert result.returncode == 0, result.stderr
    assert np.load(written / "output_3.npy").item() == 7
    shown = cli("inspect", str(tmp_path / "model.pte"))
    assert shown.returncode == 0 and "output_3 = the constant 7" in shown.stdout


def test_a_none_output_is_refused_by_name(compiled, tmp_path):
    _write(tmp_path, _dict_mlp_plan(compiled, constant_outputs=[float("nan")]), "G2")
    result = cli("inspect", str(tmp_path / "model.pte"))
    assert result.returncode == 3 and "returns the constant nan as output 3" in result.stderr
