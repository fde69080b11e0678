"""Comparing with references and self-tests through the CLI: exit 1 means wrong numbers."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
from helpers import cli

from cuda_runner.format import open_bundle, write_bundle


def test_self_test_passes_and_inspect_shows_samples(dict_mlp_bundle):
    result = cli("run", str(dict_mlp_bundle.path), "--self-test")
    assert result.returncode == 0, result.stderr
    assert "PASSED logits" in result.stdout and result.stdout.strip().endswith("VERDICT: PASSED")
    document = json.loads(cli("inspect", str(dict_mlp_bundle.path), "--json").stdout)
    assert document["methods"]["forward"]["samples"] is True


def _perturbed(bundle_path, target):
    """The same bundle with every float32 weight scaled by 1.01: valid, but wrong."""
    with open_bundle(bundle_path) as reader:
        manifest = reader.manifest
        segments = {entry.name: bytes(reader.segment(entry.name)) for entry in manifest.segments}
    weights = np.frombuffer(segments["forward_weights_blob"], np.float32) * np.float32(1.01)
    segments["forward_weights_blob"] = weights.tobytes()
    write_bundle(target, replace(manifest), segments)
    return target


def test_perturbed_model_fails_self_test_with_exit_1(dict_mlp_bundle, tmp_path):
    bad = _perturbed(dict_mlp_bundle.path, tmp_path / "perturbed.bundle")
    result = cli("run", str(bad), "--self-test", "--json")
    assert result.returncode == 1, result.stderr
    document = json.loads(result.stdout)
    assert document["verdict"] == "FAILED"
    logits = next(output for output in document["comparison"]["outputs"] if output["name"] == "logits")
    assert logits["verdict"] == "FAILED" and logits["mismatched"] > 0 and logits["worst_index"] is not None
    assert "VERDICT: FAILED" in result.stderr


def test_expected_from_an_earlier_run_passes_and_perturbed_fails(dict_mlp_bundle, tmp_path):
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((3, 16), dtype=np.float32))
    np.save(tmp_path / "bias.npy", np.zeros(8, np.float32))
    inputs = ["-i", str(tmp_path / "x.npy"), "-i", str(tmp_path / "bias.npy")]
    assert cli("run", str(dict_mlp_bundle.path), *inputs, "--out-dir", str(tmp_path / "ref")).returncode == 0
    same = cli("run", str(dict_mlp_bundle.path), *inputs, "--expected", str(tmp_path / "ref"))
    assert same.returncode == 0 and "FAILED" not in same.stdout
    bad = _perturbed(dict_mlp_bundle.path, tmp_path / "perturbed.bundle")
    differs = cli("run", str(bad), *inputs, "--expected", str(tmp_path / "ref"))
    assert differs.returncode == 1
    assert "FAILED logits" in differs.stdout
    loose = cli("run", str(bad), *inputs, "--expected", str(tmp_path / "ref"), "--atol", "10", "--rtol", "1")
    assert loose.returncode == 0, loose.stdout


def test_nan_outputs_are_compared_and_counted(dict_mlp_bundle, tmp_path):
    x = np.zeros((2, 16), np.float32)
    x[1, 3] = np.nan
    np.savez(tmp_path / "in.npz", x=x, bias=np.zeros(8, np.float32))
    assert cli("run", str(dict_mlp_bundle.path), "-i", str(tmp_path / "in.npz"), "--out", str(tmp_path / "ref.npz")).returncode == 0
    result = cli("run", str(dict_mlp_bundle.path), "-i", str(tmp_path / "in.npz"), "--expected", str(tmp_path / "ref.npz"), "--json")
    assert result.returncode == 0, result.stdout
    logits = json.loads(result.stdout)["comparison"]["outputs"][0]
    assert logits["nan_actual"] == logits["nan_expected"] > 0
    finite = dict(np.load(tmp_path / "ref.npz"))
    finite["logits"] = np.nan_to_num(finite["logits"])
    np.savez(tmp_path / "finite.npz", **finite)
    mismatch = cli("run", str(dict_mlp_bundle.path), "-i", str(tmp_path / "in.npz"), "--expected", str(tmp_path / "finite.npz"))
    assert mismatch.returncode == 1 and "NaN" in mismatch.stdout


def test_self_test_without_samples_is_a_usage_error(embedder_bundle):
    result = cli("run", str(embedder_bundle.path), "--self-test")
    assert result.returncode == 2 and "no stored samples" in result.stderr
