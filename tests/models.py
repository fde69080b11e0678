"""Small example models: the demo compiles one, and the tests compile several.

Each builder returns (module, example args, dynamic_shapes)."""

from __future__ import annotations

import torch
from torch.export import Dim


class DictMLP(torch.nn.Module):
    """float32, dynamic batch, nested dict outputs (named 'logits', 'aux.loss', 'aux.hidden')."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.encoder = torch.nn.Linear(16, width)
        self.head = torch.nn.Linear(width, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor):
        hidden = torch.relu(self.encoder(x))
        return {"logits": self.head(hidden) + bias, "aux": {"loss": hidden.mean(), "hidden": hidden}}


class Embedder(torch.nn.Module):
    """int64 indices in, several outputs out: a bfloat16 tensor, a transposed
    (non-contiguous) view, and an int64 passthrough count."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(50, 8)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor):
        vectors = self.table(ids) * scale
        pooled = vectors.sum(dim=1)
        return pooled.to(torch.bfloat16), pooled.t(), (ids > 10).sum(dim=1)


class Bf16MLP(torch.nn.Module):
    """bfloat16 weights, input and output."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))

    def forward(self, x: torch.Tensor):
        return self.layers(x)


def dict_mlp():
    torch.manual_seed(0)
    batch = Dim("batch", min=1, max=64)
    return DictMLP().eval(), (torch.randn(4, 16), torch.randn(8)), {"x": {0: batch}, "bias": None}


def embedder():
    torch.manual_seed(1)
    return Embedder().eval(), (torch.randint(0, 50, (3, 6)), torch.tensor(0.5)), None


def bf16_mlp():
    torch.manual_seed(2)
    return Bf16MLP().to(torch.bfloat16).eval(), (torch.randn(2, 32).to(torch.bfloat16),), None


BUILDERS = {"dict_mlp": dict_mlp, "embedder": embedder, "bf16_mlp": bf16_mlp}


def linear():
    """One layer with a bounded dynamic batch: what a Ray batch is split against."""
    torch.manual_seed(3)
    return torch.nn.Linear(16, 4).eval(), (torch.randn(2, 16),), {"input": {0: Dim("batch", max=64)}}


BUILDERS["linear"] = linear


class Writer(torch.nn.Module):
    """Writes what a run changes: its buffer adds up every x it is given (a KV
    cache in miniature), a step counter counts the runs (a new value from
    buffers alone, which Inductor's constant folding once froze), and it
    doubles its input y in place. `offset` is a buffer no run writes."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.full((4,), 0.5))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("offset", torch.tensor([0.25, -0.5, 0.75, -1.0]))
        self.scale = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        self.steps.add_(1)
        y.mul_(2.0)
        return self.total * self.scale + y + self.offset * x + self.steps


def writer():
    return Writer(), (torch.ones(4), torch.ones(4)), None


BUILDERS["writer"] = writer


class Views(torch.nn.Module):
    """Outputs that share memory: one tensor twice, and a view of an input."""

    def forward(self, x: torch.Tensor):
        doubled = x * 2
        return doubled, doubled, x[1:]


def views():
    return Views().eval(), (torch.arange(12.0).reshape(4, 3),), None


BUILDERS["views"] = views


class PrefillDecode(torch.nn.Module):
    """`forward` and `decode` read one Linear (`shared`); only `forward` has a head:
    what a bundle with shared weights is compiled from."""

    def __init__(self, width: int = 16, hidden: int = 8, outputs: int = 4, seed: int = 11) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.shared = torch.nn.Linear(width, hidden)
        self.head = torch.nn.Linear(hidden, outputs)

    def forward(self, x):
        return self.head(torch.relu(self.shared(x)))

    def decode(self, x):
        return torch.tanh(self.shared(x))


class TinyViT(torch.nn.Module):
    """A vision transformer in miniature: a patch-embedding convolution, one
    pre-norm encoder layer (attention, LayerNorm, GELU) and a linear head, with
    a small convolution stem in front so that a grouped and a strided
    convolution run too. Compiled --standalone for the CPU, it needs the
    shim's convolution, GEMMs (attention lowered from its math form) and vector math."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(12)
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                        torch.nn.Conv2d(8, 8, 3, padding=1, groups=4))
        self.patches = torch.nn.Conv2d(8, 32, kernel_size=8, stride=8)
        self.encoder = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True, norm_first=True,
                                                        activation="gelu", dropout=0.0)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(self.stem(image)).flatten(2).transpose(1, 2)
        return self.head(self.encoder(tokens).mean(dim=1))


def tiny_vit():
    return TinyViT().eval(), (torch.randn(2, 3, 32, 32),), None


BUILDERS["tiny_vit"] = tiny_vit
