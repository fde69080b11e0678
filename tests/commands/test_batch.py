"""Many input sets through one loaded model: `run --batch` and `Model.map`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import ROOT, cli, run_cli

import cuda_runner


def _set(seed: int, batch: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 16), dtype=np.float32), "bias": rng.standard_normal(8, dtype=np.float32)}


@pytest.fixture
def sets(tmp_path):
    folder = tmp_path / "sets"
    folder.mkdir()
    for index in range(4):
        np.savez(folder / f"s{index}.npz", **_set(index, batch=1 + index))
    nested = folder / "s4"
    nested.mkdir()
    for name, array in _set(4).items():
        np.save(nested / f"{name}.npy", array)
    np.savez(folder / "z_bad.npz", x=np.ones((2, 15), np.float32), bias=np.zeros(8, np.float32))  # wrong shape
    return folder


def test_every_set_is_run_written_and_reported(dict_mlp_bundle, sets, tmp_path):
    out = tmp_path / "out"
    result = cli("run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(out), "--json")
    assert result.returncode == 2, result.stderr  # the worst failure: one set refused
    document = json.loads(result.stdout)
    statuses = {entry["name"]: entry["status"] for entry in document["sets"]}
    assert statuses == {"s0": "passed", "s1": "passed", "s2": "passed", "s3": "passed", "s4": "passed", "z_bad": "error"}
    assert "axis 1: expected size 16, got 15" in next(entry["error"] for entry in document["sets"] if entry["name"] == "z_bad")
    with cuda_runner.load(dict_mlp_bundle.path) as model:
        expected = model.run(_set(2, batch=3))
    np.testing.assert_array_equal(np.load(out / "s2" / "logits.npy"), expected["logits"])
    assert sorted(p.name for p in out.iterdir()) == ["s0", "s1", "s2", "s3", "s4"]  # nothing for the refused set


def test_resume_skips_complete_sets_and_redoes_the_rest(dict_mlp_bundle, sets, tmp_path):
    out = tmp_path / "out"
    (sets / "z_bad.npz").unlink()
    assert cli("run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(out)).returncode == 0
    (out / "s1" / "logits.npy").unlink()  # as if the job had been killed while writing s1
    again = cli("run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(out), "--resume", "--json")
    statuses = {entry["name"]: entry["status"] for entry in json.loads(again.stdout)["sets"]}
    assert statuses == {"s0": "skipped", "s1": "passed", "s2": "skipped", "s3": "skipped", "s4": "skipped"}
    assert (out / "s1" / "logits.npy").exists()


# A batch run whose process is killed (SIGKILL, no unwinding) right after the
# first output of set DIR is renamed into place: the others are still old.
_KILLED_MID_COMMIT = """
import os, signal, sys
from pathlib import Path
target, replace = Path(sys.argv[1]).resolve(), os.replace
def killed_after(source, destination):
    replace(source, destination)
    if Path(destination).parent.resolve() == target and str(destination).endswith(".npy"):
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = killed_after
from cuda_runner.cli.main import main
sys.argv = ["cuda-runner", *sys.argv[2:]]
main()
"""


def test_resume_redoes_a_set_whose_outputs_a_kill_left_half_replaced(dict_mlp_bundle, sets, tmp_path):
    (sets / "z_bad.npz").unlink()
    out = tmp_path / "out"
    command = ["run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(out)]
    assert cli(*command).returncode == 0
    old = {name: np.load(out / "s1" / name) for name in ("logits.npy", "aux.loss.npy", "aux.hidden.npy")}
    np.savez(sets / "s1.npz", **_set(11, batch=2))  # s1's inputs change; a second run replaces its outputs
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_COMMIT, str(out / "s1"), *command, "--lanes", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    changed = [name for name, array in old.items() if not np.array_equal(np.load(out / "s1" / name), array)]
    assert len(changed) == 1  # the mix a kill between two renames leaves: one output new, the others old

    again = run_cli(*command, "--resume", "--json")
    assert again.returncode == 0, again.stderr
    statuses = {entry["name"]: entry["status"] for entry in json.loads(again.stdout)["sets"]}
    assert statuses["s1"] == "passed"  # run again, not taken as complete
    with cuda_runner.load(dict_mlp_bundle.path) as model:
        for name, status in statuses.items():
            source = sets / f"{name}.npz"
            inputs = dict(np.load(source)) if source.exists() else {path.stem: np.load(path) for path in (sets / name).glob("*.npy")}
            expected = model.run(inputs)
            for output, array in expected.items():
                np.testing.assert_array_equal(np.load(out / name / f"{output}.npy"), array, err_msg=f"{name} {output} ({status})")
    leftovers = [path.name for path in (out / "s1").iterdir() if path.name.endswith((".tmp", ".old"))]
    assert leftovers == []  # the killed writer's temp files and backups went with the rewrite


def test_a_set_record_tells_whole_sets_from_changed_ones(tmp_path):
    """OutputPlan(record=True).complete: the record's files, unchanged or copied
    elsewhere byte for byte; not a set with a file changed, missing or added."""
    import shutil

    from cuda_runner.io.outputs import OutputPlan, write_outputs

    outputs = {"logits": np.arange(6.0), "aux.loss": np.array(2.0)}
    plan = OutputPlan(tmp_path / "a", record=True)
    write_outputs(plan, outputs)
    assert plan.complete(list(outputs))
    assert sorted(os.listdir(tmp_path / "a")) == [".cuda-runner-set.json", "aux.loss.npy", "logits.npy"]
    copied = tmp_path / "copy"
    shutil.copytree(tmp_path / "a", copied)  # new inodes and times: the digests decide
    assert OutputPlan(copied, record=True).complete(list(outputs))
    assert not plan.complete(["logits"]) and not plan.complete([*outputs, "extra"])
    np.save(copied / "logits.npy", np.arange(6.0) + 1)  # same size, other values
    assert not OutputPlan(copied, record=True).complete(list(outputs))
    write_outputs(plan, {"logits": np.arange(6.0)})  # a rewrite with fewer outputs: the record follows
    assert plan.complete(["logits"]) and not plan.complete(list(outputs))
    assert not OutputPlan(tmp_path / "missing", record=True).complete(list(outputs))


def test_expected_dir_compares_every_set(dict_mlp_bundle, sets, tmp_path):
    (sets / "z_bad.npz").unlink()
    reference = tmp_path / "ref"
    assert cli("run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(reference), "--out-format", "npz").returncode == 0
    assert sorted(p.name for p in reference.iterdir() if not p.name.startswith(".")) == ["s0.npz", "s1.npz", "s2.npz", "s3.npz", "s4.npz"]
    assert (reference / ".s0.npz.cuda-runner-set.json").is_file()  # each archive's set record, beside it
    same = cli("run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(tmp_path / "o2"), "--expected-dir", str(reference))
    assert same.returncode == 0, same.stdout + same.stderr
    assert same.stdout.strip().splitlines()[-1] == "VERDICT: PASSED"
    wrong = dict(np.load(reference / "s3.npz"))
    wrong["logits"] = wrong["logits"] + 1
    np.savez(reference / "s3.npz", **wrong)
    differs = cli("run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(tmp_path / "o3"), "--expected-dir", str(reference))
    assert differs.returncode == 1 and "FAILED s3" in differs.stdout


def test_fail_fast_stops_at_the_first_failure(dict_mlp_bundle, tmp_path):
    folder = tmp_path / "sets"
    folder.mkdir()
    np.savez(folder / "a_bad.npz", x=np.ones((2, 15), np.float32), bias=np.zeros(8, np.float32))
    for index in range(12):
        np.savez(folder / f"b{index:02d}.npz", **_set(index))
    result = cli("run", str(dict_mlp_bundle.path), "--batch", str(folder), "--out-dir", str(tmp_path / "out"), "--fail-fast", "--lanes", "1", "--json")
    assert result.returncode == 2
    names = [entry["name"] for entry in json.loads(result.stdout)["sets"]]
    # Sets already started when the bad one failed may finish (at most the
    # pipeline's 2 * lanes + 2 workers); none is started after it.
    assert names[0] == "a_bad" and len(names) <= 4
    written = sorted(path.name for path in (tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    assert written == sorted(names[1:])


def test_batch_options_are_checked(dict_mlp_bundle, sets, tmp_path):
    assert cli("run", str(dict_mlp_bundle.path), "--batch", str(sets)).returncode == 2  # no --out-dir
    mixed = cli("run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(tmp_path), "--random-inputs")
    assert mixed.returncode == 2 and "cannot be used together" in mixed.stderr
    assert cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--resume").returncode == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = cli("run", str(dict_mlp_bundle.path), "--batch", str(empty), "--out-dir", str(tmp_path / "o"))
    assert nothing.returncode == 2 and "holds no input sets" in nothing.stderr


@pytest.mark.parametrize("lanes", [1, 2])
def test_map_yields_outputs_in_order(compiled, device, lanes):
    cases = [_set(index, batch=1 + index % 5) for index in range(20)]
    with cuda_runner.load(compiled("dict_mlp", device).path, lanes=lanes) as model:
        expected = [model.run(case) for case in cases]
        mapped = list(model.map(iter(cases)))
    assert len(mapped) == len(cases)
    for got, want in zip(mapped, expected):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


def test_a_pool_spreads_calls_and_keeps_order(compiled, tmp_path, device, monkeypatch):
    """A pool of two members (two loads on this device): while the first member's
    first call is held, the pool gives the next call to the other member, the
    one with fewer calls in flight; each member's public `run` counts the calls
    it serves, and the outputs still come back in input order. Then load_pool
    and `run --devices` (one member on CPU; every GPU on a GPU machine)."""
    from cuda_runner.runtime.model import ModelPool

    bundle = compiled("dict_mlp", device).path
    cases = [_set(index) for index in range(12)]
    with cuda_runner.load(bundle) as model:
        expected = [model.run(case) for case in cases]
    served: list[int] = []
    other_served = threading.Event()
    with ModelPool([cuda_runner.load(bundle, device, lanes=2), cuda_runner.load(bundle, device, lanes=2)]) as pool:
        for index, member in enumerate(pool.models):
            def counted(inputs, method=None, *, index=index, run=member.run):
                served.append(index)
                if index == 0 and not other_served.is_set():
                    other_served.wait(30)  # only a guard against a pool that never spreads; no time is asserted
                else:
                    other_served.set()
                return run(inputs, method)

            monkeypatch.setattr(member, "run", counted)
        outputs = list(pool.map(cases))
    assert len(outputs) == len(cases) == len(served)
    assert sorted(set(served)) == [0, 1], served  # both members served calls
    for got, want in zip(outputs, expected):
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-6, atol=1e-6)

    devices = ["cpu"] if device == "cpu" else "all"
    with cuda_runner.load_pool(bundle, devices, lanes=2) as pool:
        assert len(pool.devices) >= 1 and all(member.type == device for member in pool.devices)
        for got, want in zip(pool.map(cases), expected):
            np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-6, atol=1e-6)
    folder = tmp_path / "sets"
    folder.mkdir()
    for index, case in enumerate(cases):
        np.savez(folder / f"s{index:02d}.npz", **case)
    spread = "cpu" if device == "cpu" else "all"
    result = cli("run", str(bundle), "--batch", str(folder), "--out-dir", str(tmp_path / "out"), "--devices", spread, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["counts"]["passed"] == 12
    for index, want in enumerate(expected):
        np.testing.assert_allclose(np.load(tmp_path / "out" / f"s{index:02d}" / "logits.npy"), want["logits"], rtol=1e-6, atol=1e-6)


def test_resume_never_turns_a_failed_comparison_into_a_pass(dict_mlp_bundle, sets, tmp_path):
    (sets / "z_bad.npz").unlink()
    reference = tmp_path / "ref"
    cli("run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(reference))
    wrong = np.load(reference / "s1" / "logits.npy") + 1
    np.save(reference / "s1" / "logits.npy", wrong)
    out = tmp_path / "out"
    first = cli("run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(out), "--expected-dir", str(reference))
    assert first.returncode == 1
    again = cli("run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(out), "--expected-dir", str(reference), "--resume", "--json")
    assert again.returncode == 1, again.stdout
    statuses = {entry["name"]: entry["status"] for entry in json.loads(again.stdout)["sets"]}
    assert statuses["s1"] == "failed" and statuses["s0"] == "skipped"


def test_batch_size_stacks_sets_and_splits_outputs_back(compiled, tmp_path):
    """The linear fixture ([batch, 16] -> [batch, 4], batch up to 64): 12 sets of
    1 to 12 rows, stacked up to 5 at a time, give each set its own rows."""
    bundle = compiled("linear", "cpu").path
    folder = tmp_path / "sets"
    folder.mkdir()
    rng = np.random.default_rng(0)
    arrays = {f"s{index:02d}": rng.standard_normal((1 + index, 16), dtype=np.float32) for index in range(12)}
    for name, array in arrays.items():
        np.savez(folder / f"{name}.npz", input=array)
    result = cli("run", str(bundle), "--batch", str(folder), "--out-dir", str(tmp_path / "out"), "--batch-size", "5", "--lanes", "1", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["batch_size"] == 5
    with cuda_runner.load(bundle) as model:
        for name, array in arrays.items():
            np.testing.assert_allclose(np.load(tmp_path / "out" / name / "output_0.npy"), model.run([array])["output_0"], rtol=1e-6, atol=1e-6)


def test_stacking_groups_and_bounds(compiled):
    from cuda_runner.commands.stacking import Stacker
    from cuda_runner.runtime.model import load_model

    calls = []
    with load_model(compiled("linear", "cpu").path) as model:
        method = model.method()

        def counted(arrays):
            calls.append(arrays["input"].shape[0])
            return method.run(arrays)

        stacker = Stacker(method.spec, counted, size=8, lanes=1)
        try:
            from concurrent.futures import ThreadPoolExecutor

            rows = [30, 30, 30, 2, 2]  # 64 rows at most per call: 30+30, then 30+2+2
            with ThreadPoolExecutor(5) as pool:
                outputs = list(pool.map(lambda n: stacker.run({"input": np.full((n, 16), float(n), np.float32)}), rows))
        finally:
            stacker.close()
    assert [out["output_0"].shape[0] for out in outputs] == rows
    assert all(n <= 64 for n in calls) and sum(calls) == sum(rows)


def test_batch_size_is_refused_where_outputs_do_not_lead_with_the_batch(dict_mlp_bundle, sets, tmp_path):
    result = cli("run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(tmp_path / "out"), "--batch-size", "4")
    assert result.returncode == 2
    assert "output 'aux.loss' does not start with a dynamic dim" in result.error_lines[0]
    assert "--batch-size" in result.error_lines[0]
    assert not (tmp_path / "out").exists()


def test_the_stacker_refuses_invalid_sets_and_calls_after_close(compiled):
    from cuda_runner.commands.stacking import Stacker
    from cuda_runner.errors import ClosedError, InputError
    from cuda_runner.runtime.model import load_model

    with load_model(compiled("linear", "cpu").path) as model:
        method = model.method()
        stacker = Stacker(method.spec, method.run, size=4, lanes=1)
        with pytest.raises(InputError):
            stacker.run({"input": np.zeros((3, 15), np.float32)})  # alone it is refused; stacked it must be too
        assert stacker.run({"input": np.ones((2, 16), np.float32)})["output_0"].shape == (2, 4)
        stacker.close()
        with pytest.raises(ClosedError):
            stacker.run({"input": np.ones((2, 16), np.float32)})


def test_a_batch_over_several_devices_starts_no_context_on_the_default_one(dict_mlp_bundle, sets, tmp_path, monkeypatch):
    """run_batch with `devices` loads one model per listed device: opening the
    bundle must not start the bundle's default device's context (GPU 0 for a
    CUDA bundle, which `--devices 1,2` leaves out), as one run does."""
    import cuda_runner.commands.running as running
    from cuda_runner.commands.batch import BatchRequest, run_batch

    prepared = []
    monkeypatch.setattr(running, "prepare_device", lambda specs, device: prepared.append(device))
    from cuda_runner.errors import CudaRunnerError

    with pytest.raises(CudaRunnerError):  # no GPU is needed: what matters happens before any load
        run_batch(BatchRequest(dict_mlp_bundle.path, sets, out_dir=tmp_path / "out", devices="1,2"))
    assert prepared == []
    run_batch(BatchRequest(dict_mlp_bundle.path, sets, out_dir=tmp_path / "one"))
    assert prepared == [None]


def _with_other_weights(bundle, destination):
    """The same bundle (library, signature) with every float32 weight doubled:
    another model, whose outputs a record of the first must not stand for."""
    from cuda_runner.format.bundle import open_bundle, write_bundle

    with open_bundle(bundle) as reader:
        segments = {entry.name: bytes(reader.segment(entry.name)) for entry in reader.manifest.segments}
        weights = reader.manifest.methods["forward"].weights_segment
        segments[weights] = (np.frombuffer(segments[weights], np.float32) * 2).tobytes()
        write_bundle(destination, reader.manifest, segments)
    return destination


@pytest.mark.parametrize("out_format", ["npy", "npz"])
def test_resume_reruns_sets_another_model_wrote(dict_mlp_bundle, sets, tmp_path, out_format):
    """A set record names the model that wrote it (its digest), the method and
    the inputs: resuming into OUT from another bundle of the same signature runs every set."""
    (sets / "z_bad.npz").unlink()
    out = tmp_path / "out"
    other = _with_other_weights(dict_mlp_bundle.path, tmp_path / "other.bundle")
    command = ["--batch", str(sets), "--out-dir", str(out), "--out-format", out_format]
    assert cli("run", str(dict_mlp_bundle.path), *command).returncode == 0
    again = cli("run", str(other), *command, "--resume", "--json")
    assert again.returncode == 0, again.stderr
    assert {entry["status"] for entry in json.loads(again.stdout)["sets"]} == {"passed"}  # none skipped
    with cuda_runner.load(other) as model:
        expected = model.run(_set(2, batch=3))["logits"]
    written = np.load(out / "s2.npz")["logits"] if out_format == "npz" else np.load(out / "s2" / "logits.npy")
    np.testing.assert_array_equal(written, expected)
    third = cli("run", str(other), *command, "--resume", "--json")  # and now they are the other model's: skipped
    assert {entry["status"] for entry in json.loads(third.stdout)["sets"]} == {"skipped"}


def test_resume_reruns_a_set_copied_from_another_or_whose_inputs_changed(dict_mlp_bundle, sets, tmp_path):
    import shutil

    (sets / "z_bad.npz").unlink()
    out = tmp_path / "out"
    command = ["run", str(dict_mlp_bundle.path), "--batch", str(sets), "--out-dir", str(out)]
    assert cli(*command).returncode == 0
    shutil.rmtree(out / "s1")
    shutil.copytree(out / "s0", out / "s1")  # s0's outputs, byte for byte, record included
    np.savez(sets / "s3.npz", **_set(33, batch=4))  # s3's inputs change after it was written
    again = cli(*command, "--resume", "--json")
    statuses = {entry["name"]: entry["status"] for entry in json.loads(again.stdout)["sets"]}
    assert statuses == {"s0": "skipped", "s1": "passed", "s2": "skipped", "s3": "passed", "s4": "skipped"}
    with cuda_runner.load(dict_mlp_bundle.path) as model:
        for name, inputs in (("s1", _set(1, batch=2)), ("s3", _set(33, batch=4))):
            np.testing.assert_array_equal(np.load(out / name / "logits.npy"), model.run(inputs)["logits"])
    record = json.loads((out / "s3" / ".cuda-runner-set.json").read_text())
    assert record["provenance"]["method"] == "forward" and set(record["provenance"]["inputs"]) == {"s3.npz"}
    assert record["provenance"]["model"].startswith("bundle:xxh3-128")
