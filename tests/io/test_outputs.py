from __future__ import annotations

import numpy as np
import pytest

from cuda_runner.format.bundle import WriteError
from cuda_runner.io.outputs import output_filenames, write_output_archive, write_output_dir


def test_names_are_sanitised_and_kept_distinct():
    names = output_filenames(["logits", "aux.loss", "../../etc/passwd", "a/b", "a_b", "A_B", ".hidden", "\x1b[31mred"])
    assert names["logits"] == "logits.npy" and names["aux.loss"] == "aux.loss.npy"
    assert all("/" not in name and not name.startswith(".") for name in names.values())
    assert len({name.lower() for name in names.values()}) == len(names)


def test_output_dir_gets_every_output_or_none(tmp_path, monkeypatch):
    outputs = {"a": np.zeros(3), "b": np.ones(2), "scalar": np.array(2.0)}
    files = write_output_dir(tmp_path / "out", outputs)
    assert {path.name for path in files.values()} == {"a.npy", "b.npy", "scalar.npy"}
    assert np.load(files["scalar"]).shape == ()

    import cuda_runner.io.npy as npy

    calls = {"n": 0}
    real = npy.write_npy

    def failing(handle, array):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real(handle, array)

    monkeypatch.setattr(npy, "write_npy", failing)
    monkeypatch.setattr("cuda_runner.io.outputs.write_npy", failing)
    with pytest.raises(WriteError, match="No space left"):
        write_output_dir(tmp_path / "fresh", outputs)
    assert not (tmp_path / "fresh").exists() or list((tmp_path / "fresh").iterdir()) == []


def test_archive_round_trip(tmp_path):
    path = write_output_archive(tmp_path / "all.npz", {"aux.loss": np.array(1.0, np.float32), "logits": np.zeros((2, 2))})
    with np.load(path) as archive:
        assert sorted(archive.files) == ["aux.loss", "logits"]
        assert archive["aux.loss"].shape == ()
