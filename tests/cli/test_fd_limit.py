"""A process out of file descriptors is told so, not that a good file is damaged, nor that cuda-runner has a bug."""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import cli

from cuda_runner.cli.main import MIN_OPEN_FILES
from cuda_runner.errors import TOO_MANY_FILES, DeviceError

LIMIT_LINE = f"error: this process may open only 6 files, fewer than the {MIN_OPEN_FILES} cuda-runner needs (raise the limit: ulimit -n {MIN_OPEN_FILES})"


def _under(limit: str, *args: str) -> subprocess.CompletedProcess:
    command = f"ulimit {limit}; exec {sys.executable} -m cuda_runner " + " ".join(args)
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)


@pytest.fixture
def inputs(tmp_path):
    np.savez(tmp_path / "in.npz", x=np.ones((4, 16), np.float32), bias=np.zeros(8, np.float32))
    sets = tmp_path / "sets"
    sets.mkdir()
    for index in range(3):
        np.savez(sets / f"s{index}.npz", x=np.ones((2, 16), np.float32), bias=np.zeros(8, np.float32))
    return tmp_path


@pytest.mark.parametrize("command", ["run", "batch", "inspect --verify"])
def test_a_hard_limit_of_6_is_one_runtime_error_line_naming_ulimit(dict_mlp_bundle, inputs, command):
    """`ulimit -n 6` (bash sets the soft and the hard limit) was an internal error: OSError [Errno 24]."""
    args = {"run": f"run {dict_mlp_bundle.path} --inputs {inputs / 'in.npz'}",
            "batch": f"run {dict_mlp_bundle.path} --batch {inputs / 'sets'} --out-dir {inputs / 'out'}",
            "inspect --verify": f"inspect {dict_mlp_bundle.path} --verify"}[command]
    result = _under("-n 6", args)
    assert result.returncode == 4, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [LIMIT_LINE]
    assert "Traceback" not in result.stderr
    if command != "inspect --verify":
        assert result.stdout.strip().splitlines()[-1] == "VERDICT: ERROR"
    assert not (inputs / "out").exists()  # nothing half-written


def test_a_low_soft_limit_is_raised_to_what_the_hard_limit_allows(dict_mlp_bundle, inputs):
    result = _under("-Sn 8", f"run {dict_mlp_bundle.path} --inputs {inputs / 'in.npz'} --json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verdict"] == "PASSED"


def test_running_out_later_names_the_limit_wherever_it_happens(dict_mlp_bundle, inputs, monkeypatch):
    """Past the start-up check (more lanes than the limit allows): reading an
    input and writing a set's outputs each say what to raise."""
    import os

    real_open = os.open

    def exhausted(path, flags, *args, **kwargs):
        if str(path).endswith(("in.npz", ".tmp")):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", exhausted)
    result = cli("run", str(dict_mlp_bundle.path), "--inputs", str(inputs / "in.npz"))
    assert result.returncode == 4
    assert result.error_lines == [f"error: cannot read {inputs / 'in.npz'}: {TOO_MANY_FILES}"]
    batch = cli("run", str(dict_mlp_bundle.path), "--batch", str(inputs / "sets"), "--out-dir", str(inputs / "out"), "--json")
    assert batch.returncode == 4
    assert [(entry["exit_code"], entry["error"]) for entry in json.loads(batch.stdout)["sets"]] == [
        (4, f"cannot write {inputs / 'out' / name / 'logits.npy'}: {TOO_MANY_FILES}") for name in ("s0", "s1", "s2")]


def test_the_kind_is_a_device_error_whichever_error_carried_it():
    from cuda_runner.errors import os_error, too_many_open_files

    assert isinstance(os_error(OSError(errno.ENFILE, "Too many open files in system"), "cannot read x", DeviceError), DeviceError)
    try:
        try:
            raise OSError(errno.EMFILE, "Too many open files")
        except OSError:
            raise LookupError("unknown encoding: cp437") from None
    except LookupError as wrapped:
        assert too_many_open_files(wrapped)  # `from None` hides the cause from tracebacks, not from the walk
    assert not too_many_open_files(OSError(errno.ENOENT, "No such file or directory"))
