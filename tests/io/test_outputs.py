"""Outputs are written all-or-none: a folder holds exactly the old set or exactly the new one."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from cuda_runner.errors import InputError, WriteError
from cuda_runner.files import write_files
from cuda_runner.io.npy import npy_writer
from cuda_runner.io.outputs import OutputPlan, output_filenames, write_outputs

OUTPUTS = {"logits": np.zeros(3), "aux.loss": np.array(2.0), "aux.hidden": np.ones(2)}


def _fail_rename(monkeypatch, which: int) -> None:
    """Make the `which`-th rename of a temp file into place fail, as a full disk would."""
    real_replace, calls = os.replace, {"n": 0}

    def failing(source, target):
        if str(source).endswith(".tmp"):
            calls["n"] += 1
            if calls["n"] == which:
                raise OSError(28, "No space left on device", str(target))
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", failing)


def test_names_are_sanitised_and_kept_distinct():
    names = output_filenames(["logits", "aux.loss", "../../etc/passwd", "a/b", "a_b", "A_B", ".hidden", "\x1b[31mred"])
    assert names["logits"] == "logits.npy" and names["aux.loss"] == "aux.loss.npy"
    assert all("/" not in name and not name.startswith(".") for name in names.values())
    assert len({name.lower() for name in names.values()}) == len(names)


def test_folder_and_archive_are_one_transaction(tmp_path):
    files = write_outputs(OutputPlan(tmp_path / "out", tmp_path / "all.npz"), OUTPUTS)
    assert files["logits"] == [tmp_path / "out" / "logits.npy", tmp_path / "all.npz"]
    assert sorted(os.listdir(tmp_path / "out")) == ["aux.hidden.npy", "aux.loss.npy", "logits.npy"]
    with np.load(tmp_path / "all.npz") as archive:
        assert sorted(archive.files) == ["aux.hidden", "aux.loss", "logits"]


def test_an_archive_path_that_is_a_folder_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "isdir.npz").mkdir()
    plan = OutputPlan(tmp_path / "d", tmp_path / "isdir.npz")
    with pytest.raises(InputError, match="is a directory"):
        plan.check()
    with pytest.raises(InputError):
        write_outputs(plan, OUTPUTS)
    assert not (tmp_path / "d").exists()


def test_a_failed_rename_rolls_back_the_files_already_renamed(tmp_path):
    out = tmp_path / "out"
    write_outputs(OutputPlan(out), {name: array + 1 for name, array in OUTPUTS.items()})
    old = {name: np.load(out / name) for name in os.listdir(out)}
    os.remove(out / "aux.hidden.npy")
    (out / "aux.hidden.npy").mkdir()  # the third rename fails after two succeed
    (out / "aux.hidden.npy" / "keep").write_text("x")
    with pytest.raises((WriteError, InputError)):
        write_files({out / "logits.npy": npy_writer(OUTPUTS["logits"]), out / "aux.loss.npy": npy_writer(OUTPUTS["aux.loss"]),
                     out / "aux.hidden.npy": npy_writer(OUTPUTS["aux.hidden"])})
    np.testing.assert_array_equal(np.load(out / "logits.npy"), old["logits.npy"])
    np.testing.assert_array_equal(np.load(out / "aux.loss.npy"), old["aux.loss.npy"])
    assert sorted(os.listdir(out)) == ["aux.hidden.npy", "aux.loss.npy", "logits.npy"]  # no temp files left


def test_rename_failure_midway_restores_old_contents(tmp_path, monkeypatch):
    out = tmp_path / "out"
    write_outputs(OutputPlan(out), {name: array + 1 for name, array in OUTPUTS.items()})
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    _fail_rename(monkeypatch, 3)
    with pytest.raises(WriteError, match="No space left"):
        write_outputs(OutputPlan(out), OUTPUTS)
    monkeypatch.undo()
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def test_a_failed_write_leaves_no_new_folder_and_no_temp_files(tmp_path, monkeypatch):
    import cuda_runner.io.npy as npy

    calls = {"n": 0}
    real = npy.write_npy

    def failing(handle, array):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real(handle, array)

    monkeypatch.setattr(npy, "write_npy", failing)
    with pytest.raises(WriteError, match="No space left"):
        write_outputs(OutputPlan(tmp_path / "fresh" / "deeper"), OUTPUTS)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_writers_into_one_folder_never_leave_a_mix(tmp_path):
    out = tmp_path / "out"
    errors: list[BaseException] = []

    def writer(value: float) -> None:
        try:
            for _ in range(20):
                write_outputs(OutputPlan(out), {name: np.full(64, value) for name in ("a", "b", "c", "d")})
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(float(value),)) for value in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    values = {float(np.load(out / f"{name}.npy")[0]) for name in ("a", "b", "c", "d")}
    assert len(values) == 1  # every file from the same writer


def test_temp_files_of_dead_writers_are_removed_by_the_next_write(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    from cuda_runner.files import _HOST

    stale = out / f".logits.npy.{_HOST}.{dead}.0123abcd.tmp"
    stale.write_bytes(b"x" * 1000)
    # What earlier builds tagged this host with: their dead writers' temps go too.
    legacy_tag = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    legacy = out / f".logits.npy.{legacy_tag}.{dead}.0123abcd.old"
    legacy.write_bytes(b"w")
    mine = out / f".other.npy.{_HOST}.{os.getpid()}.0123abcd.tmp"  # a live writer's: kept
    elsewhere = out / f".other.npy.ffffffff.{dead}.0123abcd.tmp"  # another host's (a network folder): kept
    elsewhere.write_bytes(b"z")
    mine.write_bytes(b"y")
    write_outputs(OutputPlan(out), {"logits": np.zeros(1)})
    assert not stale.exists() and not legacy.exists() and mine.exists() and elsewhere.exists()


def test_a_path_component_longer_than_the_file_system_allows_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="longer than this file system allows"):
        OutputPlan(tmp_path / ("n" * 300)).check()


def test_bfloat16_outputs_can_be_written_as_float32(tmp_path):
    import ml_dtypes

    write_outputs(OutputPlan(tmp_path, bf16_as="float32"), {"h": np.array([1.5], ml_dtypes.bfloat16)})
    assert np.load(tmp_path / "h.npy").dtype == np.float32  # readable without ml_dtypes


def test_odd_temp_names_are_left_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    odd = out / ".x.00000000.99999999999999999999.deadbeef.tmp"  # a pid no process can have
    odd.write_bytes(b"x")
    write_outputs(OutputPlan(out), {"logits": np.zeros(1)})
    assert odd.exists()


def test_rollback_keeps_a_dangling_symlink_that_was_there(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(tmp_path / "nowhere", out / "logits.npy")
    _fail_rename(monkeypatch, 2)
    with pytest.raises(WriteError):
        write_outputs(OutputPlan(out), {"logits": np.zeros(1), "other": np.ones(1)})
    monkeypatch.undo()
    assert os.path.islink(out / "logits.npy") and not (out / "other.npy").exists()


def test_a_failed_rewrite_puts_the_old_set_record_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    plan = OutputPlan(out, record=True)
    write_outputs(plan, OUTPUTS)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    _fail_rename(monkeypatch, 2)
    with pytest.raises(WriteError):
        write_outputs(plan, {name: array + 1 for name, array in OUTPUTS.items()})
    monkeypatch.undo()
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before  # the record too
    assert plan.complete(list(OUTPUTS))
