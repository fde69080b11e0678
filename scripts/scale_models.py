"""The models users ship, written here at any size: a Llama-shaped decoder, ViT-B/16,
ResNet-50 and a Whisper-base-shaped encoder-decoder.

`scripts/bench_scale.py` builds them at their real sizes on the GPU machine
(random weights, never carried); the tests build the same code at tiny
configurations (`tests/scale/`), so CI checks what the benchmark measures.

The decoder and Whisper's decoder keep their KV caches in registered buffers,
written in place at the positions given (`index_copy_`), as ExecuTorch's
exports of Llama and Whisper do: `prefill(tokens[1, T], input_pos[T])` and
`decode(tokens[1, 1], input_pos[1])` read the same weights and the same cache,
and return the logits of the last position only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------
# A Llama-shaped decoder


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 32000
    dim: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 8192
    max_seq: int = 512  # KV cache positions
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


LLAMA_1B = LlamaConfig()
LLAMA_TINY = LlamaConfig(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, max_seq=32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def _rope_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    frequencies = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
    angles = torch.outer(torch.arange(config.max_seq).float(), frequencies)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [B, H, T, D] with cos/sin [T, D/2], pairs (even, odd) rotated."""
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return rotated.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.wq = nn.Linear(config.dim, config.heads * hd, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * hd, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * hd, bias=False)
        self.wo = nn.Linear(config.heads * hd, config.dim, bias=False)
        shape = (1, config.kv_heads, config.max_seq, hd)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        c = self.config
        q = self.wq(x).view(batch, length, c.heads, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, length, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, length, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        repeat = c.heads // c.kv_heads
        keys = self.k_cache.repeat_interleave(repeat, dim=1)
        values = self.v_cache.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(batch, length, c.heads * c.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: torch.dtype):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, dtype)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.w1 = nn.Linear(config.dim, config.ffn, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn, bias=False)
        self.w2 = nn.Linear(config.ffn, config.dim, bias=False)

    def forward(self, x, input_pos, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), input_pos, cos, sin, mask)
        hidden = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(hidden)) * self.w3(hidden))


class LlamaDecoder(nn.Module):
    """RMSNorm, RoPE, grouped-query attention, SwiGLU; KV caches as buffers."""

    def __init__(self, config: LlamaConfig = LLAMA_1B, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)
        cos, sin = _rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.to(dtype)
        self.rope_cos, self.rope_sin = cos, sin  # the tables stay float32

    def _step(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        # Position p attends to cache positions 0..p (absolute: the cache holds the prompt and every step before).
        mask = (torch.arange(self.config.max_seq, device=tokens.device)[None, :] <= input_pos[:, None]).view(1, 1, -1, self.config.max_seq)
        for layer in self.layers:
            x = layer(x, input_pos, cos, sin, mask)
        return self.output(self.norm(x[:, -1, :]))  # the last position's logits: [1, vocab]

    def prefill(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self._step(tokens, input_pos)

    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self._step(tokens, input_pos)

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def cache_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for name, b in self.named_buffers() if name.endswith("_cache"))


def llama_examples(config: LlamaConfig, prompt: int, device: str = "cpu") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Example inputs of both methods: a prompt of `prompt` tokens, and one token at the position after it."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab, (1, prompt), generator=generator)
    return {"prefill": (tokens.to(device), torch.arange(prompt).to(device)),
            "decode": (tokens[:, :1].to(device), torch.tensor([prompt]).to(device))}


def llama_dynamic_shapes(config: LlamaConfig) -> dict[str, tuple]:
    """The prefill's prompt length is dynamic, up to one short of the cache."""
    length = torch.export.Dim("prompt", min=2, max=config.max_seq - 1)
    return {"prefill": ({1: length}, {0: length}), "decode": None}


# ---------------------------------------------------------------------------
# ViT-B/16


@dataclass(frozen=True)
class VitConfig:
    image: int = 224
    patch: int = 16
    dim: int = 768
    layers: int = 12
    heads: int = 12
    mlp: int = 3072
    classes: int = 1000


VIT_B16 = VitConfig()
VIT_TINY = VitConfig(image=32, patch=8, dim=32, layers=1, heads=4, mlp=64, classes=5)


class VisionTransformer(nn.Module):
    def __init__(self, config: VitConfig = VIT_B16):
        super().__init__()
        self.patches = nn.Conv2d(3, config.dim, kernel_size=config.patch, stride=config.patch)
        count = (config.image // config.patch) ** 2
        self.cls = nn.Parameter(torch.randn(1, 1, config.dim) * 0.02)
        self.positions = nn.Parameter(torch.randn(1, count + 1, config.dim) * 0.02)
        layer = nn.TransformerEncoderLayer(config.dim, config.heads, config.mlp, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, config.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(image).flatten(2).transpose(1, 2)
        tokens = torch.cat((self.cls.expand(image.shape[0], -1, -1), tokens), dim=1) + self.positions
        return self.head(self.norm(self.encoder(tokens))[:, 0])


# ---------------------------------------------------------------------------
# ResNet-50


class Bottleneck(nn.Module):
    def __init__(self, inputs: int, width: int, stride: int):
        super().__init__()
        outputs = width * 4
        self.conv1, self.bn1 = nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, outputs, 1, bias=False), nn.BatchNorm2d(outputs)
        self.shortcut = (nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs))
                         if stride != 1 or inputs != outputs else nn.Identity())

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-50 with blocks (3, 4, 6, 3) and base width 64; smaller with other arguments."""

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        stages, inputs = [], width
        for index, count in enumerate(blocks):
            stage_width = width * 2 ** index
            for block in range(count):
                stages.append(Bottleneck(inputs, stage_width, 2 if block == 0 and index > 0 else 1))
                inputs = stage_width * 4
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(inputs, classes)

    def forward(self, image):
        return self.head(self.stages(self.stem(image)).mean((2, 3)))


def resnet50() -> ResNet:
    return ResNet()


def resnet_tiny() -> ResNet:
    return ResNet(blocks=(1, 1), width=8, classes=5)


def randomize_batch_norms(module: nn.Module, seed: int = 0) -> nn.Module:
    """Random running statistics (freshly made ones are 0 and 1, which folding hides)."""
    generator = torch.Generator().manual_seed(seed)
    for layer in module.modules():
        if isinstance(layer, nn.BatchNorm2d):
            layer.running_mean.copy_(torch.randn(layer.num_features, generator=generator) * 0.1)
            layer.running_var.copy_(torch.rand(layer.num_features, generator=generator) + 0.5)
    return module


# ---------------------------------------------------------------------------
# A Whisper-base-shaped encoder-decoder


@dataclass(frozen=True)
class WhisperConfig:
    mels: int = 80
    frames: int = 3000  # 30 s of audio at 100 frames/s
    dim: int = 512
    heads: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    vocab: int = 51865
    max_tokens: int = 448

    @property
    def audio_positions(self) -> int:
        return self.frames // 2


WHISPER_BASE = WhisperConfig()
WHISPER_TINY = WhisperConfig(mels=8, frames=40, dim=32, heads=4, encoder_layers=1, decoder_layers=1, vocab=64, max_tokens=16)


def _sinusoids(length: int, channels: int) -> torch.Tensor:
    scales = torch.exp(-math.log(10000) / (channels // 2 - 1) * torch.arange(channels // 2))
    angles = torch.arange(length)[:, None] * scales[None, :]
    return torch.cat((angles.sin(), angles.cos()), dim=1)


class CachedSelfAttention(nn.Module):
    def __init__(self, config: WhisperConfig):
        super().__init__()
        self.heads = config.heads
        self.query, self.key, self.value = (nn.Linear(config.dim, config.dim) for _ in range(3))
        self.out = nn.Linear(config.dim, config.dim)
        shape = (1, config.heads, config.max_tokens, config.dim // config.heads)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))

    def forward(self, x, input_pos, mask):
        batch, length, dim = x.shape
        split = lambda t: t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return self.out(out.transpose(1, 2).reshape(batch, length, dim))


class WhisperDecoderLayer(nn.Module):
    def __init__(self, config: WhisperConfig):
        super().__init__()
        self.self_norm, self.self_attention = nn.LayerNorm(config.dim), CachedSelfAttention(config)
        self.cross_norm = nn.LayerNorm(config.dim)
        self.cross_attention = nn.MultiheadAttention(config.dim, config.heads, batch_first=True)
        self.mlp_norm = nn.LayerNorm(config.dim)
        self.mlp = nn.Sequential(nn.Linear(config.dim, 4 * config.dim), nn.GELU(), nn.Linear(4 * config.dim, config.dim))

    def forward(self, x, audio, input_pos, mask):
        x = x + self.self_attention(self.self_norm(x), input_pos, mask)
        attended, _ = self.cross_attention(self.cross_norm(x), audio, audio, need_weights=False)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x))


class Whisper(nn.Module):
    """encode(mel [1, mels, frames]) -> audio features; decode(token [1, 1], input_pos [1], audio) -> logits,
    its self-attention KV caches in buffers (the cross-attention reads the audio features each step)."""

    def __init__(self, config: WhisperConfig = WHISPER_BASE):
        super().__init__()
        self.config = config
        self.conv1 = nn.Conv1d(config.mels, config.dim, 3, padding=1)
        self.conv2 = nn.Conv1d(config.dim, config.dim, 3, stride=2, padding=1)
        self.register_buffer("audio_positions", _sinusoids(config.audio_positions, config.dim), persistent=False)
        layer = nn.TransformerEncoderLayer(config.dim, config.heads, 4 * config.dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, config.encoder_layers, enable_nested_tensor=False)
        self.encoder_norm = nn.LayerNorm(config.dim)
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.token_positions = nn.Parameter(torch.randn(config.max_tokens, config.dim) * 0.02)
        self.decoder = nn.ModuleList(WhisperDecoderLayer(config) for _ in range(config.decoder_layers))
        self.decoder_norm = nn.LayerNorm(config.dim)

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2) + self.audio_positions
        return self.encoder_norm(self.encoder(x))

    def decode(self, token: torch.Tensor, input_pos: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        x = self.tokens(token) + self.token_positions[input_pos]
        mask = (torch.arange(self.config.max_tokens, device=token.device)[None, :] <= input_pos[:, None]).view(1, 1, -1, self.config.max_tokens)
        for layer in self.decoder:
            x = layer(x, audio, input_pos, mask)
        return self.decoder_norm(x[:, -1]) @ self.tokens.weight.t()


def whisper_examples(config: WhisperConfig, device: str = "cpu") -> dict[str, tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    mel = torch.randn(1, config.mels, config.frames, generator=generator).to(device)
    audio = torch.randn(1, config.audio_positions, config.dim, generator=generator).to(device)
    return {"encode": (mel,), "decode": (torch.tensor([[1]]).to(device), torch.tensor([0]).to(device), audio)}


def tiny(config, **changes):
    """A config with some fields changed (for tests)."""
    return replace(config, **changes)
