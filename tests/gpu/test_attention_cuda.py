"""The fused decode attention on the GPU: the kernel against torch's SDPA over
the shapes and masks it takes, and standalone CUDA builds of the scale
models' tiny configurations (where it is on by default; the tests name the
option anyway), whose decode methods get it and still match eager step after
step; the option through the CLI, on and off, and combo kernels turned off
through it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import compile_with_option
from models import compile_tiny_llama, hugging_face_static_llama, scale_models

import cuda_runner
from cuda_runner.compile.attention import OPTION, TABLE_PREFIX, UPDATE_OPTION

pytestmark = pytest.mark.gpu

# (heads, kv heads, query rows, cache positions, head dim, value dim)
SHAPES = [(32, 8, 1, 512, 64, 64), (8, 8, 3, 77, 80, 80), (4, 1, 1, 4096, 128, 128), (6, 2, 16, 5, 32, 16), (2, 2, 1, 1, 8, 8),
          (4, 2, 1, 300, 16, 256)]  # values wider than keys: the tile's rows follow the wider


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "bool", "additive", "all-masked", "position"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_the_kernel_computes_what_sdpa_does(shape, mask, dtype):
    from cuda_runner.compile import attention_kernel  # noqa: F401  (registers the operator)

    heads, kv_heads, rows, length, dim, value_dim = shape
    generator = torch.Generator("cuda").manual_seed(sum(shape))
    q, k, v = (torch.randn(size, device="cuda", dtype=dtype, generator=generator)
               for size in ((2, heads, rows, dim), (2, kv_heads, length, dim), (2, kv_heads, length, value_dim)))
    attn_mask = {"none": None, "bool": torch.rand(1, 1, rows, length, device="cuda", generator=generator) > 0.3,
                 "additive": torch.randn(2, 1, 1, length, device="cuda", dtype=dtype, generator=generator),
                 "all-masked": torch.zeros(rows, length, dtype=torch.bool, device="cuda"), "position": None}[mask]
    group = heads // kv_heads
    limit = None
    if mask == "position":  # row r keeps positions 0..limit[r]: the first, the last, past the cache, between, none, int64's largest
        limit = torch.tensor([0, length - 1, length + 3, length // 2, -1, 2**63 - 1][:rows] + [length // 3] * max(0, rows - 6), device="cuda")
        attn_mask = torch.arange(length, device="cuda")[None, :] <= limit[:, None]
    got = torch.ops.cuda_runner.decode_attention(q, k, v, None if limit is not None else attn_mask, 0.37, group, limit)
    reference_mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.float()
    want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1),
                                          attn_mask=reference_mask, scale=0.37)
    want = torch.nan_to_num(want)  # a row with every position masked: zeros (torch's safe softmax; older torch gave NaN)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("plan", [(32, 16, 32, 2), (512, 1, 512, 8), (128, 4, 64, 4), (256, 2, 256, 4)],
                         ids=lambda plan: "keys {} x {}, tile {}, {} warps".format(*plan))
def test_every_plan_of_the_decoders_call_computes_what_sdpa_does(plan):
    """The 1B decoder's call (32 heads over 8 K/V heads, 512 cached positions of 64)
    shared out each way scripts/bench_step_plans.py times: split and merged, or one
    program a row; the kernels that wait for the launch before (a plain launch)."""
    from cuda_runner.compile.attention_kernel import AttentionPlan, launch_attention

    generator = torch.Generator("cuda").manual_seed(5)
    q, k, v = (torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=generator)
               for size in ((1, 32, 1, 64), (1, 8, 512, 64), (1, 8, 512, 64)))
    for position in (0, 31, 255, 511, 700):
        out = torch.full_like(q, float("nan"))
        launch_attention(q, k, v, None, torch.tensor([position], device="cuda"), out, 0.125, 4, AttentionPlan(*plan), pdl=True)
        allowed = torch.arange(512, device="cuda") <= position
        want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1),
                                              attn_mask=allowed, scale=0.125)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("early_position, go_ahead", [(False, False), (True, False), (True, True)],
                         ids=["position read after the wait", "before it, launched programmatically", "and the next launch let go first"])
@pytest.mark.parametrize("pairs", [0, 1, 2])
@pytest.mark.parametrize("plan", [(32, 16, 32, 2), (512, 1, 512, 8)], ids=["split", "one program a row"])
def test_the_updating_kernel_writes_the_step_and_attends_to_it_as_index_copy_and_sdpa_do(plan, pairs, early_position, go_ahead, monkeypatch):
    """The 1B decoder's call with the step's key and value written by the kernel: rotated in
    neighbouring pairs or halves, or not; at the first position, the edges of the stretches, the
    last, and past the cache (nothing written); the kernels that wait for the launch before, and
    (attention_kernel.EARLY_POSITION) that read the position and the tables' rows before the wait,
    and (ATTENTION_GO_AHEAD_FIRST, MERGE_GO_AHEAD_FIRST) let the next launch start before it."""
    from cuda_runner.compile import attention_kernel
    from cuda_runner.compile.attention_kernel import AttentionPlan, CacheUpdate, launch_attention

    monkeypatch.setattr(attention_kernel, "EARLY_POSITION", early_position)
    monkeypatch.setattr(attention_kernel, "ATTENTION_GO_AHEAD_FIRST", go_ahead)
    monkeypatch.setattr(attention_kernel, "MERGE_GO_AHEAD_FIRST", go_ahead)

    generator = torch.Generator("cuda").manual_seed(7)
    angles = torch.rand(512, 32, device="cuda", generator=generator) * 6.0
    cos, sin = angles.cos(), angles.sin()
    tables = {1: (cos.repeat_interleave(2, 1).contiguous(), torch.stack((-sin, sin), -1).flatten(1).contiguous()),
              2: (torch.cat((cos, cos), 1), torch.cat((-sin, sin), 1))}.get(pairs, (None, None))
    partner = torch.arange(64, device="cuda") ^ 1 if pairs == 1 else (torch.arange(64, device="cuda") + 32) % 64

    def rotate(x, step):
        if not pairs:
            return x
        return (x.float() * tables[0][step] + x.float()[..., partner] * tables[1][step]).to(x.dtype)

    for position in (0, 31, 32, 255, 511, 700):
        q, k, v = (torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=generator) for size in ((1, 32, 1, 64), (1, 8, 1, 64), (1, 8, 1, 64)))
        keys, values = (torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(2))
        want_keys, want_values = keys.clone(), values.clone()
        step = torch.tensor([position], device="cuda")
        if position < 512:
            want_keys.index_copy_(2, step, rotate(k, position))
            want_values.index_copy_(2, step, v)
        allowed = torch.arange(512, device="cuda") <= position
        want = F.scaled_dot_product_attention(rotate(q, min(position, 511)).float(), want_keys.float().repeat_interleave(4, 1),
                                              want_values.float().repeat_interleave(4, 1), attn_mask=allowed, scale=0.125)
        out = torch.full_like(q, float("nan"))
        update = CacheUpdate(k, v, step, (*tables, pairs), (*tables, pairs), inputs_unwritten=True, after_a_launch=True)
        launch_attention(q, keys, values, None, step, out, 0.125, 4, AttentionPlan(*plan), pdl=True, launch_pdl=early_position, update=update)
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
        assert torch.equal(keys, want_keys) or (keys.float() - want_keys.float()).abs().max().item() <= 2 ** -7
        assert torch.equal(values, want_values)


def _generate(model, eager, config, prompt, steps):
    positions = np.arange(prompt.shape[1])
    errors = []
    with torch.no_grad():
        want = eager.prefill(torch.from_numpy(prompt).cuda(), torch.from_numpy(positions).cuda()).float().cpu().numpy()
    model.run({"tokens": prompt, "input_pos": positions}, "prefill")
    for step in range(steps):
        token = np.array([[int(want.argmax())]], np.int64)
        position = np.array([prompt.shape[1] + step], np.int64)
        with torch.no_grad():
            want = eager.decode(torch.from_numpy(token).cuda(), torch.from_numpy(position).cuda()).float().cpu().numpy()
        got = model.run({"tokens": token, "input_pos": position}, "decode")["output_0"].astype(np.float32)
        errors.append(float(np.abs(got - want).max()))
    return errors


def test_the_standalone_decoder_fuses_each_layers_decode_attention_and_matches_eager(tmp_path, monkeypatch):
    config = scale_models.LLAMA_TINY
    path = tmp_path / "llama.bundle"
    module = compile_tiny_llama(path, {OPTION: True})
    methods = cuda_runner.read_manifest(path).methods
    assert methods["decode"].compile_options["fused_decode_attention"] == config.layers
    # its mask is proven to be "up to the step's position", and the step's small kernels are launched together
    assert methods["decode"].compile_options["fused_decode_attention_position_limits"] == config.layers
    assert methods["decode"].compile_options["combo_kernels"] is True
    # the step's cache writes and its rotations of q and k are the kernel's, from tables the build added to the program
    assert methods["decode"].compile_options["fused_cache_updates"] == config.layers
    assert methods["decode"].compile_options["fused_rotations"] == 2 * config.layers
    decode_constants = {constant.fqn: constant.segment for constant in methods["decode"].constants or ()}
    assert any(fqn.startswith(TABLE_PREFIX) for fqn in decode_constants)
    # the methods still hold their weights and caches once, the caches shared as state
    prefill_constants = {constant.fqn: constant.segment for constant in methods["prefill"].constants or ()}
    assert decode_constants["layers.0.attention.k_cache"] == prefill_constants["layers.0.attention.k_cache"]
    assert decode_constants["layers.0.attention.wq.weight"] == prefill_constants["layers.0.attention.wq.weight"]
    assert "fused_decode_attention" not in methods["prefill"].compile_options  # a prompt of dynamic length keeps SDPA's lowering
    prompt = np.random.default_rng(3).integers(0, config.vocab, (1, 6), dtype=np.int64)
    with cuda_runner.load(path, "cuda") as model:
        errors = _generate(model, copy.deepcopy(module).cuda(), config, prompt, steps=12)
    print(f"tiny decoder, fused attention: worst logit error {max(errors):.3g} over 12 decode steps (bfloat16)")
    assert max(errors) < 5e-2
    _graphed_device_loop_matches_host_calls(path, prompt, steps=10)
    _graphed_host_calls_in_c_match_python(path, prompt, steps=10, monkeypatch=monkeypatch)


def _graphed_host_calls_in_c_match_python(path, prompt, steps, monkeypatch):
    """A greedy decode loop on host arrays through CUDA graphs, the replays made in C
    (graph_call.c) and in Python: every step's logits agree to the bit, the caches
    carried; after its capture the C call makes every step; a position past the
    cache is refused by the ordinary path's check, having run nothing."""
    from cuda_runner.errors import InputError
    from cuda_runner.runtime import graphs

    replays_in_python = []
    real_replay = graphs.CudaGraphExecutor._replay
    monkeypatch.setattr(graphs.CudaGraphExecutor, "_replay", lambda self, *args: replays_in_python.append(1) or real_replay(self, *args))
    positions = np.arange(prompt.shape[1])
    logits = {}
    for in_c in (False, True):
        monkeypatch.setattr(graphs, "GRAPH_C_CALLS", in_c)
        replays_in_python.clear()
        with cuda_runner.load(path, "cuda", cuda_graph=True) as model:
            method = model.method("decode")
            last = model.run({"tokens": prompt, "input_pos": positions}, "prefill")["output_0"]
            logits[in_c] = []
            for step in range(steps):
                if in_c and step == steps // 2:
                    past = {"tokens": np.array([[1]], np.int64), "input_pos": np.array([scale_models.LLAMA_TINY.max_seq], np.int64)}
                    with pytest.raises(InputError) as refused:
                        method.run(past)
                    assert refused.value.subject == "bounds"
                token = np.array([[int(last.astype(np.float32).argmax())]], np.int64)
                last = method.run({"tokens": token, "input_pos": np.array([prompt.shape[1] + step], np.int64)})["output_0"]
                logits[in_c].append(last)
            assert (method._lanes.first.fast_call is not None) is in_c
            # Python replays the capturing call only (and the refused one goes no further than its check).
            assert len(replays_in_python) == (1 if in_c else steps - graphs.WARMUP_CALLS), len(replays_in_python)
    for step, (python, in_c) in enumerate(zip(logits[False], logits[True])):
        assert np.array_equal(python.view(np.uint16), in_c.view(np.uint16)), step


def _graphed_device_loop_matches_host_calls(path, prompt, steps):
    """The decoder loaded twice: host calls, and device arrays through CUDA graphs, each
    step's token picked on the GPU from the last logits and nothing waited for until
    the end (as a decode loop that samples on the GPU runs); the caches carry from
    step to step in both, and every step's logits agree to the bit."""
    import cupy

    from cuda_runner.runtime.graphs import WARMUP_CALLS

    positions = np.arange(prompt.shape[1])
    with cuda_runner.load(path, "cuda") as host, cuda_runner.load(path, "cuda", cuda_graph=True) as graphed:
        want = [host.run({"tokens": prompt, "input_pos": positions}, "prefill")["output_0"]]
        for step in range(steps):
            token = np.array([[int(want[-1].astype(np.float32).argmax())]], np.int64)
            want.append(host.run({"tokens": token, "input_pos": np.array([prompt.shape[1] + step], np.int64)}, "decode")["output_0"])
        graphed.run({"tokens": prompt, "input_pos": positions}, "prefill")
        method = graphed.method("decode")
        got = []
        with method.stream.as_cupy():  # the tokens are picked on the method's stream, in order with its runs
            steps_at = [cupy.asarray(np.array([prompt.shape[1] + step], np.int64)) for step in range(steps)]
            logits = cupy.asarray(want[0].view(np.uint16))  # bfloat16 travels as its bits
            for position in steps_at:
                as_float = (logits.reshape(-1).astype(cupy.uint32) << 16).view(cupy.float32)
                token = cupy.argmax(as_float).reshape(1, 1).astype(cupy.int64)
                logits = method.run_device({"tokens": token, "input_pos": position})["output_0"]
                got.append(logits)
        method.stream.synchronize()
        assert method._lanes.first.graphs >= 1 and steps > WARMUP_CALLS
        for step, (expected, logits) in enumerate(zip(want[1:], got)):
            assert np.array_equal(cupy.asnumpy(logits), expected.view(np.uint16)), step


def test_the_whisper_decoder_step_fuses_self_and_cross_attention_and_matches_eager(tmp_path):
    config = scale_models.WHISPER_TINY
    torch.manual_seed(1)
    module = scale_models.Whisper(config).eval()
    path = tmp_path / "whisper.bundle"
    cuda_runner.compile_methods(copy.deepcopy(module), scale_models.whisper_examples(config), path, device="cuda", options={OPTION: True})
    options = cuda_runner.read_manifest(path).methods["decode"].compile_options
    assert options["fused_decode_attention"] >= config.decoder_layers
    eager = copy.deepcopy(module).cuda()
    audio = scale_models.whisper_examples(config)["decode"][2].numpy()
    with cuda_runner.load(path, "cuda") as model:
        for position in range(6):
            inputs = [np.array([[position + 1]], np.int64), np.array([position], np.int64), audio]
            got = model.run(inputs, "decode")["output_0"]
            with torch.no_grad():
                want = eager.decode(*(torch.from_numpy(value).cuda() for value in inputs)).cpu().numpy()
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3)  # float32 GEMMs in Triton templates, sums reordered


def test_the_option_turns_it_on_and_off_through_the_cli(tmp_path):
    config = scale_models.LLAMA_TINY
    module = scale_models.LlamaDecoder(config, torch.float32).eval()

    class Decode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = module

        def forward(self, tokens, input_pos):
            return self.model.decode(tokens, input_pos)

    torch.export.save(torch.export.export(Decode(), scale_models.llama_examples(config, 4)["decode"]), tmp_path / "decode.pt2")
    for setting, expected in (("true", config.layers), ("false", None)):
        options = compile_with_option(tmp_path / "decode.pt2", tmp_path / f"{setting}.bundle", OPTION, setting)
        assert options.get("fused_decode_attention") == expected and options[OPTION] == (setting == "true")
        assert "fused_decode_attention_failed" not in options and options["standalone"] is True
        # with the fusion come combo kernels and the position in place of the mask; without it, neither
        assert options.get("combo_kernels") == (True if expected else None)
        assert options.get("fused_decode_attention_position_limits") == expected
    options = compile_with_option(tmp_path / "decode.pt2", tmp_path / "no-combo.bundle", "combo_kernels", "false")
    assert options["combo_kernels"] is False and options["fused_decode_attention"] == config.layers
    assert options["fused_cache_updates"] == config.layers
    options = compile_with_option(tmp_path / "decode.pt2", tmp_path / "no-update.bundle", UPDATE_OPTION, "false")
    assert options["fused_decode_attention"] == config.layers and "fused_cache_updates" not in options and "fused_rotations" not in options


def test_an_encoder_with_multi_head_attention_compiles_standalone_and_matches_eager(tmp_path):
    """ViT's nn.MultiheadAttention views SDPA's output in the layout export saw (compile/attention.py, pin_sdpa_layout):
    without the pin the standalone compile failed on a view and fell back to libtorch."""
    torch.manual_seed(2)
    module = scale_models.VisionTransformer(scale_models.VIT_TINY).eval().cuda()
    image = torch.randn(2, 3, 32, 32, device="cuda")
    path = tmp_path / "vit.bundle"
    cuda_runner.compile_methods(module, {"forward": (image,)}, path, device="cuda", runtime="standalone")
    with cuda_runner.load(path, "cuda") as model:
        got = model.run([image.cpu().numpy()])["output_0"]
    with torch.no_grad():
        np.testing.assert_allclose(got, module(image).cpu().numpy(), rtol=1e-3, atol=2e-3)  # float32 GEMMs in Triton templates, sums reordered


def test_a_hugging_face_llama_exported_with_its_static_cache_is_fused_whole_and_matches_eager(tmp_path):
    """What transformers itself exports for ExecuTorch (TorchExportableModuleWithStaticCache): its
    layers write the cache at a counter they copy the position into; its mask and its RoPE (halves,
    cos and sin computed each step) are proven, and the kernel writes and rotates. bfloat16."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    try:
        wrapped = hugging_face_static_llama("cuda", torch.bfloat16)
    except ImportError as error:
        pytest.skip(f"this transformers exports no static-cache module: {error}")
    example = {"input_ids": torch.tensor([[5]], device="cuda"), "cache_position": torch.tensor([0], device="cuda")}
    program = torch.export.export(copy.deepcopy(wrapped), (), example, strict=False)
    torch.export.save(program, tmp_path / "decode.pt2")
    path = tmp_path / "llama.bundle"
    cuda_runner.compile_programs({"forward": tmp_path / "decode.pt2"}, path, device="cuda")
    options = cuda_runner.read_manifest(path).methods["forward"].compile_options
    assert (options["fused_decode_attention"], options["fused_decode_attention_position_limits"]) == (2, 2)
    assert (options["fused_cache_updates"], options["fused_rotations"]) == (2, 4)
    errors = []
    with cuda_runner.load(path, "cuda") as bundle:
        for step in range(12):
            given = {"input_ids": np.array([[step * 37 % 1000]], np.int64), "cache_position": np.array([step], np.int64)}
            got = next(iter(bundle.run(given).values())).astype(np.float32)
            with torch.no_grad():
                want = wrapped(**{name: torch.from_numpy(value).cuda() for name, value in given.items()}).float().cpu().numpy()
            errors.append(float(np.abs(got - want).max()))
    print(f"Hugging Face Llama, static cache: worst logit error {max(errors):.3g} over 12 decode steps (bfloat16)")
    assert max(errors) < 5e-2
