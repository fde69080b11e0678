"""The zoo of real ExecuTorch 1.5.1 exports (scripts/make_et_zoo.py on an
H200): multi-method programs, a KV cache, an encoder/decoder pair, permuted,
repeated and pass-through outputs, int64 and bool tensors, two dynamic dims,
weights shared between methods. On the CPU machine every program is read,
inspected and converted through the CLI; tests/gpu runs them against eager."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT, cli

from cuda_runner.format import read_manifest
from cuda_runner.format.program import ProgramReader

ZOO = ROOT / "tests" / "data" / "executorch" / "zoo_et151_torch211"
INDEX = json.loads((ZOO / "zoo.json").read_text())
PROGRAMS = sorted(INDEX["programs"])
# Three of them exported by ExecuTorch 1.4.1: the same wiring, in layout G2 (one weights blob per method).
OLDER = ROOT / "tests" / "data" / "executorch" / "zoo_et141_torch211"
OLDER_INDEX = json.loads((OLDER / "zoo.json").read_text())


def _folder(name: str, zoo: str = "et151"):
    if zoo == "et141":
        return OLDER / OLDER_INDEX["programs"][name]["folder"]
    return ZOO / INDEX["programs"][name]["folder"]


def test_the_zoo_has_the_shapes_people_ship():
    assert len(PROGRAMS) >= 8
    assert all(entry["status"] == "ok" for entry in INDEX["programs"].values())


@pytest.mark.parametrize(("zoo", "name"), [("et151", name) for name in PROGRAMS] + [("et141", name) for name in sorted(OLDER_INDEX["programs"])])
def test_every_zoo_program_is_read_inspected_and_converted(tmp_path, zoo, name):
    folder = _folder(name, zoo)
    calls = (OLDER_INDEX if zoo == "et141" else INDEX)["programs"][name]["calls"]
    with ProgramReader(folder / "model.pte") as reader:
        methods = reader.manifest.methods
        for call in calls:  # every method the reference drives, with its dtypes and ranks
            spec = methods[call["method"]]
            assert [tensor.dtype for tensor in spec.inputs] == [info["dtype"] for info in call["input_info"]]
            assert [tensor.dtype for tensor in spec.outputs] == [info["dtype"] for info in call["output_info"]]
            assert [tensor.rank for tensor in spec.outputs] == [len(info["shape"]) for info in call["output_info"]]
    shown = cli("inspect", str(folder / "model.pte"), "--json")
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert set(document["methods"]) == {call["method"] for call in calls} | set(document["methods"])
    converted = tmp_path / "zoo.bundle"
    result = cli("convert", str(folder / "model.pte"), "-o", str(converted), "--no-call-helper")
    assert result.returncode == 0, result.stderr
    assert read_manifest(converted).methods == methods  # wiring, constants and signatures survive conversion


def test_wiring_is_mapped_by_value():
    """How ExecuTorch wires values, as these exports do: each shape in the zoo."""
    def method(program, name="forward"):
        with ProgramReader(_folder(program) / "model.pte") as reader:
            return reader.manifest.methods[name]

    decoder = method("b_enc_dec", "decoder")
    assert decoder.wiring is not None and decoder.wiring.library_inputs == (1, 0)  # the delegate takes enc first
    permuted = method("f_dtypes").wiring  # the delegate gives the method's third output last
    assert permuted is not None and [source.index for source in permuted.outputs] == [0, 1, 4, 2, 3]
    repeated = method("d_repeated_out").wiring
    assert repeated is not None and repeated.outputs[0] == repeated.outputs[1]
    passthrough = method("e_input_out").wiring
    assert passthrough is not None and passthrough.outputs[1].from_input and passthrough.outputs[1].index == 0
    assert method("g_dyn2").wiring is None  # in order: no wiring recorded


def test_constant_methods_are_shown_not_run():
    result = cli("inspect", str(_folder("a_llm_kv") / "model.pte"))
    assert result.returncode == 0, result.stderr
    assert "constant method get_max_seq_len: returns 32" in result.stdout
    assert "constant method use_kv_cache: returns True" in result.stdout
    # The program does not mark the decoder's KV cache: inspect says where state is found.
    assert "state: not recorded in the program" in result.stdout
    run = cli("run", str(_folder("a_llm_kv") / "model.pte"), "--method", "get_max_seq_len", "--random-inputs")
    assert run.returncode == 2 and "get_max_seq_len" in run.stderr


def test_methods_sharing_weights_by_name_share_segments():
    with ProgramReader(_folder("h_shared_weights") / "model.pte") as reader:
        prefill, decode = (reader.manifest.methods[name] for name in ("prefill", "decode"))
        shared = {constant.fqn: constant.segment for constant in prefill.constants}
        common = [constant for constant in decode.constants if constant.fqn in shared]
        assert common and all(shared[constant.fqn] == constant.segment for constant in common)


def test_the_older_exports_keep_one_weights_blob_per_method_and_the_same_wiring():
    """ExecuTorch 1.4 wrote each method's weights as one SHA-keyed blob (layout G2)."""
    for name, method_name in (("a_llm_kv", "text_decoder"), ("b_enc_dec", "decoder"), ("f_dtypes", "forward")):
        with ProgramReader(_folder(name, "et141") / "model.pte") as older, ProgramReader(_folder(name) / "model.pte") as newer:
            old, new = older.manifest.methods[method_name], newer.manifest.methods[method_name]
            assert old.compile_options["executorch_payload_layout"] == "G2" and old.weights_segment is not None and not old.constants
            assert new.compile_options["executorch_payload_layout"] == "G3" and new.weights_segment is None  # per-FQN constants, where it has weights
            assert old.wiring == new.wiring and old.inputs == new.inputs and old.outputs == new.outputs
