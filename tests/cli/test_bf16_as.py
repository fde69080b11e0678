"""`run --bf16-as float32` writes float32, and every report says so: the JSON
document and the text table give the dtype that is in the files, beside the
one the model returned."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
from helpers import cli


def _run(bundle, *args: str) -> dict:
    result = cli("run", str(bundle.path), "--random-inputs", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_json_reports_the_dtype_written_with_bf16_as(bf16_bundle, tmp_path):
    document = _run(bf16_bundle, "--out-dir", str(tmp_path / "out"), "--out", str(tmp_path / "all.npz"), "--bf16-as", "float32")
    output = document["outputs"][0]
    written = np.load(tmp_path / "out" / "output_0.npy")
    assert written.dtype == np.float32 and np.load(tmp_path / "all.npz")["output_0"].dtype == np.float32
    assert output["dtype"] == "float32" and output["stats"]["dtype"] == "float32"
    assert output["model_dtype"] == "bfloat16"
    assert output["stats"]["max"] == float(written.max())


def test_without_bf16_as_or_without_files_the_dtype_is_the_models(bf16_bundle, tmp_path):
    kept = _run(bf16_bundle, "--out-dir", str(tmp_path / "out"))["outputs"][0]
    assert np.load(tmp_path / "out" / "output_0.npy").dtype == ml_dtypes.bfloat16
    assert kept["dtype"] == kept["model_dtype"] == kept["stats"]["dtype"] == "bfloat16"
    nothing_written = _run(bf16_bundle, "--bf16-as", "float32")["outputs"][0]
    assert nothing_written["dtype"] == "bfloat16" and nothing_written["files"] == []


def test_the_text_table_shows_the_dtype_written(bf16_bundle, embedder_bundle, tmp_path):
    result = cli("run", str(bf16_bundle.path), "--random-inputs", "--out-dir", str(tmp_path / "a"), "--bf16-as", "float32")
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.strip().startswith("output_0"))
    assert "float32 (model: bfloat16)" in row
    # Only bfloat16 outputs change: the embedder's float32 and int64 outputs are written as they are.
    document = _run(embedder_bundle, "--out-dir", str(tmp_path / "b"), "--bf16-as", "float32")
    assert [(item["dtype"], item["model_dtype"]) for item in document["outputs"]] == [
        ("float32", "bfloat16"), ("float32", "float32"), ("int64", "int64")]
    assert np.load(tmp_path / "b" / "output_2.npy").dtype == np.int64
