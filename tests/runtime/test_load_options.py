"""LoadOptions: one value every load takes, so no way of loading drops an option."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cuda_runner
from cuda_runner import LoadOptions
from cuda_runner.commands.batch import BatchRequest, run_batch
from cuda_runner.commands.bench import BenchRequest, benchmark
from cuda_runner.commands.running import RunRequest, run_bundle
from cuda_runner.errors import InputError
from cuda_runner.io.inputs import ArchiveFile, GivenInputs


def _sets(folder: Path) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    for index in range(3):
        np.savez(folder / f"s{index}.npz", x=rng.standard_normal((2, 16), dtype=np.float32), bias=rng.standard_normal(8, dtype=np.float32))
    return folder


def test_an_unknown_option_is_refused_by_name_before_anything_opens(tmp_path):
    with pytest.raises(InputError, match=r"unknown load option 'lane'; the options are: .*lanes"):
        cuda_runner.load(tmp_path / "missing.bundle", lane=2)


@pytest.mark.parametrize(("fields", "message"), [({"lanes": 0}, "lanes must be a whole number from 1"), ({"provider": "cuda"}, "unknown provider 'cuda'")])
def test_bad_values_are_refused_when_the_options_are_made(fields, message):
    with pytest.raises(InputError, match=message):
        LoadOptions(**fields)


def test_keywords_and_an_options_value_load_alike(dict_mlp_bundle):
    x, bias = np.ones((2, 16), np.float32), np.zeros(8, np.float32)
    with cuda_runner.load(dict_mlp_bundle.path, lanes=3, call_helper=False) as by_keywords:
        method = by_keywords.method()
        assert (method.lanes, method.call_path) == (3, "ctypes: the call helper is turned off")
        expected = by_keywords.run({"x": x, "bias": bias})
    with cuda_runner.load(dict_mlp_bundle.path, options=LoadOptions(lanes=3, call_helper=False)) as by_value:
        assert (by_value.method().lanes, by_value.method().call_path) == (3, "ctypes: the call helper is turned off")
        np.testing.assert_array_equal(by_value.run({"x": x, "bias": bias})["logits"], expected["logits"])


def test_batch_keeps_every_option_and_times_the_open(dict_mlp_bundle, tmp_path):
    """Batch once dropped call_helper and check_inputs, and reported an open time of about 0."""
    folder = _sets(tmp_path / "sets")
    helped = run_batch(BatchRequest(dict_mlp_bundle.path, folder, tmp_path / "helped"))
    unhelped = run_batch(BatchRequest(dict_mlp_bundle.path, folder, tmp_path / "unhelped", load=LoadOptions(lanes=2, call_helper=False)))
    assert helped.verdict == unhelped.verdict == "PASSED"
    assert "load_call_helper" in helped.load_timings and "load_call_helper" not in unhelped.load_timings
    assert helped.load_timings["open"] > 0
    for name in ("s0", "s1", "s2"):
        np.testing.assert_array_equal(np.load(tmp_path / "helped" / name / "logits.npy"), np.load(tmp_path / "unhelped" / name / "logits.npy"))


def test_run_and_bench_take_the_options_they_are_given(dict_mlp_bundle, tmp_path):
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, x=np.ones((2, 16), np.float32), bias=np.zeros(8, np.float32))
    plan = GivenInputs((ArchiveFile(inputs),))
    ran = run_bundle(RunRequest(dict_mlp_bundle.path, plan, load=LoadOptions(call_helper=False)))
    assert "load_call_helper" not in ran.load_timings and ran.load_timings["open"] > 0
    measured = benchmark(BenchRequest(dict_mlp_bundle.path, plan, load=LoadOptions(call_helper=False), warmup_runs=1, iterations=3))
    assert measured.call_path == "ctypes: the call helper is turned off"
    assert measured.load["open"] > 0


@pytest.mark.parametrize(("fields", "message"), [
    ({"check_inputs": "no"}, "check_inputs must be True or False"),
    ({"lanes": True}, "lanes must be a whole number"),
    ({"lanes": 10**6}, "lanes must be a whole number from 1 to 256"),
    ({"trusted_keys": "key.pem"}, "trusted_keys must be a tuple of keys"),
])
def test_values_of_the_wrong_kind_are_refused(fields, message):
    with pytest.raises(InputError, match=message):
        LoadOptions(**fields)


def test_options_must_be_a_load_options_value(tmp_path):
    with pytest.raises(InputError, match=r"options must be a cuda_runner\.LoadOptions, not dict"):
        cuda_runner.load(tmp_path / "missing.bundle", options={"lanes": 2})
