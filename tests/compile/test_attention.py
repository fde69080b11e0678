"""The fused decode attention (compile/attention.py): which SDPA calls it takes
(exactly those the kernel computes as SDPA would), how grouped K/V repeated by
the model are read unrepeated, and the graph it leaves. The kernel itself runs
where Triton does: on the GPU (tests/gpu) and, here, under Triton's CPU
interpreter when Triton is installed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers import as_moved_to_a_gpu, run_under_triton_interpreter
from models import MethodOf, scale_models

from cuda_runner.compile import attention
from cuda_runner.compile.aot import check_options
from cuda_runner.compile.attention import MAX_QUERY_ROWS, OPTION, decode_attention_sites
from cuda_runner.errors import CompileError, InputError


def _graph(module: torch.nn.Module, args: tuple, dynamic_shapes=None):
    return torch.export.export(module, args, dynamic_shapes=dynamic_shapes).module().graph


def _llama_graph(method: str):
    config = scale_models.LLAMA_TINY
    model = scale_models.LlamaDecoder(config, torch.float32).eval()
    shapes = scale_models.llama_dynamic_shapes(config)[method]
    return _graph(MethodOf(model, method), scale_models.llama_examples(config, 6)[method], shapes), config


class _Attention(torch.nn.Module):
    """One SDPA call, its keys and values repeated per query head the way `repeat` names."""

    def __init__(self, repeat: str = "none", **sdpa):
        super().__init__()
        self.repeat, self.sdpa = repeat, sdpa

    def forward(self, q, k, v, mask=None):
        group = q.shape[1] // k.shape[1]
        if self.repeat == "interleave":
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        elif self.repeat == "expand":  # Hugging Face's repeat_kv
            b, h, s, d = k.shape
            k = k[:, :, None, :, :].expand(b, h, group, s, d).reshape(b, h * group, s, d)
            v = v[:, :, None, :, :].expand(b, h, group, s, d).reshape(b, h * group, s, d)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.sdpa)


def _inputs(rows=1, heads=8, kv_heads=2, length=32, dim=16, dtype=torch.float32):
    return (torch.randn(1, heads, rows, dim, dtype=dtype), torch.randn(1, kv_heads, length, dim, dtype=dtype),
            torch.randn(1, kv_heads, length, dim, dtype=dtype))


def test_the_decode_step_of_the_llama_decoder_is_fused_once_a_layer_reading_its_cache_unrepeated():
    graph, config = _llama_graph("decode")
    sites = decode_attention_sites(graph)
    assert len(sites) == config.layers
    for site in sites:
        assert site.group == config.heads // config.kv_heads
        # the cache itself, as its index_copy_ left it, not a repeated copy
        assert str(site.key.target) == str(site.value.target) == "aten.index_copy_.default"
        assert [str(node.target) for node in site.repeats] == ["aten.repeat_interleave.self_int"] * 2
        assert site.scale == pytest.approx(config.head_dim ** -0.5)


def test_a_prompt_of_dynamic_length_is_left_to_sdpa():
    graph, _ = _llama_graph("prefill")
    assert decode_attention_sites(graph) == []


@pytest.mark.parametrize("repeat", ["interleave", "expand"])
def test_keys_and_values_repeated_per_head_by_the_model_are_read_unrepeated(repeat):
    q, k, v = _inputs()
    (site,) = decode_attention_sites(_graph(_Attention(repeat), (q, k, v)))
    assert site.group == 4 and site.key.op == "placeholder" and site.value.op == "placeholder"


class _WrittenAfterRepeat(torch.nn.Module):
    """A cache repeated per head, then written in place, then attended: the repeat holds the old values."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.randn(1, 2, 32, 16))
        self.register_buffer("v", torch.randn(1, 2, 32, 16))

    def forward(self, q, new_k):
        keys, values = self.k.repeat_interleave(4, 1), self.v.repeat_interleave(4, 1)
        self.k.add_(new_k)
        return F.scaled_dot_product_attention(q, keys, values)


def test_a_repeat_taken_before_its_source_is_written_is_kept():
    q, k, _ = _inputs()
    (site,) = decode_attention_sites(_graph(_WrittenAfterRepeat(), (q, k)))
    assert site.repeats == () and site.group == 1 and str(site.key.target) == "aten.repeat_interleave.self_int"


def test_one_repeat_serving_as_keys_and_values_is_dropped_once():
    class Shared(torch.nn.Module):
        def forward(self, q, k):
            repeated = k.repeat_interleave(4, 1)
            return F.scaled_dot_product_attention(q, repeated, repeated)

    q, k, _ = _inputs()
    (site,) = decode_attention_sites(_graph(Shared(), (q, k)))
    assert len(site.repeats) == 1 and site.group == 4


def test_sdpas_own_grouped_query_attention_is_fused_with_its_group():
    q, k, v = _inputs()
    (site,) = decode_attention_sites(_graph(_Attention(enable_gqa=True, scale=0.5), (q, k, v)))
    assert site.group == 4 and site.scale == 0.5 and site.repeats == ()


@pytest.mark.parametrize("mask", [torch.ones(1, 32, dtype=torch.bool), torch.zeros(1, 1, 1, 32), torch.zeros(1, 8, 1, 32)],
                         ids=["bool-row", "additive-broadcast", "additive-per-head"])
def test_masks_that_broadcast_are_fused(mask):
    q, k, v = _inputs(kv_heads=8)
    assert len(decode_attention_sites(_graph(_Attention(), (q, k, v, mask)))) == 1


@pytest.mark.parametrize(("case", "module", "inputs"), [
    ("causal", _Attention(is_causal=True), _inputs(kv_heads=8)),
    ("dropout", _Attention(dropout_p=0.1), _inputs(kv_heads=8)),
    ("many query rows", _Attention(), _inputs(rows=MAX_QUERY_ROWS + 1, kv_heads=8)),
    ("float64", _Attention(), _inputs(kv_heads=8, dtype=torch.float64)),
])
def test_calls_the_kernel_would_not_compute_as_sdpa_are_left_alone(case, module, inputs):
    assert decode_attention_sites(_graph(module, inputs)) == [], case


def test_the_option_that_turns_it_off_is_cuda_runners_own_and_takes_a_bool():
    assert check_options(torch, {OPTION: False}) == {OPTION: False}
    with pytest.raises(InputError, match="true or false"):
        check_options(torch, {OPTION: "no"})


@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
def test_the_fused_graph_computes_what_sdpa_does_under_tritons_interpreter(tmp_path):
    """The rewritten graph run eagerly: the kernel through Triton's CPU interpreter."""
    script = textwrap.dedent("""
        import copy, torch
        from models import MethodOf, scale_models
        from cuda_runner.compile.attention import fuse_decode_attention
        config = scale_models.LLAMA_TINY
        model = scale_models.LlamaDecoder(config, torch.float32).eval()
        examples = scale_models.llama_examples(config, 6)
        with torch.no_grad():
            model.prefill(*examples["prefill"])  # a cache with something in it
        class Decode(torch.nn.Module):
            def __init__(self, model): super().__init__(); self.model = model
            def forward(self, tokens, position): return self.model.decode(tokens, position)
        fused = torch.export.export(Decode(copy.deepcopy(model)), examples["decode"]).module()
        plain = torch.export.export(Decode(copy.deepcopy(model)), examples["decode"]).module()
        assert fuse_decode_attention(fused).calls == config.layers
        assert not any("repeat_interleave" in str(node.target) for node in fused.graph.nodes)
        with torch.no_grad():
            error = (fused(*examples["decode"]) - plain(*examples["decode"])).abs().max().item()
        assert error < 1e-4, error
        print("ok", error)
    """)
    result = run_under_triton_interpreter(script)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_sdpa_outputs_keep_the_layout_export_saw_and_their_values():
    from cuda_runner.compile.attention import pin_sdpa_layout

    module = scale_models.VisionTransformer(scale_models.VIT_TINY).eval()
    image = torch.randn(2, 3, 32, 32)
    graph_module = torch.export.export(module, (image,)).module()
    with torch.no_grad():
        before = graph_module(image)
        assert pin_sdpa_layout(graph_module) == scale_models.VIT_TINY.layers
        torch.testing.assert_close(graph_module(image), before)
    assert sum(str(node.target) == "aten.clone.default" for node in graph_module.graph.nodes) >= scale_models.VIT_TINY.layers


def test_a_fused_attention_that_does_not_compile_costs_the_fusion_not_the_build(monkeypatch):
    """What happened on the H200 before the kernel's scale was cast: Inductor's build of the kernel failed."""
    from types import SimpleNamespace

    from cuda_runner.compile import aot, attention

    compiled: list[int] = []

    def aot_compile(module, args, kwargs, options):
        compiled.append(module.fused)
        if module.fused:
            raise RuntimeError("Failed to run autotuning code block: at 22:4:\n    for start in range(0, kv_length, BLOCK_N):")
        return "/nowhere/model.so"

    fake_torch = SimpleNamespace(_inductor=SimpleNamespace(aot_compile=aot_compile))
    monkeypatch.setattr(attention, "fuse_decode_attention", lambda module, written_elsewhere, update_caches: setattr(module, "fused", 2) or attention.Fused(2))
    monkeypatch.setattr(attention, "pin_sdpa_layout", lambda module: 0)
    program = SimpleNamespace(module=lambda: SimpleNamespace(fused=0))
    heard: list[str] = []
    kernels = aot.OwnKernels(attention=True, matvec=False)
    path = aot._aot_compile(fake_torch, program, (), {}, {}, False, "cuda", kernels, heard.append)
    # combo kernels, which came with it, are tried without first; the fusion goes when the build fails without them too
    assert compiled == [2, 2, 0] and kernels.fused == 0 and str(path) == "/nowhere/model.so"
    assert kernels.record() == {"fused_decode_attention_failed": "RuntimeError: Failed to run autotuning code block: at 22:4:"}
    assert any("compiling without it" in line for line in heard)
    with pytest.raises(CompileError, match="AOTInductor compile failed: RuntimeError"):  # without the fusion, a failure is the compile's
        aot._aot_compile(fake_torch, SimpleNamespace(module=lambda: SimpleNamespace(fused=1)), (), {}, {}, False, "cuda",
                         aot.OwnKernels(attention=False, matvec=False), heard.append)


@pytest.mark.triton
@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
@pytest.mark.parametrize("scale_type", ["fp64", "constexpr"])
def test_the_kernel_builds_for_sm90_as_inductor_passes_its_scale(scale_type):
    """Inductor passes the scale as fp64 to the kernel it builds and as a specialised Python
    float to its analysis of what the kernel writes; on the H200 the first broke the softmax's
    loop-carried types and the second a .to() on the scale. Triton compiles for sm90 without a GPU."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cuda_runner.compile.attention_kernel import _decode_attention_kernel, _merge_splits_kernel

    pointers = {"query": "*bf16", "key": "*bf16", "value": "*bf16", "out": "*bf16", "mask": "*i1",
                "part_max": "*fp32", "part_sum": "*fp32", "part_acc": "*fp32"}
    shapes = {"HEADS": 32, "ROWS": 1, "HEAD_DIM": 64, "VALUE_DIM": 64, "BLOCK_N": 32, "BLOCK_D": 64, "BLOCK_DV": 64, "MASK_KIND": 1,
              "BLOCK_S": 16, "UPDATE": False, "QUERY_PAIRS": 0, "KEY_PAIRS": 0, "EARLY": False}
    for kernel, splits in ((_decode_attention_kernel, 1), (_decode_attention_kernel, 16), (_merge_splits_kernel, 16)):
        parameters = list(inspect.signature(kernel.fn).parameters)
        signature = {name: pointers.get(name, scale_type if name == "scale" else "constexpr" if name.isupper() else "i32") for name in parameters}
        constants = {name: value for name, value in {**shapes, "SPLITS": splits}.items() if name in parameters}
        if scale_type == "constexpr" and "scale" in parameters:
            constants["scale"] = 0.125
        source = ASTSource(fn=kernel, signature=signature, constexprs={(parameters.index(name),): value for name, value in constants.items()})
        triton.compile(source, target=GPUTarget("cuda", 90, 32))


@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
def test_the_kernel_split_over_the_keys_computes_what_sdpa_does_under_tritons_interpreter():
    """Shapes whose keys are shared out among programs (16 stretches of 32 keys, their merge),
    whose first stretches are wholly masked, and a row with every key masked (zeros, as SDPA)."""
    script = textwrap.dedent("""
        import itertools, torch
        from cuda_runner.compile.attention_kernel import decode_attention, split_plan
        assert split_plan(4, 512, 512)[1] == 16 and split_plan(4096, 300, 128)[1] == 1
        torch.manual_seed(0)
        worst = 0.0
        for (B, H, G, L, S, D), kind in itertools.product([(1, 4, 2, 1, 512, 16), (2, 2, 1, 3, 100, 8), (1, 2, 2, 1, 7, 16)],
                                                         ["none", "bool", "additive", "late"]):
            q, k, v = torch.randn(B, H, L, D), torch.randn(B, H // G, S, D), torch.randn(B, H // G, S, 2 * D)
            mask = {"none": None, "bool": torch.rand(B, 1, L, S) > 0.3, "additive": torch.randn(1, 1, L, S)}.get(kind)
            if kind == "late":  # only the last keys allowed; with several rows, none for the first
                mask = torch.zeros(B, 1, L, S, dtype=torch.bool)
                mask[..., -3:] = True
                mask[:, :, 0, :] = L == 1
            out = decode_attention(q, k, v, mask, D ** -0.5, G)
            expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask)
            worst = max(worst, (out - torch.nan_to_num(expected, nan=0.0)).abs().max().item())
        assert worst < 1e-5, worst
        print("ok", worst)
    """)
    result = run_under_triton_interpreter(script)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_a_fusion_that_fails_before_the_compile_costs_the_fusion_not_the_build(monkeypatch):
    """A Triton that imports but cannot register the kernel, say: the method is compiled without it."""
    from types import SimpleNamespace

    from cuda_runner.compile import aot, attention

    def broken_fusion(module, written_elsewhere, update_caches):
        raise RuntimeError("triton_op: cannot register cuda_runner::decode_attention")

    monkeypatch.setattr(attention, "fuse_decode_attention", broken_fusion)
    fake_torch = SimpleNamespace(_inductor=SimpleNamespace(aot_compile=lambda module, args, kwargs, options: "/nowhere/model.so"))
    kernels = aot.OwnKernels(attention=True, matvec=False)
    path = aot._aot_compile(fake_torch, SimpleNamespace(module=object), (), {}, {}, False, "cuda", kernels, lambda _: None)
    assert str(path) == "/nowhere/model.so" and kernels.fused == 0
    assert kernels.failures == {"attention": "RuntimeError: triton_op: cannot register cuda_runner::decode_attention"}


def test_the_fusion_is_told_what_the_bundles_other_methods_write(monkeypatch):
    """What compile_sources found (a mask buffer a prefill fills) reaches the proof of each mask."""
    from types import SimpleNamespace

    from cuda_runner.compile import aot, attention

    told: list[frozenset[str]] = []
    monkeypatch.setattr(attention, "fuse_decode_attention", lambda module, written_elsewhere, update_caches: told.append(written_elsewhere) or attention.Fused())
    fake_torch = SimpleNamespace(_inductor=SimpleNamespace(aot_compile=lambda module, args, kwargs, options: "/nowhere/model.so"))
    kernels = aot.OwnKernels(attention=True, matvec=False, written_elsewhere=frozenset({"valid"}))
    aot._aot_compile(fake_torch, SimpleNamespace(module=object), (), {}, {}, False, "cuda", kernels, lambda _: None)
    assert told == [{"valid"}]


@pytest.mark.triton
@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
def test_the_decoders_cache_is_split_among_programs_and_merged_and_few_keys_are_not():
    from cuda_runner.compile.attention_kernel import AttentionPlan, attention_plan

    assert attention_plan(32, 512, 64, 64) == AttentionPlan(32, 16, 32, 2)  # the 1B decoder's call
    assert attention_plan(12, 5, 32, 16).splits == 1
    large = attention_plan(4, 4096, 128, 128)
    assert large.splits > 1 and large.split_keys * large.splits >= 4096
    assert attention_plan(4, 300, 16, 256).splits > 1  # the values' width counts


@pytest.mark.triton
@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
@pytest.mark.parametrize("mask_kind, splits, pairs, early, early_position, go_ahead", [
    (0, 16, None, False, False, False), (1, 16, None, False, False, False), (2, 1, None, False, False, False),
    (3, 16, None, False, False, False), (3, 1, None, False, False, False), (3, 16, 1, True, False, False), (2, 1, 2, True, False, False),
    (3, 16, 0, True, False, False), (3, 16, 1, False, False, False), (3, 16, 1, True, True, False), (3, 1, 2, False, True, False),
    (2, 16, 1, True, True, False), (0, 16, 0, False, True, False),
    (3, 16, 1, True, True, True), (3, 1, 2, False, True, True), (0, 16, None, False, False, True),
])
def test_the_programmatic_attention_kernels_touch_memory_only_after_their_wait(mask_kind, splits, pairs, early, early_position, go_ahead):
    """Built for sm90 on the CPU: on every path through the PTX of the
    attention kernel and of the merge, no load and no store comes before
    griddepcontrol.wait (the launch before may still be writing what they
    read, or reading what they write), but for the first tiles of the caches
    an updating kernel reads early (it is the one launch of the step that
    writes them) and, where asked, its position, limit and tables' rows
    (graph inputs and constants no launch of the step writes). The launch
    after may start (griddepcontrol.launch_dependents) after the wait, or,
    with GO_AHEAD_FIRST, before it."""
    import inspect

    import triton
    from helpers import parameters_read_before_wait, ptx_blocks, waited_on_entry
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cuda_runner.compile.attention_kernel import cudarunner_pdl_decode_attention, cudarunner_pdl_merge_splits

    mask_type = {0: "*bf16", 1: "*i1", 2: "*bf16", 3: "*i64"}[mask_kind]
    # pairs None: no cache update; else the update, with the query and key rotated so (0: not at all)
    update = {"UPDATE": pairs is not None, "QUERY_PAIRS": pairs or 0, "KEY_PAIRS": pairs or 0, "EARLY": pairs is not None and early,
              "EARLY_POSITION": pairs is not None and early_position}
    update_pointers = {"new_key": "*bf16", "new_value": "*bf16", "position": "*i64", "query_cos": "*fp32", "query_sin": "*fp32",
                       "key_cos": "*fp32", "key_sin": "*fp32"} if pairs is not None else {}
    builds = [
        (cudarunner_pdl_decode_attention, dict(HEADS=32, ROWS=1, HEAD_DIM=64, VALUE_DIM=64, BLOCK_N=32, BLOCK_D=64, BLOCK_DV=64,
                                               MASK_KIND=mask_kind, SPLITS=splits, GO_AHEAD_FIRST=go_ahead, **update),
         {"mask": mask_type, "part_max": "*fp32", "part_sum": "*fp32", "part_acc": "*fp32", "scale": "fp32", **update_pointers}),
        (cudarunner_pdl_merge_splits, dict(HEADS=32, ROWS=1, VALUE_DIM=64, BLOCK_DV=64, SPLITS=16, BLOCK_S=16, GO_AHEAD_FIRST=go_ahead),
         {"part_max": "*fp32", "part_sum": "*fp32", "part_acc": "*fp32"}),
    ]
    for kernel, constants, pointers in builds:
        parameters = list(inspect.signature(kernel.fn).parameters)
        tensors = {"query": "*bf16", "key": "*bf16", "value": "*bf16", "out": "*bf16", **pointers}
        types = {name: "constexpr" if name in constants else tensors.get(name, "i32") for name in parameters}
        source = ASTSource(fn=kernel, signature=types, constexprs={(parameters.index(name),): value for name, value in constants.items()})
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        blocks = ptx_blocks(ptx)
        waited = waited_on_entry(blocks)
        early_tiles, early_inputs = constants.get("EARLY", False), constants.get("EARLY_POSITION", False)
        read_early, early_loads = parameters_read_before_wait(ptx)
        passed = [name for name in parameters if types[name] != "constexpr"]  # the PTX's parameters, in order
        pointers_read = {passed[index] for index in read_early if index < len(passed) and types[passed[index]].startswith("*")}
        expected = {"key", "value"} if early_tiles else set()
        if early_inputs:
            expected |= {"position"} | ({"mask"} if mask_kind == 3 else set()) | ({"query_cos", "query_sin", "key_cos", "key_sin"} if pairs else set())
        assert pointers_read == expected, kernel.fn.__name__
        early = early_tiles or early_inputs
        touched = 0
        for label, (ops, _) in blocks.items():
            done = waited[label]
            for op in ops:
                if op == "griddepcontrol.wait":
                    done = True
                elif op.startswith(("ld.global", "st.global")):
                    touched += 1
                    # The early tiles are the entry block's loads before its wait, and nothing else is.
                    assert done or (early and label == "entry" and op.startswith("ld.global") and early_loads), (kernel.fn.__name__, label, op)
                    early_loads -= 0 if done else 1
        assert touched and ptx.count("griddepcontrol.launch_dependents;") == 1 and early_loads == 0
        go_ahead_first = ptx.index("griddepcontrol.launch_dependents;") < ptx.index("griddepcontrol.wait;")
        assert go_ahead_first == go_ahead, kernel.fn.__name__


@pytest.mark.triton
@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
def test_the_decoders_masks_become_its_position_and_are_no_longer_computed():
    from cuda_runner.compile.attention import fuse_decode_attention

    config = scale_models.LLAMA_TINY
    model = scale_models.LlamaDecoder(config, torch.float32).eval()
    module = torch.export.export(MethodOf(model, "decode"), scale_models.llama_examples(config, 6)["decode"]).module()
    assert fuse_decode_attention(module, update_caches=False) == attention.Fused(calls=config.layers, position_limits=config.layers,
                                                                              positions=(("input_pos", config.max_seq),))
    fused = [node for node in module.graph.nodes if str(node.target) == "cuda_runner.decode_attention.default"]
    assert [(node.args[3], node.args[6].name) for node in fused] == [(None, "input_pos")] * config.layers
    assert not any(str(node.target) in ("aten.le.Tensor", "aten.arange.default") for node in module.graph.nodes)


@pytest.mark.triton
@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
def test_one_mask_shared_by_caches_of_two_lengths_is_proven_for_each():
    """(p >= 0) keeps every position of a cache of one, not of a cache of 24."""
    from cuda_runner.compile.attention import fuse_decode_attention

    class Two(torch.nn.Module):
        def forward(self, q, short_k, short_v, long_k, long_v, input_pos):
            mask = (input_pos >= 0).view(1, 1, 1, 1)
            return (F.scaled_dot_product_attention(q, short_k, short_v, attn_mask=mask),
                    F.scaled_dot_product_attention(q, long_k, long_v, attn_mask=mask))

    q = torch.randn(1, 4, 1, 8)
    args = (q, torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 24, 8), torch.randn(1, 4, 24, 8), torch.tensor([5]))
    module = torch.export.export(Two(), args).module()
    assert fuse_decode_attention(module) == attention.Fused(calls=2, position_limits=1, positions=(("input_pos", 1),))
    fused = [node for node in module.graph.nodes if str(node.target) == "cuda_runner.decode_attention.default"]
    assert [(node.args[3] is None, node.args[6] is not None) for node in fused] == [(True, True), (False, False)]


def test_every_access_of_the_attention_kernels_is_addressed_through_the_wait():
    """Read from the source, where the design puts the guarantee (the PTX test sees only where the
    compiler happened to put the wait): each tl.load and tl.store address is computed from `ready`,
    but in the block an updating kernel runs before its wait where its position is unwritten, which
    reads only at the position, the limit (`mask`) and the tables' rows, each offset from its own
    pointer (the query plus the position would mention the position too)."""
    import ast
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / "cuda_runner" / "compile" / "attention_kernel.py").read_text()
    bodies = {node.name: node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
    early_blocks = [node for node in bodies["_decode_attention"].body if isinstance(node, ast.If) and ast.unparse(node.test) == "EARLY_POSITION"]
    assert len(early_blocks) == 1
    early = {id(node) for node in ast.walk(early_blocks[0])}

    def base(pointer):  # the pointer an address is offset from: `mask` in mask + batch * m_b + ...
        while isinstance(pointer, ast.BinOp) and isinstance(pointer.op, ast.Add):
            pointer = pointer.left
        return pointer.id if isinstance(pointer, ast.Name) else ast.unparse(pointer)

    early_reads = []
    for call in (node for node in ast.walk(early_blocks[0]) if isinstance(node, ast.Call)):
        if ast.unparse(call.func) == "tl.load":
            early_reads.append(base(call.args[0]))
        elif ast.unparse(call.func) == "_rotation_row":
            early_reads.extend(base(pointer) for pointer in call.args[:2])
    assert sorted(early_reads) == ["key_cos", "key_sin", "mask", "position", "query_cos", "query_sin"], early_reads
    for name, given in (("_decode_attention", {"ready"}), ("_merge_splits", {"ready"}),
                        # called by _decode_attention with its pointers derived from ready (checked below with its own loads)
                        ("_load_rotated", {"base"}), ("_rotation_row", {"cos_table", "sin_table"})):
        derived = set(given)
        assignments = [node for node in ast.walk(bodies[name]) if isinstance(node, ast.Assign)]
        changed = True
        while changed:  # names computed from ready, however indirectly
            changed = False
            for assignment in assignments:
                used = {node.id for node in ast.walk(assignment.value) if isinstance(node, ast.Name)}
                for target in assignment.targets:
                    if isinstance(target, ast.Name) and used & derived and target.id not in derived:
                        derived.add(target.id)
                        changed = True
        calls = [node for node in ast.walk(bodies[name]) if isinstance(node, ast.Call) and id(node) not in early]
        accesses = [node for node in calls if ast.unparse(node.func) in ("tl.load", "tl.store")]
        assert accesses
        for access in accesses:
            names = {node.id for node in ast.walk(access.args[0]) if isinstance(node, ast.Name)}
            assert names & derived, f"{name}: {ast.unparse(access)}"
        rotations = [node for node in calls if ast.unparse(node.func) == "_load_rotated"]
        for call in rotations:  # the pointer the helper reads through
            assert {node.id for node in ast.walk(call.args[0]) if isinstance(node, ast.Name)} & derived, f"{name}: {ast.unparse(call)}"
        rows = [node for node in calls if ast.unparse(node.func) == "_rotation_row"]
        for call in rows:  # the tables it reads a row of
            for pointer in call.args[:2]:
                assert {node.id for node in ast.walk(pointer) if isinstance(node, ast.Name)} & derived, f"{name}: {ast.unparse(call)}"
        assert name != "_decode_attention" or (len(rotations) == 2 and len(rows) == 2)


def _fused_update_calls(module):
    return [node for node in module.graph.nodes if str(node.target) == "cuda_runner.decode_attention_update.default"]


@pytest.mark.triton
@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
def test_the_decoders_cache_writes_and_rotations_move_into_the_fused_call():
    """Each layer's index_copy_ pair and the RoPE ops on q and k go: the kernel writes and rotates,
    from one pair of tables the layers share, added to the module as buffers."""
    from cuda_runner.compile.attention import TABLE_PREFIX, fuse_decode_attention

    config = scale_models.LLAMA_TINY
    model = scale_models.LlamaDecoder(config, torch.float32).eval()
    module = torch.export.export(MethodOf(model, "decode"), scale_models.llama_examples(config, 6)["decode"]).module()
    fused = fuse_decode_attention(module)
    assert (fused.calls, fused.position_limits, fused.cache_updates, fused.rotations) == (config.layers, config.layers, config.layers, 2 * config.layers)
    assert [name for name, _ in fused.tables] == [f"{TABLE_PREFIX}0", f"{TABLE_PREFIX}1"]
    assert all(torch.equal(getattr(module, name), table) for name, table in fused.tables)
    targets = [str(node.target) for node in module.graph.nodes]
    assert "aten.index_copy_.default" not in targets and "aten.stack.default" not in targets and "aten.index.Tensor" not in targets
    for call in _fused_update_calls(module):
        query, key, _, key_cache, value_cache, position = call.args[:6]
        assert (query.target, key.target) == (torch.ops.aten.transpose.int, torch.ops.aten.transpose.int)  # the projections, unrotated
        assert key_cache.target.endswith("k_cache") and value_cache.target.endswith("v_cache") and position.name == "input_pos"
        # both rotated in neighbouring pairs; the position a graph input nothing writes; the projections launched first
        assert call.args[-4:] == (1, 1, True, True)


class _CachedStep(torch.nn.Module):
    """A decode step over caches held as buffers, with what may keep its writes the graph's own."""

    def __init__(self, rows=1, also="nothing"):
        super().__init__()
        self.rows, self.also = rows, also
        self.register_buffer("k_cache", torch.zeros(1, 2, 16, 8))
        self.register_buffer("v_cache", torch.zeros(1, 2, 16, 8))

    def forward(self, q, k, v, position):
        self.k_cache.index_copy_(2, position, k)
        if self.also == "a write between":
            q = q.clone().mul_(2.0)
        self.v_cache.index_copy_(2, position, v)
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, enable_gqa=True)
        if self.also == "the cache read again":
            return out, self.k_cache.sum()
        if self.also == "the position advanced after":
            position.add_(1)
        return out


@pytest.mark.parametrize("rows, also, updated", [(1, "nothing", 1), (2, "nothing", 0), (1, "the cache read again", 0), (1, "a write between", 0)])
def test_cache_writes_the_kernel_would_make_out_of_order_stay_the_graphs(rows, also, updated):
    pytest.importorskip("triton")
    from cuda_runner.compile.attention import fuse_decode_attention

    args = (torch.randn(1, 4, rows, 8), torch.randn(1, 2, rows, 8), torch.randn(1, 2, rows, 8), torch.arange(rows) + 3)
    module = torch.export.export(_CachedStep(rows, also), args).module()
    fused = fuse_decode_attention(module)
    assert (fused.calls, fused.cache_updates, fused.rotations) == (1, updated, 0)
    assert (sum(str(node.target) == "aten.index_copy_.default" for node in module.graph.nodes) == 0) is bool(updated)


class _ProjectedStep(_CachedStep):
    """_CachedStep with its query a product of its input: the attention is not the step's first launch."""

    def __init__(self, also="nothing"):
        super().__init__(1, also)
        self.project = torch.nn.Linear(8, 8, bias=False)

    def forward(self, q, k, v, position):
        return super().forward(self.project(q), k, v, position)


class _ShapeOfAProductStep(_ProjectedStep):
    """Its query the input plus zeros shaped like a product: no kernel need compute the product."""

    def forward(self, q, k, v, position):
        return _CachedStep.forward(self, q + torch.zeros_like(self.project(q)), k, v, position)


@pytest.mark.parametrize("step", ["projected", "inputs alone", "the shape of a product"])
def test_the_kernel_reads_early_only_after_a_launch_of_the_step_and_a_position_nothing_writes(step):
    """What the kernel reads before it waits for the launch ahead of it (attention_kernel.EARLY_CACHE_TILES,
    EARLY_POSITION): nothing where it would be the step's first launch (its query, key and value the
    step's inputs), whose predecessor is the caller's last kernel, which may write the position or
    the last call's cache rows; its position only where no launch of the step writes it, a position
    advanced in place being such."""
    pytest.importorskip("triton")
    from cuda_runner.compile.attention import fuse_decode_attention

    args = (torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([3]))
    flags = {}
    for also in ("nothing", "the position advanced after"):
        model = {"projected": _ProjectedStep, "the shape of a product": _ShapeOfAProductStep}.get(step, lambda also: _CachedStep(1, also))(also)
        module = torch.export.export(model, tuple(arg.clone() for arg in args)).module()
        assert fuse_decode_attention(module).cache_updates == 1
        (call,) = _fused_update_calls(module)
        flags[also] = call.args[-2:]  # (inputs_unwritten, after_a_launch)
    after_a_launch = step == "projected"
    assert flags == {"nothing": (True, after_a_launch), "the position advanced after": (False, after_a_launch)}


@pytest.mark.triton
@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
def test_the_fused_step_writes_and_reads_its_caches_as_the_graph_did_under_tritons_interpreter():
    """Step after step from a prefilled cache: the tiny decoder (neighbour pairs, float32 tables)
    and Hugging Face's form (halves, cos and sin computed each step, no mask), float32 and
    bfloat16: the logits, and the caches the kernel wrote, against the graph as exported."""
    script = textwrap.dedent("""
        import copy, torch
        from models import MethodOf, scale_models
        from compile.test_rotary import HalvesAttention
        from cuda_runner.compile.attention import fuse_decode_attention
        config = scale_models.LLAMA_TINY
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            model = scale_models.LlamaDecoder(config, dtype).eval()
            examples = scale_models.llama_examples(config, 6)
            with torch.no_grad():
                model.prefill(*examples["prefill"])
            halves = HalvesAttention().to(dtype).eval()
            x = torch.randn(1, 1, 32, dtype=dtype)
            cases = [(MethodOf(model, "decode"), examples["decode"], lambda step: (torch.tensor([[step * 7 % config.vocab]]), torch.tensor([step])),
                      range(6, 14)),
                     (halves, (x, torch.tensor([0])), lambda step: (torch.randn(1, 1, 32, dtype=dtype), torch.tensor([step])), range(0, 9))]
            for module, example, inputs, steps in cases:
                fused = torch.export.export(copy.deepcopy(module), example).module()
                plain = torch.export.export(copy.deepcopy(module), example).module()
                result = fuse_decode_attention(fused)
                assert result.cache_updates == result.calls and result.rotations == 2 * result.calls, result
                with torch.no_grad():
                    for step in steps:
                        given = inputs(step)
                        got, want = fused(*given), plain(*given)
                        assert (got.float() - want.float()).abs().max().item() <= tolerance, (dtype, step)
                wanted = dict(plain.named_buffers())
                caches = [(name, held) for name, held in fused.named_buffers() if name.endswith("cache")]
                assert len(caches) >= 2
                for name, held in caches:
                    assert (held.float() - wanted[name].float()).abs().max().item() <= tolerance, name
        print("ok")
    """)
    result = run_under_triton_interpreter(script)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


@pytest.mark.triton
@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
def test_the_updating_kernel_split_over_the_keys_writes_once_and_reads_what_it_wrote_under_tritons_interpreter():
    """The operator itself against index_copy_ and SDPA: a cache split among 16 programs a row,
    grouped heads, each pairing and none, the step's position at the edges of the stretches,
    the mask as the position or as a bool tensor, and a position past the cache (nothing written)."""
    script = textwrap.dedent("""
        import itertools, torch
        from cuda_runner.compile.attention_kernel import decode_attention_update, split_plan
        torch.manual_seed(0)
        S, D, H, G = 512, 16, 4, 2
        assert split_plan(H, S, 512)[1] == 16
        angles = torch.rand(S, D // 2) * 6.0
        cos, sin = angles.cos(), angles.sin()
        tables = {1: (cos.repeat_interleave(2, 1), torch.stack((-sin, sin), -1).flatten(1)),
                  2: (torch.cat((cos, cos), 1), torch.cat((-sin, sin), 1))}
        def rotate(x, pairs, step):
            if not pairs:
                return x
            c, s = (table[step] for table in tables[pairs])
            partner = torch.arange(D) ^ 1 if pairs == 1 else (torch.arange(D) + D // 2) % D
            return x * c + x[..., partner] * s
        for pairs, step, masked in itertools.product((0, 1, 2), (0, 31, 32, 511, 600), ("limit", "bool")):
            key_cache, value_cache = torch.randn(1, H // G, S, D), torch.randn(1, H // G, S, D)
            q, k, v = torch.randn(1, H, 1, D), torch.randn(1, H // G, 1, D), torch.randn(1, H // G, 1, D)
            position = torch.tensor([step])
            allowed = torch.arange(S) <= step
            mask = None if masked == "limit" else allowed.view(1, 1, 1, S)
            limit = position if masked == "limit" else None
            table = tables.get(pairs, (None, None))
            want_keys, want_values = key_cache.clone(), value_cache.clone()
            if step < S:
                want_keys.index_copy_(2, position, rotate(k, pairs, step))
                want_values.index_copy_(2, position, v)
            want = torch.nn.functional.scaled_dot_product_attention(rotate(q, pairs, min(step, S - 1)), want_keys.repeat_interleave(G, 1),
                                                                    want_values.repeat_interleave(G, 1), attn_mask=allowed.view(1, 1, 1, S), scale=0.3)
            # after a launch of the step: the caches' first tiles read before the wait (EARLY_CACHE_TILES)
            got = decode_attention_update(q, k, v, key_cache, value_cache, position, mask, 0.3, G, limit, *table, *table, pairs, pairs, False, True)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(key_cache, want_keys, atol=1e-6, rtol=1e-6)
            assert torch.equal(value_cache, want_values)
        # Stretches of several tiles (the first read before the wait, the rest in the loop), and a cache
        # whose positions past the step hold inf and NaN: masked, they must not reach the result.
        import cuda_runner.compile.attention_kernel as kernels
        from cuda_runner.compile.attention_kernel import AttentionPlan, CacheUpdate, launch_attention
        for plan, step, early in itertools.product([(128, 4, 32, 2), (512, 1, 64, 4), (96, 6, 64, 2)], (0, 31, 32, 127, 128, 300, 511),
                                                   (True, False)):
            kernels.EARLY_CACHE_TILES = early
            key_cache, value_cache = torch.randn(1, H // G, S, D), torch.randn(1, H // G, S, D)
            q, k, v = torch.randn(1, H, 1, D), torch.randn(1, H // G, 1, D), torch.randn(1, H // G, 1, D)
            position = torch.tensor([step])
            want_keys, want_values = key_cache.clone(), value_cache.clone()
            want_keys.index_copy_(2, position, rotate(k, 1, step))
            want_values.index_copy_(2, position, v)
            allowed = torch.arange(S) <= step
            want = torch.nn.functional.scaled_dot_product_attention(rotate(q, 1, step), want_keys.repeat_interleave(G, 1),
                                                                    want_values.repeat_interleave(G, 1), attn_mask=allowed.view(1, 1, 1, S), scale=0.3)
            key_cache[:, :, step + 1:] = float("inf")
            value_cache[:, :, step + 1:] = float("nan")
            out = torch.empty(1, H, 1, D)
            update = CacheUpdate(k, v, position, (*tables[1], 1), (*tables[1], 1), after_a_launch=True)
            launch_attention(q, key_cache, value_cache, None, position, out, 0.3, G, AttentionPlan(*plan), update=update)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(key_cache[:, :, :step + 1], want_keys[:, :, :step + 1], atol=1e-6, rtol=1e-6)
            assert torch.equal(value_cache[:, :, :step + 1], want_values[:, :, :step + 1])
        # The position, the limit and the tables' rows read before the wait (inputs the step does not
        # write): the same bits, and the same caches, as read after it.
        kernels.EARLY_POSITION = True
        for pairs, step, masked in itertools.product((1, 2), (0, 32, 511, 600), ("limit", "bool")):
            caches = (torch.randn(1, H // G, S, D), torch.randn(1, H // G, S, D))
            q, k, v = torch.randn(1, H, 1, D), torch.randn(1, H // G, 1, D), torch.randn(1, H // G, 1, D)
            position = torch.tensor([step])
            mask = None if masked == "limit" else (torch.arange(S) <= step).view(1, 1, 1, S)
            results = []
            for unwritten in (False, True):
                key_cache, value_cache = (cache.clone() for cache in caches)
                got = decode_attention_update(q, k, v, key_cache, value_cache, position, mask, 0.3, G, position if mask is None else None,
                                              *tables[pairs], *tables[pairs], pairs, pairs, unwritten, True)
                results.append((got, key_cache, value_cache))
            assert all(torch.equal(late, early) for late, early in zip(*results)), (pairs, step, masked)
        print("ok")
    """)
    result = run_under_triton_interpreter(script)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


@pytest.mark.triton
@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
@pytest.mark.parametrize("update, early_position, go_ahead", [(False, False, False), (True, False, False), (True, True, False), (True, True, True)])
def test_inductor_sees_the_kernels_write_only_their_outputs_and_the_caches(update, early_position, go_ahead):
    """What Inductor's analysis of a user Triton kernel finds written decides what it copies
    around the launch: were the position, the tables or the query taken for written (the analysis
    failing, as it does on a machine without a GPU driver), every step would copy them. Run here
    for sm90 through a stand-in driver, on the launches of the 1B decoder's split call."""
    script = textwrap.dedent(f"""
        import types, torch, triton
        from triton.backends.compiler import GPUTarget
        from torch._higher_order_ops import triton_kernel_wrap
        from cuda_runner.compile import attention_kernel
        triton.runtime.driver.set_active(types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32)))
        launches = []

        class Recorded:
            def __init__(self, kernel):
                self.kernel = kernel
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    named = dict(zip(self.kernel.arg_names, args))
                    named.update({{key: value for key, value in kwargs.items() if key not in ("num_warps", "launch_pdl")}})
                    launches.append((self.kernel, named))
                return launch

        attention_kernel.wrap_triton = Recorded
        q = torch.randn(1, 32, 1, 64, dtype=torch.bfloat16)
        keys, values = (torch.randn(1, 8, 512, 64, dtype=torch.bfloat16) for _ in range(2))
        new_key, new_value = (torch.randn(1, 8, 1, 64, dtype=torch.bfloat16) for _ in range(2))
        position, cos, sin = torch.tensor([7]), torch.randn(512, 64), torch.randn(512, 64)
        attention_kernel.EARLY_POSITION = True
        attention_kernel.ATTENTION_GO_AHEAD_FIRST = attention_kernel.MERGE_GO_AHEAD_FIRST = {go_ahead}
        update = attention_kernel.CacheUpdate(new_key, new_value, position, (cos, sin, 1), (cos, sin, 2), {early_position},
                                              after_a_launch=True) if {update} else None
        for pdl in (False, True):
            attention_kernel.launch_attention(q, keys, values, None, position, torch.empty_like(q), 0.125, 4,
                                              attention_kernel.attention_plan(32, 512, 64, 64), pdl=pdl, update=update)
        written = []
        for kernel, named in launches:
            if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):  # torch 2.13; 2.11 has only identify_mutated_tensors
                found = [dep.name for dep in triton_kernel_wrap.identify_accessed_tensors(kernel, named, {{}}).read_writes.writes]
            else:
                found = triton_kernel_wrap.identify_mutated_tensors(kernel, named, {{}})
            written.append(sorted(name for name in found if isinstance(named.get(name), torch.Tensor)))
        print(written)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    attention = ["key", "part_acc", "part_max", "part_sum", "value"] if update else ["part_acc", "part_max", "part_sum"]
    assert result.returncode == 0 and result.stdout.strip() == str([attention, ["out"]] * 2), result.stderr[-2000:]


def test_a_cache_whose_heads_overlap_in_memory_keeps_its_writes():
    """Head 1 starting one row after head 0: one program's write would land where another reads."""
    pytest.importorskip("triton")
    from cuda_runner.compile.attention import fuse_decode_attention

    step = _CachedStep()
    step.k_cache = torch.zeros(16 * 8 + 8).as_strided((1, 2, 16, 8), (16 * 8, 8, 8, 1))
    args = (torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([3]))
    fused = fuse_decode_attention(torch.export.export(step, args).module())
    assert (fused.calls, fused.cache_updates) == (1, 0)


def test_the_rotation_tables_go_where_the_query_is_not_where_the_first_buffer_is():
    pytest.importorskip("triton")
    from compile.test_rotary import HalvesAttention

    from cuda_runner.compile.attention import fuse_decode_attention

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("first", torch.zeros(4, device="meta"))  # bookkeeping on another device
            self.attention = HalvesAttention()

        def forward(self, x, cache_position):
            return self.attention(x, cache_position)

    graph_module = torch.export.export(Outer(), (torch.randn(1, 1, 32), torch.tensor([3]))).module()
    assert next(graph_module.buffers()).device.type == "meta"
    fused = fuse_decode_attention(graph_module)
    assert fused.rotations == 2 and {str(table.device) for _, table in fused.tables} == {"cpu"}


def test_a_rewrite_that_fails_with_the_cache_update_costs_the_update_not_the_attention(monkeypatch):
    from types import SimpleNamespace

    from cuda_runner.compile import aot

    asked: list[bool] = []

    def fusion(module, written_elsewhere, update_caches):
        asked.append(update_caches)
        if update_caches:
            raise RuntimeError("no proof for you")
        return attention.Fused(2)

    monkeypatch.setattr(attention, "fuse_decode_attention", fusion)
    fake_torch = SimpleNamespace(_inductor=SimpleNamespace(aot_compile=lambda module, args, kwargs, options: "/nowhere/model.so"))
    kernels = aot.OwnKernels(attention=True, matvec=False, update=True)
    heard: list[str] = []
    aot._aot_compile(fake_torch, SimpleNamespace(module=object), (), {}, {}, False, "cuda", kernels, heard.append)
    assert asked == [True, False] and kernels.fused == 2 and kernels.update is False
    assert kernels.failures == {"update": "RuntimeError: no proof for you"}
    assert any("the cache writes and rotations in the fused attention did not compile" in line for line in heard)


class _CountingStep(torch.nn.Module):
    """A decode step written the way Hugging Face's static cache exports: each layer copies the
    step's position into a counter buffer of its own, takes arange(1) + counter as the index,
    advances the counter, writes the cache at the index; the mask comes from the index, RoPE's
    angles from the position."""

    def __init__(self, layers=2, heads=4, kv_heads=2, dim=8, length=16):
        super().__init__()
        self.heads, self.kv_heads, self.dim, self.length = heads, kv_heads, dim, length
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        for layer in range(layers):
            self.register_buffer(f"counter_{layer}", torch.zeros((), dtype=torch.int64))
            self.register_buffer(f"k_cache_{layer}", torch.zeros(1, kv_heads, length, dim))
            self.register_buffer(f"v_cache_{layer}", torch.zeros(1, kv_heads, length, dim))
        self.layers = layers
        self.project = torch.nn.Linear(dim * heads, (heads + 2 * kv_heads) * dim)

    def forward(self, x, cache_position):
        positions = torch.arange(1) + cache_position[0]
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos()[None, None], angles.sin()[None, None]
        for layer in range(self.layers):
            counter = getattr(self, f"counter_{layer}")
            counter.copy_(cache_position[0])
            index = torch.arange(1) + counter
            counter.add_(1)  # where Hugging Face's layer advances it: before the cache writes
            mask = (torch.arange(self.length)[None, :] <= index[:, None]).view(1, 1, 1, self.length)
            q, k, v = self.project(x).view(1, 1, -1, self.dim).transpose(1, 2).split([self.heads, self.kv_heads, self.kv_heads], dim=1)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            keys, values = getattr(self, f"k_cache_{layer}"), getattr(self, f"v_cache_{layer}")
            keys.index_copy_(2, index, k)
            values.index_copy_(2, index, v)
            x = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True).transpose(1, 2).reshape(1, 1, -1)
        return x


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_a_step_that_counts_its_position_the_hugging_face_way_is_fused_whole():
    pytest.importorskip("triton")
    from cuda_runner.compile.attention import fuse_decode_attention

    module = torch.export.export(_CountingStep(), (torch.randn(1, 1, 32), torch.tensor([3]))).module()
    fused = fuse_decode_attention(module)
    assert (fused.calls, fused.position_limits, fused.cache_updates, fused.rotations) == (2, 2, 2, 4)
    calls = _fused_update_calls(module)
    assert [call.args[5].name for call in calls] == ["cache_position"] * 2  # the kernel reads the input, not each layer's counter
    assert [call.args[-2:] for call in calls] == [(True, True)] * 2  # read early: the input nothing writes, after the projection
    assert sum(str(node.target) == "aten.add_.Tensor" for node in module.graph.nodes) == 2  # the counters still advance


def test_counters_and_caches_a_prefill_also_writes_leave_the_step_fused_whole():
    """In a bundle whose prefill writes the same counters and caches, the step still copies its position
    over each counter before reading it: what the prefill left there changes nothing the proofs rely on."""
    pytest.importorskip("triton")
    from cuda_runner.compile.attention import fuse_decode_attention

    module = torch.export.export(_CountingStep(), (torch.randn(1, 1, 32), torch.tensor([3]))).module()
    written = frozenset(f"{kind}_{layer}" for kind in ("counter", "k_cache", "v_cache") for layer in range(2))
    fused = fuse_decode_attention(module, written)
    assert (fused.calls, fused.position_limits, fused.cache_updates, fused.rotations) == (2, 2, 2, 4)


@pytest.mark.triton
@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed (CPU torch)")
def test_the_counting_step_and_hugging_faces_own_export_compute_what_they_did_under_tritons_interpreter():
    """The step above, and where transformers is installed a Llama of its own exported with its
    static cache (TorchExportableModuleWithStaticCache): step after step from position 0, the
    logits and every cache against the graph as exported."""
    script = textwrap.dedent("""
        import copy, importlib.util, torch
        from compile.test_attention import _CountingStep
        from cuda_runner.compile.attention import fuse_decode_attention
        cases = [(_CountingStep(), lambda step: ((torch.randn(1, 1, 32), torch.tensor([step])), {}), 16, (2, 2, 2, 4))]
        if importlib.util.find_spec("transformers"):
            from models import hugging_face_static_llama
            wrapped = hugging_face_static_llama()
            cases.append((wrapped, lambda step: ((), {"input_ids": torch.tensor([[step * 37 % 1000]]), "cache_position": torch.tensor([step])}),
                          12, (2, 2, 2, 4)))
        torch.manual_seed(0)
        for module, inputs, steps, counts in cases:
            args, kwargs = inputs(0)
            fused = torch.export.export(module, args, kwargs, strict=False).module()
            plain = torch.export.export(module, args, kwargs, strict=False).module()
            result = fuse_decode_attention(fused)
            assert (result.calls, result.position_limits, result.cache_updates, result.rotations) == counts, result
            with torch.no_grad():
                for step in range(steps):
                    args, kwargs = inputs(step)
                    got, want = fused(*args, **kwargs), plain(*args, **kwargs)
                    assert (got - want).abs().max().item() <= 1e-5, (type(module).__name__, step)
            wanted = dict(plain.named_buffers())
            for name, held in fused.named_buffers():
                if name in wanted:
                    assert torch.equal(held, wanted[name]) or (held - wanted[name]).abs().max().item() <= 1e-6, name
            print("ok", type(module).__name__)
    """)
    result = run_under_triton_interpreter(script)
    assert result.returncode == 0 and "ok _CountingStep" in result.stdout, result.stderr[-2000:]
    print(result.stdout)


def test_a_counter_the_step_only_copies_its_position_into_keeps_its_copy():
    """The mask computed from it is replaced by the position and erased, but not the copy into
    the counter (another method may read it): only ops that write nothing are erased with it."""
    pytest.importorskip("triton")
    from cuda_runner.compile.attention import fuse_decode_attention

    step = _CountingStep(layers=1)
    graph_module = torch.export.export(step, (torch.randn(1, 1, 32), torch.tensor([3]))).module()
    for node in list(graph_module.graph.nodes):  # the counter no longer advances: its copy is only read by the index
        if str(node.target) == "aten.add_.Tensor":
            graph_module.graph.erase_node(node)
    graph_module.recompile()
    fused = fuse_decode_attention(graph_module)
    assert (fused.position_limits, fused.cache_updates) == (1, 1)
    assert [str(node.target) for node in graph_module.graph.nodes].count("aten.copy_.default") == 1


def test_an_index_offset_by_a_tensor_another_method_writes_keeps_its_cache_writes():
    pytest.importorskip("triton")
    from cuda_runner.compile.step_position import step_position

    class Offset(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("offset", torch.zeros(1, dtype=torch.int64))

        def forward(self, position):
            return position + self.offset

    graph = torch.export.export(Offset(), (torch.tensor([3]),)).module().graph
    index = next(node for node in graph.nodes if node.op == "output").args[0][0]
    assert step_position(index, 8).name == "position"
    assert step_position(index, 8, written_elsewhere=frozenset({"offset"})) is None


@pytest.mark.parametrize("wrap", [lambda position: position % 16, lambda position: position.clamp(max=15)], ids=["ring", "clamped"])
def test_an_index_that_wraps_or_clamps_past_the_cache_keeps_its_cache_writes(wrap):
    """Equal to the position on 0..15, so a proof there alone took it; past the cache the graph
    writes at the wrapped index where the kernel, taking the position, writes nothing."""
    pytest.importorskip("triton")
    from cuda_runner.compile.step_position import step_position

    class Wrapped(torch.nn.Module):
        def forward(self, position):
            return wrap(position)

    graph = torch.export.export(Wrapped(), (torch.tensor([3]),)).module().graph
    index = next(node for node in graph.nodes if node.op == "output").args[0][0]
    assert step_position(index, 16) is None


def test_a_program_as_compile_moves_it_to_a_gpu_is_fused_whole():
    """The H200 found no position limit in any CUDA build, and no cache update or rotation in Hugging
    Face's: the proofs, run on the CPU, left the devices move_to_device_pass writes as strings on the GPU."""
    pytest.importorskip("triton")
    from cuda_runner.compile.attention import fuse_decode_attention

    config = scale_models.LLAMA_TINY
    model = scale_models.LlamaDecoder(config, torch.float32).eval()
    decoder = as_moved_to_a_gpu(torch.export.export(MethodOf(model, "decode"), scale_models.llama_examples(config, 6)["decode"]))
    counting = as_moved_to_a_gpu(torch.export.export(_CountingStep(), (torch.randn(1, 1, 32), torch.tensor([3]))))
    for program, layers in ((decoder, config.layers), (counting, 2)):
        fused = fuse_decode_attention(program.module())
        assert (fused.calls, fused.position_limits, fused.cache_updates, fused.rotations) == (layers, layers, layers, 2 * layers)


class _ExecuTorchStyleStep(torch.nn.Module):
    """ExecuTorch's Llama: the cache written with index_put_ (eager takes -1 for the last position) and
    the mask a causal buffer's row (at -1 its last row, which keeps every position)."""

    def __init__(self, length: int = 24):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, 2, length, 8))
        self.register_buffer("v_cache", torch.zeros(1, 2, length, 8))
        self.register_buffer("causal", torch.ones(length, length, dtype=torch.bool).tril())

    def forward(self, q, k, v, input_pos):
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        mask = self.causal[input_pos].view(1, 1, 1, -1)
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)


def test_the_inputs_taken_as_the_position_are_recorded_and_bounded_to_the_positions_proven(monkeypatch):
    """The bundle's bounds would take -24..23 (index_put_, as eager does); the kernel is proven for
    0..23 only, and at -1 keeps nothing where the causal row keeps everything: the spec says 0..23."""
    pytest.importorskip("triton")
    import cuda_runner.compile as compile_package
    from cuda_runner.compile.aot import CompiledLibrary
    from cuda_runner.compile.attention import fuse_decode_attention
    from cuda_runner.compile.input_bounds import input_bounds
    from cuda_runner.compile.signature import program_signature, with_bounds
    from cuda_runner.format.manifest import DeviceSpec

    args = (torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([3]))
    program = torch.export.export(_ExecuTorchStyleStep(), args)
    assert input_bounds(program) == {"input_pos": (-24, 23)}
    fused = fuse_decode_attention(program.module())
    assert (fused.position_limits, fused.positions) == (1, (("input_pos", 24),))
    signature = with_bounds(program_signature(program), input_bounds(program))
    compiled = CompiledLibrary(library=b"", weights=b"", device=DeviceSpec("cuda", "9.0"), options={}, positions=fused.positions)
    spec, _ = compile_package._method_spec(torch, "decode", signature, compiled, None, "cuda")
    assert spec.input("input_pos").bounds == (0, 23)


class _GradFreeRegion(torch.nn.Module):
    """RoPE-like angles computed where gradients are off, as transformers 5.17's Llama computes cos and sin."""

    def __init__(self):
        super().__init__()
        self.register_buffer("frequencies", torch.arange(4, dtype=torch.float32))

    def forward(self, x, position):
        with torch.no_grad():
            angle = position.float()[:, None] * self.frequencies[None]
            cos, sin = angle.cos(), angle.sin()
        return x * cos + x * sin


def test_a_region_exported_with_gradients_off_is_inlined_and_computes_the_same():
    """The export wraps it in a call of a submodule that the proofs cannot see into: a transformers
    5.17 static-cache Llama got no rotation proven (transformers 5.25 computes cos and sin inline)."""
    from cuda_runner.compile.attention import inline_grad_mode_regions

    region = torch.ops.higher_order.wrap_with_set_grad_enabled
    graph_module = torch.export.export(_GradFreeRegion(), (torch.randn(1, 4), torch.tensor([3]))).module()
    assert sum(node.target is region for node in graph_module.graph.nodes) == 1
    x, position = torch.randn(1, 4), torch.tensor([5])
    expected = graph_module(x, position)
    assert inline_grad_mode_regions(graph_module) == 1
    assert not any(node.target is region for node in graph_module.graph.nodes)
    assert torch.equal(graph_module(x, position), expected)
    assert inline_grad_mode_regions(graph_module) == 0
