"""The zoos of real ExecuTorch exports on the GPU (1.5.1, layout G3, and
1.4.1, layout G2): every program's reference calls (zoo.json) run in order
on one loaded program, directly and converted, each output against eager
PyTorch's; the decoder's KV cache keeps its state from the prefill through
every decode step, and reset_state puts it back (per-FQN weights in 1.5, one
weights blob in 1.4); methods sharing weights upload them once."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import ROOT, cli

import cuda_runner

pytestmark = pytest.mark.gpu

ZOOS = {zoo: ROOT / "tests" / "data" / "executorch" / f"zoo_{zoo}_torch211" for zoo in ("et151", "et141")}
INDEXES = {zoo: json.loads((folder / "zoo.json").read_text()) for zoo, folder in ZOOS.items()}
ZOO, INDEX = ZOOS["et151"], INDEXES["et151"]
PROGRAMS = [(zoo, name) for zoo, index in INDEXES.items() for name in sorted(index["programs"])]


def _run_calls(model, name, zoo="et151"):
    """Every reference call of program `name`, in order; the worst error of each."""
    entry = INDEXES[zoo]["programs"][name]
    io = np.load(ZOOS[zoo] / entry["folder"] / "io.npz")
    errors = []
    for step, call in enumerate(entry["calls"]):
        outputs = model.run([io[key] for key in call["inputs"]], call["method"])
        for position, key in enumerate(call["outputs"]):
            got, want = outputs[f"output_{position}"], io[key]
            assert got.dtype == want.dtype and got.shape == want.shape, (name, step, key, got.dtype, got.shape)
            if want.dtype.kind in "biu":
                assert np.array_equal(got, want), (name, step, key)
                errors.append(0.0)
            else:
                errors.append(float(np.abs(got.astype(np.float64) - want).max()))
    return errors


@pytest.mark.parametrize(("zoo", "name"), PROGRAMS)
def test_zoo_programs_match_eager_step_by_step(tmp_path, zoo, name):
    program = ZOOS[zoo] / INDEXES[zoo]["programs"][name]["folder"] / "model.pte"
    with cuda_runner.load(program) as model:
        direct = _run_calls(model, name, zoo)
    converted = tmp_path / "zoo.bundle"
    assert cli("convert", str(program), "-o", str(converted)).returncode == 0
    with cuda_runner.load(converted) as model:
        through_bundle = _run_calls(model, name, zoo)
    print(f"{zoo} {name}: max abs error per output, direct {max(direct):.3g}, converted {max(through_bundle):.3g} ({len(direct)} outputs)")
    assert max(direct) <= 1e-4 and max(through_bundle) <= 1e-4


@pytest.mark.parametrize("zoo", sorted(ZOOS))
def test_the_kv_cache_keeps_its_state_and_resets(zoo):
    entry = INDEXES[zoo]["programs"]["a_llm_kv"]
    io = np.load(ZOOS[zoo] / entry["folder"] / "io.npz")
    prefill, decode = [call for call in entry["calls"] if call["method"] == "text_decoder"][:2]

    def error(call):
        got = model.run([io[key] for key in call["inputs"]], "text_decoder")["output_0"]
        return float(np.abs(got - io[call["outputs"][0]]).max())

    with cuda_runner.load(ZOOS[zoo] / entry["folder"] / "model.pte") as model:
        decoder = model.method("text_decoder")
        assert decoder.stateful and decoder.lanes == 1 and decoder.warm_up_note.startswith("skipped")
        errors = _run_calls(model, "a_llm_kv", zoo)
        print(f"{zoo} a_llm_kv: logits within {max(errors):.3g} of eager at every step (prefill, then decodes)")
        model.reset_state("text_decoder")
        without_prefill = error(decode)  # an empty cache: the first decode no longer sees the prompt
        print(f"{zoo} a_llm_kv: first decode after reset_state, without the prefill: {without_prefill:.3g} from eager")
        assert without_prefill > 1e-3
        model.reset_state()
        assert error(prefill) <= 1e-4 and error(decode) <= 1e-4


@pytest.mark.parametrize("zoo", ["et151"])  # per-FQN state, reset in place: the graphs outlive reset_state
def test_the_kv_cache_keeps_its_state_through_cuda_graph_replays(zoo):
    """A stateful method under --cuda-graph: its first calls run as they are, the
    next is captured, and every replay writes the cache the next one reads, as
    ExecuTorch's enable_cuda_graph_for_method does; the decode steps (one shape)
    and the prefill (another) each get a graph once their warm-up calls are done."""
    entry = INDEXES[zoo]["programs"]["a_llm_kv"]
    program = ZOOS[zoo] / entry["folder"] / "model.pte"
    with cuda_runner.load(program, cuda_graph=True) as graphed:
        rounds = []
        for _ in range(3):  # three decodes a round: the second round's first decode is captured, the rest replay
            rounds.append(max(_run_calls(graphed, "a_llm_kv", zoo)))
            graphed.reset_state()
        executor = graphed.method("text_decoder")._lanes.first
        print(f"{zoo} a_llm_kv under CUDA graphs: worst error per round {rounds}, {executor.graphs} graph(s) captured")
        assert max(rounds) <= 1e-4 and executor.graphs >= 1


def test_methods_sharing_weights_upload_them_once():
    folder = ZOO / INDEX["programs"]["h_shared_weights"]["folder"]
    with cuda_runner.load(folder / "model.pte") as model:
        shared = sum(len(method.spec.constants) for method in model.methods.values())
        uploaded = model.constant_storages
        errors = _run_calls(model, "h_shared_weights")
    separate = 0
    for method in ("prefill", "decode"):
        with cuda_runner.load(folder / "model.pte", methods=[method]) as alone:
            separate += alone.constant_storages
    print(f"h_shared_weights: {uploaded} storages uploaded for both methods together, {separate} loaded one method at a time ({shared} constants)")
    assert uploaded < separate and max(errors) <= 1e-4
