"""Rotations by the step's position (compile/rotary.py): the forms models
write RoPE in are proven by their values, with the tables the kernel reads;
what only looks like one, or reads what the step or another method writes,
is not taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import MethodOf, scale_models

from cuda_runner.compile import rotary
from cuda_runner.compile.attention import decode_attention_sites


def _position(graph, name="input_pos"):
    return next(node for node in graph.nodes if node.op == "placeholder" and node.name == name)


def _llama(dtype=torch.float32):
    config = scale_models.LLAMA_TINY
    model = scale_models.LlamaDecoder(config, dtype).eval()
    module = torch.export.export(MethodOf(model, "decode"), scale_models.llama_examples(config, 6)["decode"]).module()
    return module, config


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HalvesAttention(torch.nn.Module):
    """Hugging Face's Llama form: cos and sin computed from inv_freq and the
    position each step, rounded to the model's dtype, and rotate_half; `norm`
    puts a per-head RMSNorm on q and k before the rotation (Qwen3's QK-norm);
    `mix` rolls the query's heads after it (no rotation the kernel computes)."""

    def __init__(self, heads=4, kv_heads=2, dim=16, length=24, norm=False, mix=False, per_head=False):
        super().__init__()
        self.heads, self.kv_heads, self.dim, self.norm, self.mix, self.per_head = heads, kv_heads, dim, norm, mix, per_head
        self.q = torch.nn.Linear(32, heads * dim, bias=False)
        self.k = torch.nn.Linear(32, kv_heads * dim, bias=False)
        self.v = torch.nn.Linear(32, kv_heads * dim, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        self.register_buffer("head_scale", torch.linspace(0.5, 1.5, heads).view(1, heads, 1, 1))
        self.register_buffer("k_cache", torch.zeros(1, kv_heads, length, dim))
        self.register_buffer("v_cache", torch.zeros(1, kv_heads, length, dim))

    def forward(self, x, cache_position):
        freqs = (self.inv_freq[None, :, None].float() @ cache_position[None, None, :].float()).transpose(1, 2)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(x.dtype).unsqueeze(1), angles.sin().to(x.dtype).unsqueeze(1)
        q = self.q(x).view(1, 1, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(1, 1, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v(x).view(1, 1, self.kv_heads, self.dim).transpose(1, 2)
        if self.norm:
            q, k = F.rms_norm(q, (self.dim,)), F.rms_norm(k, (self.dim,))
        q_sin = sin * self.head_scale if self.per_head else sin
        q, k = q * cos + _rotate_half(q) * q_sin, k * cos + _rotate_half(k) * sin
        if self.mix:
            q = q.roll(1, dims=1)
        self.k_cache.index_copy_(2, cache_position, k)
        self.v_cache.index_copy_(2, cache_position, v)
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, enable_gqa=True)


def _halves_graph(dtype=torch.float32, **options):
    module = HalvesAttention(**options).to(dtype).eval()
    graph_module = torch.export.export(module, (torch.randn(1, 1, 32, dtype=dtype), torch.tensor([3]))).module()
    (site,) = decode_attention_sites(graph_module.graph)
    return graph_module, site


def test_the_decoders_neighbour_pairs_are_proven_from_its_tables_once_for_every_layer():
    module, config = _llama()
    position = _position(module.graph)
    proven: dict = {}
    for site in decode_attention_sites(module.graph):
        for rotated in (site.query, site.key.args[3]):
            found = rotary.rotation(rotated, position, config.max_seq, proven=proven)
            assert found is not None and found.pairs == rotary.NEIGHBOURS
            assert str(found.source.target) == "aten.transpose.int"  # the projection's view, not its float32 cast
            cos, sin = module.model.rope_cos, module.model.rope_sin  # [positions, D/2], float32
            assert torch.equal(found.cos[:, 0::2], cos) and torch.equal(found.cos[:, 1::2], cos)
            assert torch.equal(found.sin[:, 0::2], -sin) and torch.equal(found.sin[:, 1::2], sin)
    assert len(proven) == 2  # the query's and the key's, each proven once for both layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hugging_faces_halves_are_proven_with_cos_and_sin_as_the_model_rounds_them(dtype):
    graph_module, site = _halves_graph(dtype)
    position = _position(graph_module.graph, "cache_position")
    found = rotary.rotation(site.query, position, 24)
    assert found is not None and found.pairs == rotary.HALVES
    angles = torch.outer(torch.arange(24).float(), graph_module.inv_freq)
    cos, sin = angles.cos().to(dtype).float(), angles.sin().to(dtype).float()
    assert torch.equal(found.cos, torch.cat((cos, cos), dim=1))
    assert torch.equal(found.sin, torch.cat((-sin, sin), dim=1))
    assert rotary.rotation(site.key.args[3], position, 24).pairs == rotary.HALVES


def test_a_norm_before_the_rotation_stays_the_models_and_the_rotation_starts_after_it():
    graph_module, site = _halves_graph(norm=True)
    found = rotary.rotation(site.query, _position(graph_module.graph, "cache_position"), 24)
    assert found is not None and "rms_norm" in str(found.source.target)


@pytest.mark.parametrize("options", [{"mix": True}, {"per_head": True}], ids=["heads mixed", "sin scaled per head"])
def test_what_only_looks_like_a_rotation_is_not_taken(options):
    graph_module, site = _halves_graph(**options)
    assert rotary.rotation(site.query, _position(graph_module.graph, "cache_position"), 24) is None


def test_a_map_that_is_not_linear_in_the_projection_is_not_taken():
    class Folded(torch.nn.Module):
        def __init__(self, fold):
            super().__init__()
            self.fold = fold

        def forward(self, q, position):
            angle = torch.arange(8, dtype=torch.float32)[position].view(1, 1, 1, 1)
            rotated = q * angle.cos() + _rotate_half(q) * angle.sin()
            return rotated.abs() if self.fold else rotated  # abs() is right on probes of 0 and 1 alone

    for fold, taken in ((False, True), (True, False)):
        graph_module = torch.export.export(Folded(fold), (torch.randn(1, 2, 1, 8), torch.tensor([1]))).module()
        output = next(node for node in graph_module.graph.nodes if node.op == "output").args[0][0]
        assert (rotary.rotation(output, _position(graph_module.graph, "position"), 8) is not None) is taken



def test_tables_that_another_method_or_the_step_writes_are_not_proven():
    module, config = _llama()
    position = _position(module.graph)
    site = decode_attention_sites(module.graph)[0]
    assert rotary.rotation(site.query, position, config.max_seq, written_elsewhere=frozenset({"model.rope_cos"})) is None

    class Refilled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos", torch.rand(8, 4))

        def forward(self, q, position):
            self.cos.mul_(1.0)  # the step writes its own table
            cos = self.cos[position].view(1, 1, 1, 4).repeat_interleave(2, dim=-1)
            return q * cos

    graph_module = torch.export.export(Refilled(), (torch.randn(1, 2, 1, 8), torch.tensor([1]))).module()
    output = next(node for node in graph_module.graph.nodes if node.op == "output").args[0][0]
    assert rotary.rotation(output, _position(graph_module.graph, "position"), 8) is None



class _Rotated(torch.nn.Module):
    """q [1, 2, 1, 8] rotated in halves by a table of 16 positions, with `before` applied to q
    first and `after` to the rotation; `tables` holds cos and sin, which `cos_t` and `sin_t` view."""

    def __init__(self, before=lambda q: q, after=lambda q: q):
        super().__init__()
        self.before, self.after = before, after
        angles = torch.outer(torch.arange(16).float(), 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("tables", torch.stack((angles.cos(), angles.sin())))
        self.register_buffer("cos_t", self.tables[0])
        self.register_buffer("sin_t", self.tables[1])

    def forward(self, q, position):
        q = self.before(q)
        return self.after(q * self.cos_t[position] + _rotate_half(q) * self.sin_t[position])


def _rotated(module, written_elsewhere=frozenset()):
    graph_module = torch.export.export(module, (torch.randn(1, 2, 1, 8), torch.tensor([1]))).module()
    output = next(node for node in graph_module.graph.nodes if node.op == "output").args[0][0]
    return rotary.rotation(output, _position(graph_module.graph, "position"), 16, written_elsewhere)


@pytest.mark.parametrize("after", [lambda q: q.clamp(-8000, 8000), lambda q: torch.nan_to_num(q, posinf=100.0)], ids=["clamp", "nan_to_num"])
def test_ops_no_probe_shows_to_be_nonlinear_are_not_taken_on_the_rotations_side(after):
    """Both are the identity on every value the probes reach (up to about 4000)."""
    assert _rotated(_Rotated()) is not None
    assert _rotated(_Rotated(after=after)) is None


@pytest.mark.parametrize("narrow", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_a_round_trip_through_a_coarser_dtype_stays_the_models(narrow):
    """Proven in float64 it would vanish, and the kernel would read q unrounded."""
    found = _rotated(_Rotated(before=lambda q: q.to(narrow).to(torch.float32)))
    assert found is not None and str(found.source.args[0].meta["val"].dtype) == str(narrow)  # the rotation starts after it


def test_a_table_that_views_a_buffer_another_method_writes_is_not_proven():
    assert _rotated(_Rotated(), written_elsewhere=frozenset({"cos_t"})) is None
    assert _rotated(_Rotated(), written_elsewhere=frozenset({"tables"})) is None  # by memory, not by name
    assert _rotated(_Rotated(), written_elsewhere=frozenset({"elsewhere"})) is not None


def test_a_quotient_rounded_to_an_integer_on_the_rotations_side_is_not_taken():
    """div(x, 1e4, rounding_mode="trunc") is 0 on every probe and not on a model's activations."""
    after = lambda q: q + torch.div(q, 1e4, rounding_mode="trunc") * 1e4  # noqa: E731
    assert _rotated(_Rotated(after=after)) is None


def test_scaling_on_the_rotations_side_that_loses_precision_in_float16_is_not_taken():
    """Proven in float64 the two scales cancel; in float16 the first underflows."""
    module = _Rotated(before=lambda q: (q * 1e-6) * 1e6).to(torch.float16)
    graph_module = torch.export.export(module, (torch.randn(1, 2, 1, 8, dtype=torch.float16), torch.tensor([1]))).module()
    output = next(node for node in graph_module.graph.nodes if node.op == "output").args[0][0]
    found = rotary.rotation(output, _position(graph_module.graph, "position"), 16)
    assert found is None or str(found.source.args[0].target) == "aten.mul.Tensor"  # if taken at all, from after both scalings
