"""scripts/scale_models.py at tiny sizes: the code bench_scale.py runs at 1B
parameters (and at ViT-B/16, ResNet-50 and Whisper-base sizes) on the GPU,
checked here for correctness on the CPU. The Llama-shaped decoder is compiled
with its two methods sharing weights and cache; a prefill and several decode
steps match eager in bfloat16, and a second prompt after reset_state does too;
`bench --steps` drives its decode loop through the CLI."""

from __future__ import annotations

import copy
import fcntl
import json

import numpy as np
import pytest
import torch
from helpers import cli
from models import scale_models

import cuda_runner

PROMPT = 6
# bfloat16 keeps 8 bits of mantissa: logits of a few units agree to about 2^-7 of their size, step after step.
BF16_TOLERANCE = 5e-2


def _compiled_once(tmp_path_factory, worker_id: str, name: str, build):
    base = tmp_path_factory.getbasetemp()
    folder = (base if worker_id == "master" else base.parent) / f"fixture-scale-{name}"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.bundle"
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        module = build(path)
    return path, module


@pytest.fixture(scope="session")
def llama(tmp_path_factory, worker_id):
    config = scale_models.LLAMA_TINY

    def build(path):
        torch.manual_seed(0)
        module = scale_models.LlamaDecoder(config).eval()
        if not path.exists():
            cuda_runner.compile_methods(copy.deepcopy(module), scale_models.llama_examples(config, PROMPT), path,
                                        dynamic_shapes=scale_models.llama_dynamic_shapes(config))
        return module

    return (*_compiled_once(tmp_path_factory, worker_id, "llama", build), config)


@pytest.fixture(scope="session")
def whisper(tmp_path_factory, worker_id):
    config = scale_models.WHISPER_TINY

    def build(path):
        torch.manual_seed(1)
        module = scale_models.Whisper(config).eval()
        if not path.exists():
            cuda_runner.compile_methods(copy.deepcopy(module), scale_models.whisper_examples(config), path)
        return module

    return (*_compiled_once(tmp_path_factory, worker_id, "whisper", build), config)


def _bf16(tensor: torch.Tensor) -> np.ndarray:
    return tensor.float().numpy()


def _close(got: np.ndarray, want: np.ndarray, what: str) -> float:
    error = float(np.abs(got.astype(np.float32) - want).max())
    scale = max(1.0, float(np.abs(want).max()))
    assert error <= BF16_TOLERANCE * scale, f"{what}: {error:.3g} from eager (logits up to {scale:.3g})"
    return error


def _generate(model, eager, config, prompt: np.ndarray, steps: int) -> list[float]:
    """A prefill of the prompt, then `steps` decodes feeding back eager's argmax; the error of each step's logits."""
    errors = []
    positions = np.arange(len(prompt[0]))
    with torch.no_grad():
        want = _bf16(eager.prefill(torch.from_numpy(prompt), torch.from_numpy(positions)))
    got = model.run({"tokens": prompt, "input_pos": positions}, "prefill")["output_0"]
    errors.append(_close(got, want, "prefill"))
    for step in range(steps):
        token = np.array([[int(want.argmax())]], np.int64)
        position = np.array([len(prompt[0]) + step], np.int64)
        with torch.no_grad():
            want = _bf16(eager.decode(torch.from_numpy(token), torch.from_numpy(position)))
        got = model.run({"tokens": token, "input_pos": position}, "decode")["output_0"]
        errors.append(_close(got, want, f"decode step {step}"))
    return errors


def test_the_decoder_shares_weights_and_cache_between_its_methods(llama):
    path, _, _ = llama
    manifest = cuda_runner.read_manifest(path)
    assert sorted(manifest.methods) == ["decode", "prefill"]
    shared = manifest.shared_weights()
    fqns = {constant.segment: constant.fqn for spec in manifest.methods.values() for constant in spec.constants}
    assert any(fqns[segment] == "output.weight" for segment in shared)  # the weights are stored once for both
    for spec in manifest.methods.values():  # each method keeps a cache of its own: they are the state it writes
        assert {"layers.0.attention.k_cache", "layers.0.attention.v_cache"} <= set(spec.compile_options["mutated_buffers"])
    assert manifest.methods["prefill"].dims  # the prompt's length is dynamic


def test_prefill_and_decode_match_eager_and_a_second_prompt_after_reset_state(llama):
    path, module, config = llama
    rng = np.random.default_rng(2)
    first, second = (rng.integers(0, config.vocab, (1, PROMPT), dtype=np.int64) for _ in range(2))
    with cuda_runner.load(path) as model:
        eager = copy.deepcopy(module)
        errors = _generate(model, eager, config, first, steps=8)
        model.reset_state()
        fresh = copy.deepcopy(module)  # eager's cache empty again, as the runner's now is
        errors += _generate(model, fresh, config, second, steps=4)
    print(f"tiny decoder: worst logit error {max(errors):.3g} over {len(errors)} steps (bfloat16)")


def test_a_decode_loop_is_benchmarked_through_the_cli(llama):
    path, _, config = llama
    result = cli("bench", str(path), "--method", "decode", "--prefill", "prefill", "--prompt-length", str(PROMPT), "--steps", "12",
                 "--warmup", "2", "--range", f"tokens=0:{config.vocab}", "--json")
    assert result.returncode == 0, result.stderr
    decode = json.loads(result.stdout)["decode"]
    assert decode["steps"] == 12 and decode["position_input"] == "input_pos" and decode["prefill_method"] == "prefill"
    assert decode["positions"] == [PROMPT + 3, PROMPT + 14]  # after the prompt, the first step and two warm-up steps
    assert decode["tokens_per_s"] > 0 and decode["prefill_s"] > 0 and decode["step_s"]["count"] == 12
    text = cli("bench", str(path), "--method", "decode", "--steps", "3", "--warmup", "0")
    assert text.returncode == 0 and "tokens/s:" in text.stdout


def test_a_decode_loop_refuses_what_it_cannot_drive(llama, dict_mlp_bundle):
    path, _, _ = llama
    refused = cli("bench", str(dict_mlp_bundle.path), "--steps", "3")
    assert refused.returncode == 2
    assert refused.error_lines[0].startswith("error: method 'forward': cannot tell which input is the position to advance")
    wrong = cli("bench", str(path), "--method", "decode", "--steps", "3", "--position", "nope")
    assert wrong.returncode == 2
    assert wrong.error_lines == ["error: method 'decode' has no input 'nope' to advance; it takes tokens, input_pos (name it with --position)"]
    assert cli("bench", str(path), "--prefill", "prefill").returncode == 2  # --prefill without --steps


def test_a_position_past_the_cache_or_a_token_past_the_vocabulary_is_refused_before_the_library_runs(llama):
    """Eager raises for a cache write past the cache and a token id past the embedding; the compiled library
    would not (Inductor's kernel stops the process on a GPU, the fused attention writes nothing), so the
    bundle bounds both."""
    path, _, config = llama
    last = config.max_seq - 1
    manifest = cuda_runner.read_manifest(path)
    assert "input-bounds" in manifest.optional_features
    for spec in manifest.methods.values():
        assert spec.input("input_pos").bounds == (0, last) and spec.input("tokens").bounds == (0, config.vocab - 1)
    shown = cli("inspect", str(path))
    assert shown.returncode == 0 and f"0 to {last}" in shown.stdout
    assert json.loads(cli("inspect", str(path), "--json").stdout)["methods"]["decode"]["inputs"][1]["bounds"] == {"min": 0, "max": last}

    past = cli("run", str(path), "--method", "decode", "-i", "tokens=[[1]]", "-i", f"input_pos=[{last + 1}]")
    assert past.returncode == 2
    assert past.error_lines == [f"error: input 'input_pos' holds {last + 1}; method 'decode' accepts 0 to {last} (an index into the model's tensors)"]
    assert cli("run", str(path), "--method", "decode", "-i", "tokens=[[1]]", "-i", "input_pos=[-1]").returncode == 2
    prompt = ",".join(str(position) for position in range(last - 2, last + 2))
    assert "holds 32" in cli("run", str(path), "--method", "prefill", "-i", "tokens=[[1,2,3,4]]", "-i", f"input_pos=[{prompt}]").stderr
    assert cli("run", str(path), "--method", "decode", "-i", "tokens=[[1]]", "-i", f"input_pos=[{last}]").returncode == 0
    vocab = cli("run", str(path), "--method", "decode", "-i", f"tokens=[[{config.vocab}]]", "-i", "input_pos=[0]")  # past the embedding
    assert vocab.returncode == 2
    assert vocab.error_lines == [f"error: input 'tokens' holds {config.vocab}; method 'decode' accepts 0 to {config.vocab - 1} (an index into the model's tensors)"]

    with cuda_runner.load(path) as model:  # the Python API checks every call: an array may hold another value since
        position = np.array([last], np.int64)
        model.run({"tokens": np.ones((1, 1), np.int64), "input_pos": position}, "decode")
        position[0] = last + 1
        with pytest.raises(cuda_runner.InputError, match="accepts 0 to") as refused:
            model.run({"tokens": np.ones((1, 1), np.int64), "input_pos": position}, "decode")
        assert refused.value.subject == "bounds"



def test_the_library_gets_the_value_that_was_checked(llama, monkeypatch):
    """The check and the library read one copy: a caller's array changed right after the check (another
    thread) does not reach the library with a position past the cache."""
    import cuda_runner.runtime.method as method_module

    path, _, config = llama
    checked = method_module.check_bounds
    position = np.array([3], np.int64)

    def check_then_change(*args):
        checked(*args)
        position[0] = config.max_seq + 8  # what a second thread could write between the check and the run

    with cuda_runner.load(path) as model:
        want = model.run({"tokens": np.ones((1, 1), np.int64), "input_pos": np.array([3], np.int64)}, "decode")["output_0"]
        model.reset_state()
        monkeypatch.setattr(method_module, "check_bounds", check_then_change)
        got = model.run({"tokens": np.ones((1, 1), np.int64), "input_pos": position}, "decode")["output_0"]
    np.testing.assert_array_equal(got, want)


def test_a_decode_loop_past_the_cache_is_refused_before_anything_loads(llama, monkeypatch):
    path, _, config = llama
    steps = config.max_seq - PROMPT - 2  # the first call and two warm-up steps, then these: one past the cache
    refused = cli("bench", str(path), "--method", "decode", "--prefill", "prefill", "--prompt-length", str(PROMPT), "--steps", str(steps),
                  "--warmup", "2")
    assert refused.returncode == 2
    assert refused.error_lines[0].startswith(f"error: the loop would run method 'decode' at positions {PROMPT} to {config.max_seq}")
    from cuda_runner.commands import bench

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    loop = bench.DecodeLoop(steps=steps, prefill="prefill", prompt_length=PROMPT)
    with monkeypatch.context() as patch, pytest.raises(cuda_runner.InputError, match="accepts 0 to"):
        patch.setattr(bench, "load_model", no_loading)
        bench.benchmark(bench.BenchRequest(path, method="decode", warmup_runs=2, decode=loop))
    fits = cli("bench", str(path), "--method", "decode", "--prefill", "prefill", "--prompt-length", str(PROMPT), "--steps", str(steps - 1),
               "--warmup", "2", "--json")
    assert fits.returncode == 0, fits.stderr
    assert json.loads(fits.stdout)["decode"]["positions"][1] == config.max_seq - 1


def test_whisper_encodes_then_decodes_with_its_cache(whisper):
    path, module, config = whisper
    examples = scale_models.whisper_examples(config)
    mel = examples["encode"][0].numpy()
    eager = copy.deepcopy(module)
    with torch.no_grad():
        audio_eager = eager.encode(examples["encode"][0])
    with cuda_runner.load(path) as model:
        audio = model.run([mel], "encode")["output_0"]
        np.testing.assert_allclose(audio, audio_eager.numpy(), rtol=1e-4, atol=1e-4)
        assert model.method("decode").stateful and not model.method("encode").stateful
        token = 1
        for position in range(4):
            inputs = [np.array([[token]], np.int64), np.array([position], np.int64), audio]
            got = model.run(inputs, "decode")["output_0"]
            with torch.no_grad():
                want = eager.decode(torch.tensor([[token]]), torch.tensor([position]), torch.from_numpy(audio)).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
            token = int(want.argmax())
