"""scripts/bench_scale.py's own bookkeeping (its stages run on the GPU machine)."""

from __future__ import annotations

import ast
import json
import sys

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_scale


def test_a_stage_saves_what_it_has_so_far_and_the_compile_jobs_still_get_settings_as_a_literal(tmp_path, monkeypatch):
    partial = tmp_path / "scale-big.partial.json"
    monkeypatch.setattr(bench_scale, "PARTIAL", [partial])
    bench_scale.save_partial({"compile": {"vit_b16": {"seconds": 1.0}}})
    assert json.loads(partial.read_text()) == {"compile": {"vit_b16": {"seconds": 1.0}}}
    # The compile jobs are Python source with SETTINGS written into it: a value
    # that is not a literal (a Path once) broke every compile job with a NameError.
    switches = {"cuda_runner.compile.attention_kernel": {"EARLY_POSITION": False}}
    code = bench_scale.COMPILE_BUNDLE.format(scripts="s", root="r", settings=dict(bench_scale.SETTINGS), path="p", device="cpu",
                                             runtime="auto", options="None", switches=switches)
    calls = [node for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Call)]
    written = next(node for node in calls if ast.unparse(node.func).endswith("SETTINGS.update"))
    assert ast.literal_eval(written.args[0]) == bench_scale.SETTINGS
    switched = next(node for node in calls if ast.unparse(node.func).endswith("set_switches"))
    assert ast.literal_eval(switched.args[0]) == switches


def test_a_switch_that_does_not_exist_is_refused():
    with pytest.raises(AttributeError, match="no switch NOT_A_SWITCH"):
        bench_scale.set_switches({"bench_scale": {"NOT_A_SWITCH": True}})


@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
def test_every_builds_switches_exist():
    import importlib

    for build, keywords in bench_scale.BUILDS.items():
        for module_name, values in keywords.get("switches", {}).items():
            module = importlib.import_module(module_name)
            assert all(hasattr(module, name) for name in values), build
