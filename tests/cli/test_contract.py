"""The command-line contract, as a table: every error has its exit code and exactly one clean line.

Each row is (arguments, exit code, a fragment of the error line). Placeholders:
{bundle} a valid CPU bundle, {tmp} a folder with the files made by `workdir`.
Every row also asserts: one stderr line, starting "error: ", and no
traceback, warning or "internal error" anywhere.
"""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
from forge import forge, method
from helpers import cli

from cuda_runner.format.manifest import MAX_NAME_LENGTH


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("contract")
    np.save(folder / "x.npy", np.ones((2, 16), np.float32))
    np.save(folder / "bias.npy", np.zeros(8, np.float32))
    np.save(folder / "x64.npy", np.ones((2, 16)))
    raw = (folder / "x.npy").read_bytes().replace(b"(2, 16)", b"(-2, 16)")
    (folder / "negative.npy").write_bytes(raw)
    with zipfile.ZipFile(folder / "odd.npz", "w") as archive:
        archive.writestr("x.txt", "not an array")
    np.savez(folder / "samples.npz", x=np.ones((2, 16), np.float32), bias=np.zeros(8, np.float32))
    (folder / "img.npy").write_bytes(b"")
    (folder / "isdir.npz").mkdir()
    manifest_cases = {
        "huge_int": b'{"methods":{"m":{"device":{"type":"cpu"}}}, "x": ' + b"9" * 5000 + b"}",
        "inf_float": b'{"methods":{"m":{"device":{"type":"cpu"}}}, "x": 1e400}',
        "surrogate": b'{"methods":{"m":{"device":{"type":"cpu"}}}, "metadata": {"k": "\\ud800"}}',
    }
    for name, text in manifest_cases.items():
        (folder / f"{name}.bundle").write_bytes(forge(text))
    bad_expression = method(inputs=[{"name": "x", "dtype": "float32", "shape": ["-5"]}])
    (folder / "negative_shape.bundle").write_bytes(forge({"methods": {"m": bad_expression}}))
    return folder


OK_FLOOR = ["--random-inputs"]

ROWS = [
    # usage errors from option parsing: exit 2
    (["compile", "-o", "{tmp}/m.bundle"], 2, "give a PROGRAM.pt2"),
    (["compile", "{tmp}/p.pt2", "--meta", "novalue"], 2, "expected KEY=VALUE"),
    (["compile", "{tmp}/p.pt2", "--sample-inputs", "x=img.npy"], 2, "no method 'x'"),
    (["compile", "{tmp}/p.pt2", "--sample-inputs", "x.npy"], 2, ".npz archive"),
    (["compile", "{tmp}/p.pt2", "--device", "tpu"], 2, "unknown device 'tpu'"),
    (["compile", "{tmp}/p.pt2", "--device", "cuda:abc"], 2, "unknown device"),
    (["run", "{bundle}", "--random-inputs", "--method", "nope"], 2, "no method 'nope'"),
    (["bench", "{bundle}", "--iterations", "0"], 2, "--iterations"),
    (["bench", "{bundle}", "--warmup", "-1"], 2, "--warmup"),
    (["bench", "{bundle}", "--duration", "0"], 2, "--duration"),
    (["bench", "{bundle}", "--duration", "-1"], 2, "--duration"),
    (["bench", "{bundle}", "--duration", "inf"], 2, "--duration"),
    (["run", "{bundle}", "--random-inputs", "--seed", "-1"], 2, "--seed"),
    (["run", "{bundle}", "--random-inputs", "--shape", "x=-1x16"], 2, "--shape"),
    (["run", "{bundle}", "--random-inputs", "--range", "x=-inf:inf"], 2, "--range"),
    (["run", "{bundle}", "--random-inputs", "--range", "x=0:inf"], 2, "--range"),
    (["run", "{bundle}", "--random-inputs", "--inputs", "{tmp}/x.npy"], 2, "cannot be used together"),
    (["run", "{bundle}", "--self-test", "--inputs", "{tmp}/x.npy"], 2, "cannot be used together"),
    (["run", "{bundle}", "--shape", "x=2x16"], 2, "apply to --random-inputs"),
    (["run", "{bundle}", "--bogus"], 2, "No such option"),
    # inputs: exit 2
    (["run", "{bundle}", "-i", "x=4x16xf32=abc", "-i", "{tmp}/bias.npy"], 2, "'abc' is not a float32 value"),
    (["run", "{bundle}", "-i", "x=1x16xf32=1 2 3 zz", "-i", "{tmp}/bias.npy"], 2, "'zz' is not a float32 value"),
    (["run", "{bundle}", "-i", "x=99999999999999999999x16xf32=0", "-i", "{tmp}/bias.npy"], 2, "too large"),
    (["run", "{bundle}", "-i", "x=4294967296x4294967296xf32=0", "-i", "{tmp}/bias.npy"], 2, "too large"),
    (["run", "{bundle}", "-i", "x=[[1,2],[3]]", "-i", "{tmp}/bias.npy"], 2, "rectangular"),
    (["run", "{bundle}", "-i", "x=" + "[" * 20000 + "]" * 20000, "-i", "{tmp}/bias.npy"], 2, "nested too deeply"),
    (["run", "{bundle}", "-i", "x={tmp}/negative.npy", "-i", "{tmp}/bias.npy"], 2, "shape"),
    (["run", "{bundle}", "-i", "{tmp}/odd.npz"], 2, "not an .npy file"),
    (["run", "{bundle}", "-i", "{tmp}/x64.npy", "-i", "{tmp}/bias.npy"], 2, "expected dtype float32, got float64 (--cast allows"),
    (["run", "{bundle}", "-i", "{tmp}/x.npy"], 2, "missing 'bias'"),
    (["run", "{bundle}", "-i", "{tmp}/missing.npy", "-i", "{tmp}/bias.npy"], 2, "does not exist"),
    (["run", "{bundle}", "--random-inputs", "--shape", "x=20000000x16"], 2, "outside the compiled range"),
    (["run", "{bundle}", "--random-inputs", "--atol", "nosuch=1"], 2, "not an output"),
    (["run", "{bundle}", "--random-inputs", "--device", "tpu"], 2, "unknown device"),
    (["run", "{bundle}", "--random-inputs", "--out-dir", "{tmp}/" + "n" * 300], 2, "longer than this file system allows"),
    (["run", "{bundle}", "--random-inputs", "--out-dir", "{tmp}/d", "--out", "{tmp}/isdir.npz"], 2, "is a directory"),
    (["run", "{bundle}", "--random-inputs", "--out", "{tmp}/all.zip"], 2, "must end in .npz"),
    (["inspect", "{tmp}/nothing.bundle"], 2, "does not exist"),
    # bad bundles: exit 3
    (["inspect", "{tmp}/huge_int.bundle"], 3, "out of range"),
    (["inspect", "{tmp}/inf_float.bundle"], 3, "out of range"),
    (["inspect", "{tmp}/surrogate.bundle"], 3, "lone surrogate"),
    (["inspect", "{tmp}/negative_shape.bundle"], 3, "not a valid dimension expression"),
    (["inspect", "{tmp}"], 3, "not a regular file"),
    # runtime: exit 4
    (["run", "{bundle}", "--random-inputs", "--device", "cuda"], 4, "no CUDA device"),
]


@pytest.mark.parametrize(("args", "code", "fragment"), ROWS, ids=[" ".join(row[0])[:60] for row in ROWS])
def test_contract(dict_mlp_bundle, workdir, args, code, fragment):
    argv = [arg.format(bundle=dict_mlp_bundle.path, tmp=workdir) for arg in args]
    result = cli(*argv)
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0], lines[0]
    for forbidden in ("Traceback", "Warning", "internal error", "unexpected"):
        assert forbidden not in result.stderr + result.stdout


def test_a_stored_sample_that_is_not_an_array_is_a_bad_bundle(dict_mlp_bundle, tmp_path):
    from dataclasses import replace

    from cuda_runner.format import open_bundle, write_bundle

    with open_bundle(dict_mlp_bundle.path) as reader:
        manifest = reader.manifest
        segments = {entry.name: bytes(reader.segment(entry.name)) for entry in manifest.segments}
    with zipfile.ZipFile(tmp_path / "bad.npz", "w") as archive:
        archive.writestr("x.npy", b"\x93NUMPY not really")
    segments["forward_sample_inputs"] = (tmp_path / "bad.npz").read_bytes()
    write_bundle(tmp_path / "samples.bundle", replace(manifest), segments)
    result = cli("run", str(tmp_path / "samples.bundle"), "--self-test")
    assert result.returncode == 3 and len(result.error_lines) == 1, result.stderr


def test_a_method_name_the_name_check_accepts_never_fails_later(tmp_path):
    import torch

    import cuda_runner
    from cuda_runner.errors import InputError

    with pytest.raises(InputError, match="longer than"):
        cuda_runner.compile_module(torch.nn.Linear(2, 2), (torch.randn(1, 2),), tmp_path / "m.bundle", method="m" * (MAX_NAME_LENGTH - 4))


def test_internal_errors_say_so_and_ask_for_a_report(monkeypatch):
    import cuda_runner.runtime.devices as devices

    def broken():
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(devices, "describe_devices", broken)
    result = cli("devices")
    assert result.returncode == 4
    assert result.stderr.startswith("error: internal error: ZeroDivisionError: bug; please report it with the output of -v")


def test_long_lines_are_never_wrapped(dict_mlp_bundle, tmp_path):
    deep = tmp_path / ("d" * 150) / ("e" * 150)
    result = cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--out-dir", str(deep), "-i", "x")
    assert len(result.stderr.strip().splitlines()) == 1
    ok = cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--out-dir", str(deep))
    assert ok.returncode == 0, ok.stderr
    assert any(str(deep) in line for line in ok.stdout.splitlines())  # the whole path on one line


def test_tables_have_no_trailing_spaces(dict_mlp_bundle, tmp_path):
    for args in (["inspect", str(dict_mlp_bundle.path)], ["run", str(dict_mlp_bundle.path), "--random-inputs", "--print"],
                 ["bench", str(dict_mlp_bundle.path), "--iterations", "3", "--warmup", "0"], ["devices"]):
        result = cli(*args)
        assert result.returncode == 0, result.stderr
        assert all(line == line.rstrip() for line in result.stdout.splitlines()), args


def test_out_dir_and_out_together_are_both_listed(dict_mlp_bundle, tmp_path):
    result = cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--out-dir", str(tmp_path / "o"), "--out", str(tmp_path / "all.npz"))
    assert result.returncode == 0, result.stderr
    logits = next(line for line in result.stdout.splitlines() if line.strip().startswith("logits"))
    assert str(tmp_path / "o" / "logits.npy") in logits and str(tmp_path / "all.npz") in logits


def test_print_shows_values(dict_mlp_bundle):
    result = cli("run", str(dict_mlp_bundle.path), "-i", "x=2x16xf32=0", "-i", "bias=[1,2,3,4,5,6,7,8]", "--print")
    assert result.returncode == 0, result.stderr
    assert "logits =" in result.stdout and "[[" in result.stdout


def test_missing_reference_fails_unless_allowed(dict_mlp_bundle, tmp_path):
    cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--out", str(tmp_path / "ref.npz"))
    partial = dict(np.load(tmp_path / "ref.npz"))
    del partial["aux.hidden"]
    np.savez(tmp_path / "partial.npz", **partial)
    failed = cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--expected", str(tmp_path / "partial.npz"))
    assert failed.returncode == 1 and "FAILED aux.hidden" in failed.stdout
    allowed = cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--expected", str(tmp_path / "partial.npz"), "--allow-missing")
    assert allowed.returncode == 0 and "SKIPPED aux.hidden" in allowed.stdout


def test_inspect_verify_with_a_damaged_digest_is_not_runnable(dict_mlp_bundle, tmp_path):
    from cuda_runner.format import open_bundle

    with open_bundle(dict_mlp_bundle.path) as reader:
        entry = reader.manifest.segment("forward_weights_blob")
    data = bytearray(dict_mlp_bundle.path.read_bytes())
    data[entry.offset + 3] ^= 1
    (tmp_path / "d.bundle").write_bytes(bytes(data))
    result = cli("inspect", str(tmp_path / "d.bundle"), "--verify")
    assert result.returncode == 3
    assert "runnable here: no" in result.stdout and "runnable here: yes" not in result.stdout


def test_bench_gates_exit_5_with_the_figure_and_the_limit(dict_mlp_bundle):
    result = cli("bench", str(dict_mlp_bundle.path), "--iterations", "5", "--warmup", "0", "--max-p50-ms", "0.000001")
    assert result.returncode == 5
    assert "max_p50_ms" in result.stderr and "<= 1e-06" in result.stderr
    assert result.stdout.strip().splitlines()[-1] == "VERDICT: FAILED"
    passed = cli("bench", str(dict_mlp_bundle.path), "--iterations", "5", "--warmup", "0", "--max-p50-ms", "10000", "--json")
    document = json.loads(passed.stdout)
    assert passed.returncode == 0 and document["verdict"] == "PASSED"
    assert document["throughput_per_s"] == pytest.approx(document["steady_s"]["count"] / document["timed_wall_s"])


@pytest.mark.heavy
def test_the_console_script_exits_at_once_with_its_outputs_written(dict_mlp_bundle, tmp_path):
    """main() leaves through os._exit after flushing (the interpreter's and
    libtorch's teardown cost 0.3 s of a cold run): outputs, stdout and the
    exit code must be whole."""
    from helpers import run_cli

    result = run_cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--out-dir", str(tmp_path / "out"), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verdict"] == "PASSED"
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["aux.hidden.npy", "aux.loss.npy", "logits.npy"]
    failed = run_cli("run", str(dict_mlp_bundle.path), "--random-inputs", "--shape", "x=100x16")
    assert failed.returncode == 2 and failed.stderr.startswith("error:")
