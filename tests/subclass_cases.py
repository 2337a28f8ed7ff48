"""Tensor subclasses the subclass tests export: torch's `TwoTensor` and one of our own.

`Scaled` is written the way quantization libraries write theirs (torchao's `Int8Tensor`): an
int8 tensor and a per-row scale, a `__torch_function__` that runs `F.linear` on the
dequantized weight, a `__torch_dispatch__` for the few ops a module applies to a parameter,
and a method forward calls (`dequantize`).  Module level, so a loading process finds it.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._python_dispatch import return_and_correct_aliasing

__all__ = ["Configured", "Fancy", "Opaque", "QuantConfig", "Rounding", "Scaled", "ScaledLinear", "TwoTensor", "quantize"]


class Scaled(torch.Tensor):
    """`qdata * scale` (int8 per row, float scale per row), shaped as the float weight."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        self.qdata = qdata
        self.scale = scale

    def __tensor_flatten__(self):
        return ["qdata", "scale"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        return Scaled(inner["qdata"], inner["scale"], context["dtype"])

    def dequantize(self) -> torch.Tensor:
        return self.qdata.to(self.dtype) * self.scale

    def __repr__(self) -> str:
        return f"Scaled({tuple(self.shape)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w, *rest = args
            return F.linear(x, w.dequantize(), *rest, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.clone.default):
            (t,) = args
            names, context = t.__tensor_flatten__()
            out = type(t).__tensor_unflatten__({n: func(getattr(t, n)) for n in names}, context, t.shape, t.stride())
            return return_and_correct_aliasing(func, args, kwargs, out)
        raise NotImplementedError(f"Scaled does not implement {func}")


def quantize(w: torch.Tensor) -> Scaled:
    """`w` as a `Scaled` (symmetric int8 per row)."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
    return Scaled(torch.round(w / scale).to(torch.int8), scale, w.dtype)


class Rounding(enum.Enum):
    """A plain enum: a file may name its members without `types=` (no code of its own)."""

    NEAREST = 1
    DOWN = 2


class Fancy(enum.Enum):
    """An enum with a method of its own: a file may name its members only with `types=`."""

    PLAIN = 1

    def describe(self) -> str:
        return self.name.lower()


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """A quantization config in a flatten context, as torchao's `QuantizeTensorToInt8Kwargs`."""

    bits: int
    rounding: Rounding
    fancy: Fancy = Fancy.PLAIN


class Configured(Scaled):
    """A `Scaled` whose flatten context holds a dataclass instance and enum members, as
    torchao's `Int8Tensor(act_quant_kwargs=QuantizeTensorToInt8Kwargs(PerRow(), ...))`."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, config: QuantConfig):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, config: QuantConfig):
        super().__init__(qdata, scale, dtype)
        self.config = config

    def __tensor_flatten__(self):
        return ["qdata", "scale"], {"dtype": self.dtype, "config": self.config}

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        return Configured(inner["qdata"], inner["scale"], context["dtype"], context["config"])


class ScaledLinear(torch.nn.Module):
    """Two linears whose weights are `Scaled`, frozen as a quantized model's are."""

    def __init__(self, config: QuantConfig | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        for lin in (self.a, self.b):
            weight = quantize(lin.weight.detach())
            if config is not None:
                weight = Configured(weight.qdata, weight.scale, weight.dtype, config)
            lin.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Opaque(torch.Tensor):
    """A subclass with rules of its own and no `__tensor_flatten__`: export cannot take it apart."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, lambda t: t * 2 if func is torch.Tensor.add else t, out)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(torch.nn.Module):
    """A Llama-style decoder layer: RMSNorm, causal attention (SDPA), RMSNorm, SwiGLU."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(dim, 2 * dim, bias=False), torch.nn.Linear(dim, 2 * dim, bias=False)
        self.down = torch.nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(torch.nn.Module):
    """Embedding, `layers` decoder blocks, a final norm and the output head."""

    def __init__(self, vocab: int = 64, dim: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
